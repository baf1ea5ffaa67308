"""Structured pruning that physically removes MLP hidden channels (rows of `c_fc`, columns of `c_proj`),
the same number in every layer, so the result is a valid `GPT2Config` with a smaller `n_inner`: smaller on
disk, faster, and loadable with plain `from_pretrained`.

Direct slicing rather than torch-pruning's dependency graph: the coupled group in a GPT-2 MLP is just
(c_fc rows, c_fc bias, c_proj columns), and a valid GPT2Config needs the same width in every layer, which
a global dependency-graph pruner does not guarantee. Channels are ranked by the L2 norm of their `c_fc` row.

The number kept is rounded to `--width-multiple` (default 32, `options.Options`) before the best channels are
taken: llama.cpp's Q8_0/Q4_0 and ONNX Runtime's MatMulNBits store `c_proj`'s rows (n_inner long) in blocks, so an
MLP width of 100 could not be exported to them at all.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from effkit.errors import EffkitError
from effkit.prune.methods import options_of
from effkit.prune.options import Options
from effkit.prune.structure import kept_width


@torch.no_grad()
def prune_mlp_channels(model: nn.Module, keep: int) -> None:
    for block in model.transformer.h:
        fc, proj = block.mlp.c_fc, block.mlp.c_proj
        if keep >= fc.out_features:
            continue
        idx = fc.weight.norm(dim=1).topk(keep).indices.sort().values
        new_fc = nn.Linear(fc.in_features, keep, device=fc.weight.device, dtype=fc.weight.dtype)
        new_fc.weight.copy_(fc.weight[idx])
        new_fc.bias.copy_(fc.bias[idx])
        new_proj = nn.Linear(keep, proj.out_features, device=proj.weight.device, dtype=proj.weight.dtype)
        new_proj.weight.copy_(proj.weight[:, idx])
        new_proj.bias.copy_(proj.bias)
        block.mlp.c_fc, block.mlp.c_proj = new_fc, new_proj
    model.config.n_inner = keep


class RowPruner:
    """The same number of MLP channels removed from every layer, ranked by the L2 norm of their c_fc row."""

    name = "row"
    options = Options
    structured = True
    importances = ("magnitude",)
    counts_block_params = False

    def ranks_by(self, cfg) -> str:
        return "L2 norm of each channel's c_fc row"

    def needs_calibration(self, cfg) -> bool:
        return False

    def plan(self, cfg, model) -> dict:
        n = model.config.n_inner or 4 * model.config.n_embd
        m, target = options_of(cfg, Options).width_multiple, cfg.method.target
        keep = kept_width(n, target, m, "an MLP width")
        if keep == n:  # a round that cuts nothing would still be fine-tuned, measured and saved as "pruned"
            raise EffkitError(f"--target {target} removes no MLP channel of {n} once rounded to a multiple of {m} "
                              "(--width-multiple); use a larger --target or a smaller --width-multiple")
        return {"n_inner": f"{n} -> {keep} (a multiple of --width-multiple {m}; {1 - keep / n:.1%} removed for "
                           f"--target {target})"}

    def cut_config(self, cfg, config, fraction: float):
        """`config` with the MLP width a cut of `fraction` keeps (the memory plan's student)."""
        c = copy.deepcopy(config)
        c.n_inner = kept_width(config.n_inner or 4 * config.n_embd, fraction, options_of(cfg, Options).width_multiple,
                               "an MLP width")
        return c

    def start(self, cfg, model):
        n_inner0 = model.config.n_inner or 4 * model.config.n_embd
        m = options_of(cfg, Options).width_multiple

        def cut(model, fraction, calib):
            # the count is rounded, then the best channels by norm are taken as before: rounding changes how
            # many survive, never which ones rank first
            keep = kept_width(n_inner0, fraction, m, "an MLP width")
            before = model.config.n_inner or 4 * model.config.n_embd
            prune_mlp_channels(model, keep)
            return model, {"n_inner": keep, "removed_channels": before - keep, "width_multiple": m,
                           "target": fraction, "fraction_reached": 1 - keep / n_inner0}, None

        return cut


PRUNER = RowPruner()
