"""What pruning methods share: the prunable layers, their sparsity, and rebuilding a structurally pruned GPT-2
from its new `GPT2Config` and its pruned weights.

GPT-2's modules keep sizes computed at construction (`embed_dim`, `head_dim`, `split_size`, `scaling`,
`layer_idx`), so a model whose tensors were cut in place would run with stale ones. Width and depth pruning
therefore build a fresh model from the changed config and load the pruned state dict into it (strictly: every
tensor must fit): the model effkit fine-tunes and measures is by construction the one plain `from_pretrained`
builds from the saved folder.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from effkit.model.convert import conv1d_to_linear


def rebuild(model: nn.Module, state_dict: dict[str, torch.Tensor], **config_changes) -> nn.Module:
    from transformers import GPT2LMHeadModel

    cfg = copy.deepcopy(model.config)
    for k, v in config_changes.items():
        setattr(cfg, k, v)
    p = next(model.parameters())
    new = conv1d_to_linear(GPT2LMHeadModel(cfg))
    new.load_state_dict({k: v.detach().clone() for k, v in state_dict.items()}, strict=True)
    new.config.use_cache = False
    return new.to(device=p.device, dtype=p.dtype).train(model.training)


def prunable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers of the transformer blocks (embeddings, LayerNorms and the tied head excluded)."""
    return {name: m for name, m in model.transformer.h.named_modules() if isinstance(m, nn.Linear)}


def sparsity(model: nn.Module) -> tuple[int, int]:
    """(zeros, total) counted over the prunable weights."""
    zeros = total = 0
    for lin in prunable_linears(model).values():
        zeros += int((lin.weight == 0).sum())
        total += lin.weight.numel()
    return zeros, total
