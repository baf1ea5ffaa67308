"""Structured pruning that physically removes MLP hidden channels (rows of `c_fc`, columns of `c_proj`),
the same number in every layer, so the result is a valid `GPT2Config` with a smaller `n_inner`: smaller on
disk, faster, and loadable with plain `from_pretrained`.

Direct slicing rather than torch-pruning's dependency graph: the coupled group in a GPT-2 MLP is just
(c_fc rows, c_fc bias, c_proj columns), and a valid GPT2Config needs the same width in every layer, which
a global dependency-graph pruner does not guarantee. Channels are ranked by the L2 norm of their `c_fc` row.
"""

from __future__ import annotations

import torch
from torch import nn


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
    structured = True
    importances = ("magnitude",)
    counts_block_params = False

    def ranks_by(self, cfg) -> str:
        return "L2 norm of each channel's c_fc row"

    def needs_calibration(self, cfg) -> bool:
        return False

    def plan(self, cfg, model) -> dict:
        return {}

    def start(self, cfg, model):
        n_inner0 = model.config.n_inner or 4 * model.config.n_embd

        def cut(model, fraction, calib):
            prune_mlp_channels(model, max(1, round(n_inner0 * (1 - fraction))))
            return model, {}, None

        return cut


PRUNER = RowPruner()
