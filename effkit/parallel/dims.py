"""`ParallelDims`: the parallel layout (pipeline x data-parallel x tensor-parallel) of one training run, built
once from the world size, the parallel options and the model's head and layer counts, before data and model.
Global ranks are laid out as the mesh (pp, dp, tp), outermost first, torchtitan's order: the ranks of one
pipeline stage are contiguous.
Every check of the layout lives here, so it is made once, with one message, whether it runs before launching
processes or inside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from effkit.config import ParallelConfig
from effkit.errors import EffkitError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees and how data parallelism is done; what to apply is read from the `*_enabled` flags, torchtitan
    style (`parallelize_gpt2`: split if pp, apply_tp if tp, then FSDP2 if dp_shard else DDP if dp_replicate).
    `mode` is the CLI's name for the layout, kept for messages and the report."""

    mode: str  # none, ddp, fsdp, tp, fsdp+tp, pp, pp+fsdp
    dp: int = 1  # data-parallel degree (replicas or shards)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline stages
    dp_shard: bool = False  # data parallelism by FSDP2 sharding (also with one shard per stage or tp group)
    dp_replicate: bool = False  # data parallelism by replicas (DDP, or a hand-written gradient sync)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def enabled(self) -> bool:
        return self.tp_enabled or self.pp_enabled or self.dp_shard or self.dp_replicate

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1 or self.mode in ("tp", "fsdp+tp")

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def mesh_dims(self) -> list[tuple[str, int]]:
        """The device mesh's (name, size) dimensions, outermost first: pp, dp (for FSDP, or the data-parallel
        groups beside pipeline stages), tp; none for plain replicas (DDP uses the world group)."""
        dims = [("pp", self.pp)] if self.pp_enabled else []
        if self.dp_shard or self.pp_enabled:
            dims.append(("dp", self.dp))
        if self.tp_enabled:
            dims.append(("tp", self.tp))
        return dims

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (its index along the mesh's dp dimension)."""
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of global `rank`."""
        return rank // (self.dp * self.tp)

    @classmethod
    def build(cls, p: ParallelConfig, world_size: int, n_head: int | None, n_layer: int | None = None) -> ParallelDims:
        """Validate the layout of `world_size` processes for mode `p.mode` and a model of `n_head` heads and
        `n_layer` blocks (None: not known yet, checked when the model is built)."""
        if p.mode == "none":
            if world_size > 1:
                raise EffkitError("several processes were started but --parallel is none; choose a parallel mode")
            if p.tp_size not in (0, 1):
                raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
            return cls("none")
        if p.mode.startswith("pp"):
            return cls._pipeline(p, world_size, n_layer)
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
        return cls(p.mode, dp=world_size // tp, tp=tp, dp_shard=p.mode in ("fsdp", "fsdp+tp"),
                   dp_replicate=p.mode == "ddp")

    @classmethod
    def _pipeline(cls, p: ParallelConfig, world_size: int, n_layer: int | None) -> ParallelDims:
        pp = world_size if p.mode == "pp" else (p.pp_size or 2)
        if p.mode == "pp" and p.pp_size not in (0, world_size):
            raise EffkitError(f"--parallel pp uses all {world_size} processes as pipeline stages (--pp-size "
                              f"{p.pp_size} given); use --parallel pp+fsdp to combine stages with data parallelism")
        if pp < 2:
            raise EffkitError(f"pipeline parallelism needs at least 2 stages (got {pp}); use --nproc 2 or more")
        if world_size % pp:
            raise EffkitError(f"--parallel pp+fsdp needs --nproc x nodes ({world_size}) divisible by --pp-size {pp}")
        if n_layer is not None and pp > n_layer:
            raise EffkitError(f"{pp} pipeline stages for a model of {n_layer} blocks: every stage needs at least "
                              f"one block; use at most {n_layer} stages")
        if p.pp_schedule == "1f1b" and p.microbatches < pp:
            raise EffkitError(f"--pp-schedule 1f1b needs at least as many micro-batches as stages "
                              f"(--microbatches {p.microbatches}, {pp} stages); raise --microbatches or use gpipe")
        if p.tp_size not in (0, 1):
            raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
        return cls(p.mode, dp=world_size // pp, pp=pp, dp_shard=p.mode == "pp+fsdp")
