"""`effkit study dataloader`: batches of pre-tokenized blocks drawn per second with 0..`max_workers` loader
processes, in a fresh process (`dataloader_rows` runs there)."""

from __future__ import annotations

import os
import time
from typing import Any

from effkit.child import run_isolated
from effkit.config import TrainConfig
from effkit.data import BlockSampler, make_loader, prepare
from effkit.studies.common import Study, StudyConfig, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    """Batches drawn per second with 0..max_workers loader processes, measured in a fresh process: forking
    DataLoader workers from a process that had run OpenVINO GenAI's LLMPipeline crashed it (SIGSEGV in the
    loader's shutdown, OpenVINO 2026.4), and a fresh process also keeps what earlier studies left out of the
    timing."""
    return run_isolated("effkit.studies.dataloader:dataloader_rows",
                        {"config": _train_cfg(s, "dataloader").to_dict(), "batch_size": s.batch_size,
                         "max_workers": s.max_workers},
                        what="the dataloader study")


def dataloader_rows(config: dict[str, Any], batch_size: int, max_workers: int) -> dict[str, Any]:
    data = prepare(TrainConfig.from_dict(config).data).blocks
    n_batches = min(200, len(data.train) // batch_size)
    rows = []
    for workers in range(0, (max_workers if max_workers >= 0 else os.cpu_count() or 1) + 1):
        sampler = BlockSampler(len(data.train), batch_size, 1, seed=0)
        t = time.perf_counter()
        it = iter(make_loader(data.train, sampler, workers))
        for _ in range(n_batches):
            next(it)
        elapsed = time.perf_counter() - t
        del it
        rows.append({"num_workers": workers, "seconds": elapsed, "batches": n_batches,
                     "batches_per_s": n_batches / elapsed})
    return {"rows": rows, "notes": [f"time to draw {n_batches} batches of {batch_size} pre-tokenized blocks, "
                                    "worker start-up included, in a fresh process"]}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    ax.plot([r["num_workers"] for r in rows], [r["seconds"] for r in rows], "o-")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("seconds")


STUDY = Study("dataloader", "batches drawn per second with 0..max_workers loader processes", run, draw)
