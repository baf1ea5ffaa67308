"""transformers' GPT-2 uses `Conv1D` (weight stored as (in, out)). Inside effkit those layers become
`nn.Linear` (weight (out, in)) so that DTensor's parallel styles, torch-pruning and quantizers apply;
saving transposes them back so that artifacts load in plain transformers."""

from __future__ import annotations

import torch
from torch import nn

CONV_NAMES = ("c_attn", "c_proj", "c_fc", "q_attn")


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                d_in, d_out = child.weight.shape
                lin = nn.Linear(d_in, d_out, bias=child.bias is not None, device=child.weight.device,
                                dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(parent, name, lin)
    return model


def _is_conv_weight(key: str) -> bool:
    parts = key.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in CONV_NAMES and ".h." in f".{key}"


def hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """effkit (Linear) state dict -> transformers GPT-2 (Conv1D) layout."""
    return {k: (v.t().contiguous() if _is_conv_weight(k) else v) for k, v in state_dict.items()}
