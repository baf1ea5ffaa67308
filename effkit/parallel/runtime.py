"""The process runtime: which device this process drives, its rank, and the data-parallel layout."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
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


def init_runtime() -> Runtime:
    """Single process unless launched with WORLD_SIZE > 1 (then the process group is joined)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return Runtime(device=device)
    from effkit.parallel.launch import init_distributed

    return init_distributed()
