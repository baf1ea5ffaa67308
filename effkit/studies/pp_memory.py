"""`effkit study pp-memory`: per-rank peak memory and parameter bytes of `pp` against `ddp` with the same
processes and global batch."""

from __future__ import annotations

from typing import Any

import torch

from effkit.studies.common import Study, StudyConfig, _mib, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    """Per-rank peak memory and parameter bytes of `pp` vs `ddp` with the same processes and global batch."""
    rows = []
    for mode in ("ddp", "pp"):
        batch = s.batch_size if mode == "pp" else max(1, s.batch_size // s.nproc)
        r = _train(_train_cfg(s, f"pp-memory-{mode}", parallel=mode, nproc=s.nproc, threads=1, batch_size=batch,
                              microbatches=min(batch, max(s.nproc, 2)), eval_blocks=2))
        peaks = r["metrics"]["peak_memory_bytes_per_rank"]
        rows.append({"mode": mode, "processes": s.nproc, "batch_per_rank": batch,
                     "peak_memory_mib_per_rank": [round(_mib(b)) for b in peaks],
                     "max_peak_memory_mib": _mib(max(peaks)),
                     "param_mib_rank0": _mib(r["what_ran"]["parallel_detail"]["param_bytes_this_rank"])})
    ratio = rows[1]["max_peak_memory_mib"] / rows[0]["max_peak_memory_mib"]
    return {"rows": rows, "notes": [
        f"largest per-rank peak, pp / ddp: {ratio:.2f}x (one run each; peak memory is a high-water mark, "
        "not a timing, and varies little between runs; time per step is left out: a few steps give no interval, "
        "and `effkit study pipeline` measures it)",
        f"same global batch ({s.batch_size} blocks): ddp gives each rank {rows[0]['batch_per_rank']}, pp gives every "
        f"stage all {s.batch_size} in micro-batches; {s.steps} steps, fp32, AdamW",
        "peak memory: " + ("cuda max_memory_allocated" if torch.cuda.is_available() else
                           "RSS high-water mark over the training steps minus RSS at their start (the model is "
                           "built whole on every rank, then split, before the measurement starts)")]}


def draw(ax, result: dict[str, Any]) -> None:
    for i, r in enumerate(result["rows"]):
        ax.bar([i * 3 + k for k in range(len(r["peak_memory_mib_per_rank"]))], r["peak_memory_mib_per_rank"],
               label=r["mode"])
    ax.set_xticks([])
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.legend()


STUDY = Study("pp-memory", "per-rank peak memory of pp against ddp, same processes and global batch", run, draw,
              min_nproc=2)
