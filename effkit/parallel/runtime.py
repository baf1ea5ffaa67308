"""The process runtime: which device this process drives, its rank and the world it belongs to.

The device is chosen once, here (CUDA when present, else CPU; `--device` overrides), and passed to every
stage: nothing else in effkit picks a device.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from effkit.config import check_device
from effkit.errors import EffkitError


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` -> the first GPU if there is one, else the CPU; `cpu`, `cuda`, `cuda:N` as asked, if present."""
    check_device(device)
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EffkitError(f"--device {device}: there is no GPU here; use --device cpu (or auto)")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise EffkitError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
        if dev.index is None:
            dev = torch.device("cuda", 0)
    return dev


def init_runtime(device: str = "auto") -> Runtime:
    """Single process unless launched with WORLD_SIZE > 1 (then the process group is joined)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Runtime(device=resolve_device(device))
    return init_distributed()


PG_TIMEOUT_ENV = "EFFKIT_PG_TIMEOUT"  # seconds a collective may wait before the run fails (tests make it short)


def init_distributed(timeout_s: float | None = None) -> Runtime:
    """Join the process group of a launched process: nccl with one GPU per process, else gloo on the CPU.
    The world size is read back from the process group, never trusted from the environment. A collective that
    waits longer than `timeout_s` (default: $EFFKIT_PG_TIMEOUT, else 300 s) fails instead of hanging."""
    import torch.distributed as dist

    timeout_s = timeout_s or float(os.environ.get(PG_TIMEOUT_ENV) or 300)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    real_world = dist.get_world_size()
    if real_world != world:
        raise EffkitError(f"WORLD_SIZE says {world} processes but the process group has {real_world}")
    return Runtime(device=device, rank=dist.get_rank(), world_size=real_world, local_rank=local_rank,
                   backend=backend)
