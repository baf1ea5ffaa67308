"""`effkit study scaling`: weak scaling over 1..`nproc` processes of one thread each (the same blocks per process
per step): global tokens/s, time per iteration against one process, scaling efficiency."""

from __future__ import annotations

from typing import Any

from effkit.measure import stats
from effkit.measure.results import PairedRatio
from effkit.studies.common import Study, StudyConfig, _steady, _steady_mean, _time_ci, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    rows, times = [], {}
    for n in range(1, s.nproc + 1):
        kw = {"threads": 1} if n == 1 else {"parallel": "ddp", "nproc": n, "threads": 1}
        r = _train(_train_cfg(s, f"scaling-{n}", **kw))
        times[n] = r["step_times"]
        rows.append({"processes": n, "time_per_iter_s": _steady_mean(r["step_times"]),
                     "time_per_iter_ci95": _time_ci(r["step_times"]),
                     "tokens_per_s": r["metrics"]["train_tokens_per_s"]})
    base = rows[0]
    notes = [f"weak scaling: {s.batch_size} blocks per process per step, 1 thread each"]
    for row in rows:
        row["time_pct_of_single"] = 100 * row["time_per_iter_s"] / base["time_per_iter_s"]
        row["scaling_efficiency"] = row["tokens_per_s"] / (row["processes"] * base["tokens_per_s"])
        if row["processes"] > 1:
            cmp = PairedRatio.of(stats.unpaired_ratio(_steady(times[1]), _steady(times[row["processes"]])))
            notes.append(f"{row['processes']} processes vs 1, time per iteration: {cmp.verdict}, "
                         f"{cmp.fmt()} (1.00x would be perfect weak scaling)")
    notes.append(f"intervals: {stats.UNPAIRED_METHOD}; the first step of each run is left out")
    return {"rows": rows, "notes": notes}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    ax.plot([r["processes"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label="measured")
    ax.plot([r["processes"] for r in rows], [r["processes"] * rows[0]["tokens_per_s"] for r in rows], "--",
            label="linear")
    ax.set_xlabel("processes")
    ax.set_ylabel("global tokens/s")
    ax.legend()


STUDY = Study("scaling", "weak scaling over 1..nproc processes of one thread: tokens/s, scaling efficiency", run,
              draw)
