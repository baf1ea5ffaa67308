"""`effkit bench`: every artifact of a run measured with one protocol against the first (dense) one, and
`bench.json` / `bench.csv` / `bench.md` / `leaderboard.json` in the run's report folder.

Two parts. (1) Each artifact alone in a fresh process: held-out loss per block, a greedy sample, and peak memory
(on CPU the process' RSS high-water mark, which an earlier artifact's freed memory would hide). (2) All artifacts
loaded side by side in one process and timed in interleaved rounds (every registered workload: forward latency
and generation tokens/s; training tokens/s), so that every ratio to the reference is paired and comes with a 95%
interval and a verdict (`effkit.measure.stats`).

One job per module: `discover` (which artifacts, in which order, and the peers), `static` (each artifact alone,
in a fresh process), `timing` (the interleaved rounds and which ratios they must settle), `rows` (the typed row
of each artifact), `render` (bench.md, bench.csv, leaderboard.json, the table), `deliverable` (what `effkit run`
ships), `speculative` (the speculative artifact: the dense model with the n-gram draft, its k measured, its
exactness checked, then benched beside the others), `stage` (`run_bench` and the `bench` stage of `effkit run`).
The names below are the entry points.
"""

from __future__ import annotations

from typing import Any

from effkit.bench.deliverable import deliverable
from effkit.bench.discover import make_peers
from effkit.bench.render import bench_markdown, leaderboard_units, same_rounds_note, table_rows
from effkit.bench.rows import combine, peer_workloads
from effkit.bench.stage import STAGE, BenchStage, BenchStep, other_rounds, run_bench
from effkit.bench.static import bench_in_this_process

__all__ = ["STAGE", "BenchStage", "BenchStep", "bench_in_this_process", "bench_markdown", "combine", "deliverable",
           "leaderboard_units", "make_peers", "other_rounds", "peer_workloads", "run_bench", "same_rounds_note",
           "table_rows"]


def __getattr__(name: str) -> Any:
    """`LEADERBOARD_UNITS`: leaderboard.json's units, made from the workload registry when read (a workload
    registered by a plug-in adds its own)."""
    if name == "LEADERBOARD_UNITS":
        return leaderboard_units()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
