"""Depth pruning: remove whole transformer blocks, the least important first.

Importance is measured, not assumed: the increase of the next-token loss on calibration batches (training
blocks, never the held-out ones) when the block is skipped (its input passed straight to the next block).
That is the quantity pruning trades away, so it is what ranks the blocks; ShortGPT's input/output cosine
similarity is a cheaper proxy for it, which matters for 30-plus-layer models and not for effkit's CPU ones
(one calibration pass per block). Blocks are removed from the `nn.ModuleList` and the model is rebuilt from a
`GPT2Config` with the smaller `n_layer` (`structure.rebuild`), so plain `from_pretrained` loads the artifact.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from effkit.errors import EffkitError
from effkit.measure import evaluation
from effkit.prune.structure import rebuild


@torch.no_grad()
def calibration_loss(model: nn.Module, calib: list[torch.Tensor]) -> float:
    device = next(model.parameters()).device
    losses = [float(evaluation.lm_loss(model(b.to(device)).logits, b.to(device))) for b in calib]
    return sum(losses) / len(losses)


@torch.no_grad()
def block_importance(model: nn.Module, calib: list[torch.Tensor]) -> list[float]:
    """Per block: calibration loss with the block skipped minus the full model's."""
    was_training = model.training
    model.eval()
    blocks = model.transformer.h
    base = calibration_loss(model, calib)
    out = []
    try:
        for i in range(len(blocks)):
            model.transformer.h = nn.ModuleList([b for j, b in enumerate(blocks) if j != i])
            out.append(calibration_loss(model, calib) - base)
    finally:
        model.transformer.h = blocks
        model.train(was_training)
    return out


def prune_blocks(model: nn.Module, n_remove: int, calib: list[torch.Tensor]) -> tuple[nn.Module, dict]:
    """Remove the `n_remove` blocks whose skipping costs the least calibration loss; returns the rebuilt model
    and what was measured (importance per block, the blocks removed, by their index in the model given)."""
    if n_remove <= 0:
        return model, {"block_loss_increase": [], "removed": []}
    importance = block_importance(model, calib)
    removed = sorted(sorted(range(len(importance)), key=importance.__getitem__)[:n_remove])
    keep = [i for i in range(len(importance)) if i not in removed]
    sd = model.state_dict()
    new_sd = {}
    for k, v in sd.items():
        if k.startswith("transformer.h."):
            i, rest = k[len("transformer.h."):].split(".", 1)
            if int(i) not in keep:
                continue
            k = f"transformer.h.{keep.index(int(i))}.{rest}"
        new_sd[k] = v
    return rebuild(model, new_sd, n_layer=len(keep)), {"block_loss_increase": importance, "removed": removed}


class DepthPruner:
    """Whole blocks removed, the ones whose skipping costs the least calibration loss first."""

    name = "depth"
    structured = True
    importances = ("magnitude",)
    counts_block_params = True

    def ranks_by(self, cfg) -> str:
        return "calibration-loss increase when the block is skipped"

    def needs_calibration(self, cfg) -> bool:
        return True

    def plan(self, cfg, model) -> dict:
        c = model.config
        remove = round(c.n_layer * cfg.method.target)
        if remove >= c.n_layer:
            raise EffkitError(f"--target {cfg.method.target} would remove all {c.n_layer} blocks; use a target below "
                              f"{(c.n_layer - 0.5) / c.n_layer:.2f}")
        if remove == 0:
            raise EffkitError(f"--target {cfg.method.target} removes no block of {c.n_layer} (rounded); use at least "
                              f"{0.5 / c.n_layer:.2f}")
        return {"n_layer": f"{c.n_layer} -> {c.n_layer - remove}"}

    def cut_config(self, cfg, config, fraction: float):
        """`config` with the blocks a cut of `fraction` keeps (the memory plan's student)."""
        c = copy.deepcopy(config)
        c.n_layer = config.n_layer - round(config.n_layer * fraction)
        return c

    def start(self, cfg, model):
        n_layer0 = model.config.n_layer

        def cut(model, fraction, calib):
            # the blocks still to remove to reach this round's fraction of the original depth
            model, done = prune_blocks(model, round(n_layer0 * fraction) - (n_layer0 - model.config.n_layer), calib)
            return model, done, None

        return cut


PRUNER = DepthPruner()
