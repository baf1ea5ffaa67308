"""`ParallelDims`: the parallel layout (data-parallel x tensor-parallel, room for pipeline) of one training run,
built once from the world size, the parallel options and the model's head count, before data and model.
Every check of the layout lives here, so it is made once, with one message, whether it runs before launching
processes or inside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from effkit.config import ParallelConfig
from effkit.errors import EffkitError


@dataclass(frozen=True)
class ParallelDims:
    mode: str  # none, ddp, fsdp, tp, fsdp+tp
    dp: int = 1  # data-parallel degree (replicas or shards)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline stages (not yet implemented: always 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (the row of the (dp, tp) mesh it sits in)."""
        return rank // (self.tp * self.pp)

    @classmethod
    def build(cls, p: ParallelConfig, world_size: int, n_head: int | None) -> ParallelDims:
        """Validate the layout of `world_size` processes for mode `p.mode` and a model of `n_head` heads."""
        if p.mode == "none":
            if world_size > 1:
                raise EffkitError("several processes were started but --parallel is none; choose a parallel mode")
            if p.tp_size not in (0, 1):
                raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
            return cls("none")
        tp = 1
        if p.mode == "tp":
            tp = p.tp_size or world_size
            if tp != world_size:
                raise EffkitError(f"--parallel tp uses all {world_size} processes for tensor parallelism "
                                  f"(--tp-size {tp} given); use --parallel fsdp+tp to combine data and tensor "
                                  "parallelism")
        elif p.mode == "fsdp+tp":
            tp = p.tp_size or min(world_size, 2)
            if world_size % tp:
                raise EffkitError(f"--parallel fsdp+tp needs --nproc x nodes ({world_size}) divisible by "
                                  f"--tp-size {tp}")
        elif p.tp_size not in (0, 1):
            raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
        if n_head is not None and n_head % tp:
            raise EffkitError(f"tensor-parallel size {tp} does not divide the model's {n_head} attention heads; "
                              f"choose a tp size that divides {n_head}")
        return cls(p.mode, dp=world_size // tp, tp=tp)
