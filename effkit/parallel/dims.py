"""`ParallelDims`: the parallel layout (pipeline x data-parallel x tensor-parallel) of one training run, built
once from the world size and the parallel options (before launching processes, which receive it with their
config; or in the one process of a run that launches none) and checked against the model's head and layer
counts where they are known.
Global ranks are laid out as the mesh (pp, dp, tp), outermost first, torchtitan's order: the ranks of one
pipeline stage are contiguous.
Every check of the layout lives here, so it is made once, with one message, whether it runs before launching
processes or inside them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from effkit.config import ParallelConfig
from effkit.errors import EffkitError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees and how data parallelism is done; what to apply is read from the `*_enabled` flags, torchtitan
    style (`parallelize_gpt2`: split if pp, apply_tp if tp, then FSDP2 if dp_shard else DDP if dp_replicate).
    `mode` is the CLI's name for the layout, kept for messages and the report; nothing is decided by it."""

    mode: str  # none, ddp, fsdp, tp, fsdp+tp, pp, pp+fsdp
    dp: int = 1  # data-parallel degree (replicas or shards)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline stages
    dp_shard: bool = False  # data parallelism by FSDP2 sharding (also with one shard per stage or tp group)
    dp_replicate: bool = False  # data parallelism by replicas (DDP, or a hand-written gradient sync)
    tp_asked: bool = False  # tensor parallelism was asked for: applied on a mesh of one too (--nproc 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelDims:
        return cls(**d)

    def degrees(self) -> tuple[int, int, int, bool, bool]:
        """What the layout does, without its name: (dp, tp, pp, dp_shard, dp_replicate)."""
        return self.dp, self.tp, self.pp, self.dp_shard, self.dp_replicate

    def describe_degrees(self) -> str:
        """`dp 2 (sharded) x tp 1 x pp 1`."""
        how = " (sharded)" if self.dp_shard else " (replicas)" if self.dp_replicate else ""
        return f"dp {self.dp}{how} x tp {self.tp} x pp {self.pp}"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def enabled(self) -> bool:
        return self.tp_enabled or self.pp_enabled or self.dp_shard or self.dp_replicate

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1 or self.tp_asked

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

    def check_model(self, n_head: int | None, n_layer: int | None) -> ParallelDims:
        """The checks that need the model: tensor parallelism splits heads, every pipeline stage needs a block
        (None: not known yet)."""
        if n_head is not None and n_head % self.tp:
            raise EffkitError(f"tensor-parallel size {self.tp} does not divide the model's {n_head} attention heads; "
                              f"choose a tp size that divides {n_head}")
        if n_layer is not None and self.pp > n_layer:
            raise EffkitError(f"{self.pp} pipeline stages for a model of {n_layer} blocks: every stage needs at least "
                              f"one block; use at most {n_layer} stages")
        return self

    def check_world(self, world_size: int) -> ParallelDims:
        """Inside a launched process: the layout it was given is the one it runs in."""
        if world_size != self.world_size:
            raise EffkitError(f"this process group has {world_size} processes but the layout was built for "
                              f"{self.world_size} ({self.mode}); launch with the same --nproc and --nnodes")
        return self

    @classmethod
    def build(cls, p: ParallelConfig, world_size: int, n_head: int | None = None,
              n_layer: int | None = None) -> ParallelDims:
        """Validate the layout of `world_size` processes for `p` (the mode string is read here and nowhere
        after) and, where known, a model of `n_head` heads and `n_layer` blocks."""
        return cls._layout(p, world_size).check_model(n_head, n_layer)

    @classmethod
    def _layout(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        if p.mode == "auto":
            raise EffkitError("--parallel auto is chosen by `effkit train` (effkit train --parallel auto); here, "
                              "name the layout: " + ", ".join(m for m in ("ddp", "fsdp", "tp", "fsdp+tp", "pp",
                                                                          "pp+fsdp")))
        if p.mode == "none":
            if world_size > 1:
                raise EffkitError("several processes were started but --parallel is none; choose a parallel mode")
            if p.tp_size not in (0, 1):
                raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
            return cls("none")
        if p.mode.startswith("pp"):
            return cls._pipeline(p, world_size)
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
        return cls(p.mode, dp=world_size // tp, tp=tp, dp_shard=p.mode in ("fsdp", "fsdp+tp"),
                   dp_replicate=p.mode == "ddp", tp_asked=p.mode in ("tp", "fsdp+tp"))

    @classmethod
    def _pipeline(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        pp = world_size if p.mode == "pp" else (p.pp_size or 2)
        if p.mode == "pp" and p.pp_size not in (0, world_size):
            raise EffkitError(f"--parallel pp uses all {world_size} processes as pipeline stages (--pp-size "
                              f"{p.pp_size} given); use --parallel pp+fsdp to combine stages with data parallelism")
        if pp < 2:
            raise EffkitError(f"pipeline parallelism needs at least 2 stages (got {pp}); use --nproc 2 or more")
        if world_size % pp:
            raise EffkitError(f"--parallel pp+fsdp needs --nproc x nodes ({world_size}) divisible by --pp-size {pp}")
        if p.pp_schedule == "1f1b" and p.microbatches < pp:
            raise EffkitError(f"--pp-schedule 1f1b needs at least as many micro-batches as stages "
                              f"(--microbatches {p.microbatches}, {pp} stages); raise --microbatches or use gpipe")
        if p.tp_size not in (0, 1):
            raise EffkitError(f"--tp-size {p.tp_size} only applies to --parallel tp or fsdp+tp")
        return cls(p.mode, dp=world_size // pp, pp=pp, dp_shard=p.mode == "pp+fsdp")
