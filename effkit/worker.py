"""What each launched training process runs: `train_rank`, called through the child-process protocol
(`python -m effkit.child JOB`, started per rank by `effkit.parallel.launch`). The layout was validated and its
degrees built once before launching; every rank receives them with the config."""

from __future__ import annotations

import os
import signal
from typing import Any


def _fault_injection():
    """`EFFKIT_FAULT_INJECT=RANK:STEP` makes that rank raise after that step, `RANK:STEP:kill` makes it die by
    SIGKILL (no chance to report anything): set by tests of failure handling, never by effkit."""
    spec = os.environ.get("EFFKIT_FAULT_INJECT")
    if not spec:
        return None
    rank, step, *how = spec.split(":")

    def on_step(s: int, loss: float) -> None:
        if s == int(step) and int(os.environ.get("RANK", "0")) == int(rank):
            if how == ["kill"]:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fault injected at step {s} (EFFKIT_FAULT_INJECT={spec})")

    return on_step


def train_rank(config: dict[str, Any], dims: dict[str, Any], planned: dict[str, Any] | None = None,
               progress: bool = True) -> None:
    """One rank of a launched training run (rank 0 writes the report, with `planned` in it, and the artifact)."""
    from effkit.config import TrainConfig
    from effkit.parallel.dims import ParallelDims
    from effkit.train import Planned, train

    train(TrainConfig.from_dict(config), on_step=_fault_injection(), progress=progress,
          dims=ParallelDims.from_dict(dims), planned=Planned(**(planned or {})))
    # leave the process group before the interpreter exits: without it gloo's worker threads can outlive it and
    # abort the process ("terminate called without an active exception", SIGABRT) after the work was done
    # (pytorch/pytorch#190489). Only after a success, as torchtitan does: after a failure the peers may still
    # be inside a collective, and destroying would wait on them.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
