"""`effkit study profile`: where a training step's time goes (data, forward, backward, optimizer, eval, other),
from effkit's own phase timers."""

from __future__ import annotations

from typing import Any

from effkit.studies.common import Study, StudyConfig, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    r = _train(_train_cfg(s, "profile", eval_interval=max(1, s.steps // 2), profile=True))
    phases = r["metrics"]["time_breakdown_s"]
    total = sum(phases.values())
    rows = [{"phase": k, "seconds": v, "percent": 100 * v / total} for k, v in
            sorted(phases.items(), key=lambda kv: -kv[1])]
    return {"rows": rows, "notes": ["timers (time.perf_counter around each phase of the training loop, CUDA "
                                    "synchronised when on GPU), not torch.profiler"]}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    ax.pie([r["seconds"] for r in rows], labels=[r["phase"] for r in rows], autopct="%1.0f%%")


STUDY = Study("profile", "where a training step's time goes: data, forward, backward, optimizer, eval", run, draw)
