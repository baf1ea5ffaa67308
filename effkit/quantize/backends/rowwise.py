"""effkit's own int8 storage, shared by the backends whose PyTorch modules transformers cannot serialize
(`dynamic`, `torchao`): per-output-row symmetric int8 weights plus fp32 scales in safetensors
(`quantized.safetensors`), the rest of the weights in fp32, next to `quantization.json` (backend, scheme, layer
names). At quantize time the weights are first rounded to exactly those int8 values; reloading dequantizes them
and applies the same backend again, which reproduces the measured model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from effkit.errors import EffkitError
from effkit.model import conv1d_to_linear

WEIGHTS_FILE = "quantized.safetensors"
STORAGE = "per-output-row symmetric int8 + fp32 scales (safetensors)"


def quant_targets(model: nn.Module, include_head: bool) -> list[str]:
    names = [f"transformer.h.{n}" for n, m in model.transformer.h.named_modules() if isinstance(m, nn.Linear)]
    return names + (["lm_head"] if include_head else [])


def int8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.squeeze(1).float()


@torch.no_grad()
def fake_quantize(model: nn.Module, names: list[str], include_head: bool) -> dict[str, torch.Tensor]:
    """Round the target weights to per-row int8 in place; return the int8 tensors and scales to store."""
    stored = {}
    for name in names + (["transformer.wte"] if include_head else []):
        w = model.get_submodule(name).weight
        q, s = int8_rowwise(w.float())
        w.copy_((q.float() * s.unsqueeze(1)).to(w.dtype))
        stored[f"{name}.weight.int8"], stored[f"{name}.weight.scale"] = q, s
    return stored


def write(folder: Path, parent: nn.Module, tokenizer, include_head: bool) -> dict[str, Any]:
    """Round a copy of `parent` to int8 and store it in effkit's format; returns the description's format keys
    and the quantized layer names."""
    names = quant_targets(parent, include_head)
    model = copy.deepcopy(parent)
    stored = fake_quantize(model, names, include_head)
    skip = {f"{n}.weight" for n in names} | ({"transformer.wte.weight", "lm_head.weight"} if include_head else set())
    rest = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
            if k not in skip and k != "lm_head.weight"}  # the LM head is tied to the embedding
    save_file({**rest, **{k: v.cpu().contiguous() for k, v in stored.items()}}, folder / WEIGHTS_FILE)
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"format": "effkit", "storage": STORAGE, "layers": names}


def load(path: Path, device: torch.device) -> nn.Module:
    """The dequantized fp32 model (effkit's Linear form) of an artifact in effkit's format, on `device`, ready
    for its backend to quantize the stored layers again."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config.from_pretrained(path)
    config._attn_implementation = "sdpa"
    model = conv1d_to_linear(GPT2LMHeadModel(config))
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise EffkitError(f"{path / WEIGHTS_FILE} is unreadable or truncated ({type(e).__name__}); quantize the "
                          "parent again") from None
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".weight.int8")]:
            name = key.removesuffix(".weight.int8")
            tensors[f"{name}.weight"] = tensors.pop(key).float() * tensors.pop(f"{name}.weight.scale").unsqueeze(1)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise EffkitError(f"{path} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.eval().to(device)
    model.config.use_cache = False
    return model


def load_command(folder: Path) -> str:
    return f"effkit.artifacts.loader.load_any('{folder}')  (effkit's int8 format)"
