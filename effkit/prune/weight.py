"""Unstructured pruning of the Linear weights inside the transformer blocks (embeddings, LayerNorms and the
tied LM head are left alone). Importance is |W| (magnitude) or |W| * ||X_j||_2 (Wanda, Sun et al. 2023, with
input-feature norms from a few calibration batches). Magnitude ranks globally by default (`--scope layer`
ranks per layer); Wanda compares weights within each output row, as in the paper."""

from __future__ import annotations

import torch
from torch import nn

from effkit.prune.structure import prunable_linears


@torch.no_grad()
def input_norms(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """L2 norm over calibration tokens of every input feature of every prunable Linear."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, lin in prunable_linears(model).items():
        def hook(mod, inputs, _out, name=name):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
        hooks.append(lin.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for b in batches:
            model(b.to(device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {k: v.sqrt() for k, v in sums.items()}


@torch.no_grad()
def compute_masks(model: nn.Module, fraction: float, importance: str = "magnitude", scope: str = "global",
                  calib: list[torch.Tensor] | None = None,
                  previous: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Boolean keep-masks removing `fraction` of the prunable weights; already-pruned weights stay pruned."""
    layers = prunable_linears(model)
    if importance == "wanda":
        norms = input_norms(model, calib or [])
        scores = {n: lin.weight.abs() * norms[n].unsqueeze(0) for n, lin in layers.items()}
        scope = "row"
    else:
        scores = {n: lin.weight.abs().clone() for n, lin in layers.items()}
    if previous:
        for n, m in previous.items():
            scores[n][~m] = -1.0  # pruned weights rank lowest, so the masks only grow
    masks = {}
    if scope == "global":
        flat = torch.cat([s.flatten() for s in scores.values()])
        k = int(fraction * flat.numel())
        threshold = torch.kthvalue(flat, k).values if k > 0 else flat.min() - 1
        masks = {n: s > threshold for n, s in scores.items()}
    elif scope == "layer":
        for n, s in scores.items():
            k = int(fraction * s.numel())
            threshold = torch.kthvalue(s.flatten(), k).values if k > 0 else s.min() - 1
            masks[n] = s > threshold
    else:  # row: the same fraction of every output row
        for n, s in scores.items():
            k = int(fraction * s.shape[1])
            mask = torch.ones_like(s, dtype=torch.bool)
            if k > 0:
                idx = s.topk(k, dim=1, largest=False).indices
                mask.scatter_(1, idx, False)
            masks[n] = mask
    return masks


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    layers = prunable_linears(model)
    for n, m in masks.items():
        layers[n].weight.mul_(m.to(layers[n].weight.dtype))


class WeightPruner:
    """Unstructured masks; the masks are re-applied after every fine-tuning step."""

    name = "weight"
    structured = False
    importances = ("magnitude", "wanda")
    counts_block_params = False

    def ranks_by(self, cfg) -> str:
        return cfg.method.importance

    def needs_calibration(self, cfg) -> bool:
        return cfg.method.importance == "wanda"

    def plan(self, cfg, model) -> dict:
        return {}

    def cut_config(self, cfg, config, fraction: float):
        """Zeros keep every shape: the student is the parent's size."""
        return config

    def start(self, cfg, model):
        masks = None

        def cut(model, fraction, calib):
            nonlocal masks
            masks = compute_masks(model, fraction, cfg.method.importance, cfg.method.scope, calib, previous=masks)
            apply_masks(model, masks)
            return model, {}, (lambda mdl, m=masks: apply_masks(mdl, m))

        return cut


PRUNER = WeightPruner()
