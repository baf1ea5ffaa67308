"""`effkit study checkpointing`: activation checkpointing off and on at each block size the model's context
allows: time per step and peak memory."""

from __future__ import annotations

from typing import Any

from effkit.model import PRESETS
from effkit.studies.common import Study, StudyConfig, _mib, _steady_mean, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    rows = []
    limit = PRESETS.get(s.model, {}).get("n_positions", max(s.block_sizes))
    for block in [b for b in s.block_sizes if b <= limit]:
        for ckpt in (False, True):
            r = _train(_train_cfg(s, f"ckpt-{block}-{int(ckpt)}", block_size=block, activation_checkpointing=ckpt))
            rows.append({"block_size": block, "activation_checkpointing": ckpt,
                         "time_per_step_s": _steady_mean(r["step_times"]),
                         "peak_memory_mib": _mib(r["metrics"]["peak_memory_bytes_per_rank"][0])})
    return {"rows": rows, "notes": []}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    for ckpt in (False, True):
        sub = [r for r in rows if r["activation_checkpointing"] == ckpt]
        ax.plot([r["block_size"] for r in sub], [r["peak_memory_mib"] for r in sub], "o-",
                label=f"checkpointing {'on' if ckpt else 'off'}")
    ax.set_xlabel("block size")
    ax.set_ylabel("peak memory (MiB)")
    ax.legend()


STUDY = Study("checkpointing", "activation checkpointing off and on by block size: peak memory, time per step", run,
              draw)
