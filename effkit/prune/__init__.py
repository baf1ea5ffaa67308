"""Pruning: unstructured magnitude / Wanda masks (`weight`) and structured MLP-channel removal (`row`)."""

from effkit.prune.row import prune_mlp_channels
from effkit.prune.weight import apply_masks, compute_masks, prunable_linears, sparsity

__all__ = ["apply_masks", "compute_masks", "prunable_linears", "prune_mlp_channels", "sparsity"]
