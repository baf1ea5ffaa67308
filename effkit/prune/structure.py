"""What pruning methods share: the prunable layers, their sparsity, and rebuilding a structurally pruned GPT-2
from its new `GPT2Config` and its pruned weights.

GPT-2's modules keep sizes computed at construction (`embed_dim`, `head_dim`, `split_size`, `scaling`,
`layer_idx`), so a model whose tensors were cut in place would run with stale ones. Width and depth pruning
therefore build a fresh model from the changed config and load the pruned state dict into it (strictly: every
tensor must fit): the model effkit fine-tunes and measures is by construction the one plain `from_pretrained`
builds from the saved folder.

Row and width pruning keep a number of channels rounded to `--width-multiple` (`Options`, default 32; declared with
`check_multiple` in the torch-free `effkit.prune.options`, which the CLI reads, and re-exported here): the engines
effkit exports to store a matrix's rows in blocks (llama.cpp's Q8_0 and Q4_0: 32 weights; ONNX Runtime's
MatMulNBits: 16 to 256), so an MLP width of 100 is a model none of them can quantize.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from effkit.errors import EffkitError
from effkit.model.convert import conv1d_to_linear
from effkit.prune.options import WIDTH_MULTIPLE, Options, check_multiple  # noqa: F401 - re-exported


def kept_width(width: int, fraction: float, multiple: int, what: str, of: str = "--width-multiple") -> int:
    """The channels of `width` kept after removing `fraction` of them, rounded to the nearest multiple of `multiple`
    (ties to even, Python's `round`, so that a multiple of 1 gives the count effkit always kept), at least one
    multiple (a layer of 0 channels is no model) and at most the largest multiple within `width` (rounding must never
    grow a layer, and an original width that is no multiple must still end on one). `what` and `of` name the width
    and the multiple in the one-line refusal."""
    check_multiple(multiple)
    top = width // multiple * multiple
    if top == 0:
        raise EffkitError(f"{what} of {width} holds no multiple of {multiple} ({of}); use a smaller --width-multiple "
                          "(1 keeps any width)")
    return min(max(multiple, round(width * (1 - fraction) / multiple) * multiple), top)


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
