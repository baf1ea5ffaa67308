"""`effkit study sync`: the gradient sync by gather-scatter, all-reduce and DDP on `nproc` processes: time per
iteration (Welch intervals against DDP) and whether the three give identical losses."""

from __future__ import annotations

from typing import Any

from effkit.measure import stats
from effkit.measure.results import PairedRatio
from effkit.studies.common import Study, StudyConfig, _steady, _steady_mean, _time_ci, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    rows, losses, times = [], {}, {}
    for sync in ("gather-scatter", "all-reduce", "ddp"):
        r = _train(_train_cfg(s, f"sync-{sync}", parallel="ddp", sync=sync, nproc=s.nproc))
        losses[sync], times[sync] = r["losses"], r["step_times"]
        rows.append({"sync": sync, "time_per_iter_s": _steady_mean(r["step_times"]),
                     "time_per_iter_ci95": _time_ci(r["step_times"]),
                     "tokens_per_s": r["metrics"]["train_tokens_per_s"], "final_loss": r["losses"][-1]})
    ref = losses["ddp"]
    notes = []
    for row in rows:
        row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(losses[row["sync"]], ref, strict=True))
        if row["sync"] != "ddp":
            cmp = PairedRatio.of(stats.unpaired_ratio(_steady(times["ddp"]), _steady(times[row["sync"]])))
            row["time_vs_ddp"] = cmp.fmt()
            notes.append(f"{row['sync']} vs ddp, time per iteration: " + (
                "indistinguishable, " if cmp.verdict == "same" else f"{cmp.verdict}, ") + cmp.fmt())
        else:
            row["time_vs_ddp"] = "ref"
    identical = all(r["max_loss_diff_vs_ddp"] < 1e-4 for r in rows)
    return {"rows": rows, "losses": losses, "identical_losses": identical,
            "notes": [f"losses identical across the three strategies (|diff| < 1e-4): {identical}", *notes,
                      f"intervals: {stats.UNPAIRED_METHOD}; the first step of each run is left out"]}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    means = [r["time_per_iter_s"] * 1e3 for r in rows]
    err = [[m - r["time_per_iter_ci95"][0] * 1e3 for m, r in zip(means, rows, strict=True)],
           [r["time_per_iter_ci95"][1] * 1e3 - m for m, r in zip(means, rows, strict=True)]]
    ax.bar([r["sync"] for r in rows], means, yerr=err, capsize=4)
    ax.set_ylabel("time per iteration (ms, 95% CI)")


STUDY = Study("sync", "gradient sync by gather-scatter, all-reduce and DDP: time per iteration, identical losses",
              run, draw, min_nproc=2)
