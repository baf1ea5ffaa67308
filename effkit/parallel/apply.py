"""`parallelize(model, cfg, rt)`: apply the parallel mode and return a handle the training loop uses
for everything mode-specific (gradient sync, clipping, full state dicts, describing what was applied)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from effkit.errors import EffkitError


class Parallelized:
    """Single process (mode `none`); subclasses override what their mode changes."""

    mode = "none"

    def __init__(self, model: nn.Module, rt):
        self.model = model
        self.base_model = model
        self.rt = rt

    def no_sync(self):
        return nullcontext()

    def sync_gradients(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def mean_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_ints(self, x: int) -> list[int]:
        return [int(x)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.base_model.state_dict().items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "detail": "single process"}


def parallelize(model: nn.Module, cfg, rt) -> Parallelized:
    if cfg.parallel == "none" and rt.world_size == 1:
        return Parallelized(model, rt)
    raise EffkitError(f"--parallel {cfg.parallel} is not available in this version of effkit; "
                      "use --parallel none")
