"""`effkit study pipeline`: GPipe and 1F1B at `nproc` stages as micro-batches grow, one global batch throughout:
the idle fraction of a stage measured (against the same micro-batches run one after another in one process) and
in theory, (p-1)/(m+p-1)."""

from __future__ import annotations

from typing import Any

from effkit.studies.common import Study, StudyConfig, _steady_mean, _time_ci, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    """GPipe and 1F1B at `s.nproc` stages as micro-batches grow, one global batch throughout. The bubble is
    estimated from measured times: 1 - (sequential time / stages) / pipelined time, where the sequential time is
    one process running the same micro-batches one after another (batch B/m, m accumulation steps)."""
    p = s.nproc
    batch = max(8, -(-s.batch_size // 8) * 8)  # divisible by every micro-batch count of the study
    rows, seq = [], {}
    for m in s.microbatches:
        r = _train(_train_cfg(s, f"pipeline-seq-m{m}", batch_size=batch // m, grad_accum=m, threads=1))
        seq[m] = _steady_mean(r["step_times"])
    for schedule in ("gpipe", "1f1b"):
        for m in s.microbatches:
            row: dict[str, Any] = {"schedule": schedule, "microbatches": m,
                                   "bubble_theory": (p - 1) / (m + p - 1)}
            if schedule == "1f1b" and m < p:
                rows.append({**row, "time_per_iter_s": None, "time_per_iter_ci95": None,
                             "sequential_time_s": seq[m], "bubble_measured": None, "bubble_ci95": None,
                             "note": f"not run: 1F1B needs at least {p} micro-batches"})
                continue
            r = _train(_train_cfg(s, f"pipeline-{schedule}-m{m}", parallel="pp", nproc=p, threads=1,
                                  batch_size=batch, microbatches=m, pp_schedule=schedule))
            t, (lo, hi) = _steady_mean(r["step_times"]), _time_ci(r["step_times"])
            ideal, lo = seq[m] / p, max(lo, 1e-9)
            rows.append({**row, "time_per_iter_s": t, "time_per_iter_ci95": [lo, hi], "sequential_time_s": seq[m],
                         "bubble_measured": 1 - ideal / t, "bubble_ci95": [1 - ideal / lo, 1 - ideal / hi],
                         "note": ""})
    return {"rows": rows, "notes": [
        f"{p} stages of consecutive blocks (embeddings on the first, LM head on the last), 1 thread per process, "
        f"global batch {batch} blocks split into m micro-batches",
        "bubble_measured = 1 - (sequential / stages) / pipelined time per iteration; the sequential run does the "
        "same micro-batches in one process. It counts everything that keeps a stage from working: the schedule's "
        "bubble, unequal stages and the sends between processes; bubble_theory = (p-1)/(m+p-1) counts the first only",
        "intervals: 95% t-interval of the pipelined step times (the sequential time taken as exact); "
        "the first step of each run is left out"]}


def draw(ax, result: dict[str, Any]) -> None:
    rows = result["rows"]
    ms = sorted({r["microbatches"] for r in rows})
    ax.plot(ms, [next(r["bubble_theory"] for r in rows if r["microbatches"] == m) for m in ms], "k--",
            label="theory (p-1)/(m+p-1)")
    for i, sched in enumerate(("gpipe", "1f1b")):
        sub = [r for r in rows if r["schedule"] == sched and r["bubble_measured"] is not None]
        err = [[r["bubble_measured"] - r["bubble_ci95"][0] for r in sub],
               [r["bubble_ci95"][1] - r["bubble_measured"] for r in sub]]
        ax.errorbar([r["microbatches"] + 0.08 * (i - 0.5) for r in sub], [r["bubble_measured"] for r in sub],
                    yerr=err, fmt="o-", capsize=4, label=f"{sched} measured (95% CI)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle fraction of a stage")
    ax.legend()


STUDY = Study("pipeline", "GPipe and 1F1B as micro-batches grow: a stage's measured idle fraction against "
              "(p-1)/(m+p-1)", run, draw, min_nproc=2)
