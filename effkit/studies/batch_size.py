"""`effkit study batch-size`: tokens/s and peak memory per rank as the batch per data-parallel rank grows, under
FSDP and under TP on `nproc` processes; the plot also sets one against the other."""

from __future__ import annotations

from typing import Any

from effkit.studies.common import Study, StudyConfig, _mib, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    rows = []
    for mode in ("fsdp", "tp"):
        for b in s.batch_sizes:
            r = _train(_train_cfg(s, f"batch-{mode}-{b}", parallel=mode, nproc=s.nproc, batch_size=b))
            rows.append({"mode": mode, "batch_size": b, "tokens_per_s": r["metrics"]["train_tokens_per_s"],
                         "peak_memory_mib": _mib(max(r["metrics"]["peak_memory_bytes_per_rank"]))})
    return {"rows": rows, "notes": ["batch size per data-parallel rank; tp ranks share one batch"]}


def figure(plt, result: dict[str, Any]):
    """Three panels: tokens/s and peak memory against the batch size for fsdp, the same for tp, and tokens/s
    against peak memory for both."""
    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, mode in enumerate(("fsdp", "tp")):
        sub = [r for r in rows if r["mode"] == mode]
        ax = axes[i]
        ax.plot([r["batch_size"] for r in sub], [r["tokens_per_s"] for r in sub], "o-", color="C0")
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s", color="C0")
        ax2 = ax.twinx()
        ax2.plot([r["batch_size"] for r in sub], [r["peak_memory_mib"] for r in sub], "s--", color="C1")
        ax2.set_ylabel("peak memory / rank (MiB)", color="C1")
        ax.set_title(mode)
    for mode in ("fsdp", "tp"):
        sub = [r for r in rows if r["mode"] == mode]
        axes[2].plot([r["peak_memory_mib"] for r in sub], [r["tokens_per_s"] for r in sub], "o-", label=mode)
    axes[2].set_xlabel("peak memory / rank (MiB)")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_title("fsdp vs tp")
    axes[2].legend()
    return fig


STUDY = Study("batch-size", "tokens/s and peak memory per rank as the batch grows, under FSDP and under TP", run,
              figure=figure, min_nproc=2)
