"""The bench's rows: one typed row per artifact (`ArtifactRow`), made of what was measured of it alone and of its
figures per workload (`WorkloadFigures`) and per training batch (`TrainFigures`), paired with the first artifact
(the reference) and with each peer; `to_dict()` is the row exactly as bench.json has always had it. Every key a
row has beyond the workloads' own (`w.figure`, `w.ratio`, `w.key`) is spelled here once (`train_figure`,
`train_ratio`), for the writers and the readers (`effkit.bench.render`, the deliverable). A row also reports the
decode workload `workloads.GENERATION` under the generation's older names: `generation.tokens_per_s` and
`generation_ratio` in bench.json, `generation_tokens_per_s` and `generation_ratio*` in bench.csv."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from effkit import workloads
from effkit.bench.timing import COMPILED, TRAIN_BATCHES, TRAIN_SKIPPED, train_measure
from effkit.measure import results, stats
from effkit.measure.stopping import Family
from effkit.measure.timing import latency_stats

PER_BLOCK = ("block_losses", "block_docs")  # kept once per bench (its `block_losses`, `block_docs`), not per row
# the bench's tables, each a family its ratios are decided in together under Holm (`stopping.Family`): the main
# table (every ratio to the reference), the peer table (every artifact against every peer, the A/A pairs left out),
# the compiled table
TABLES = ("main", "peer", "compiled")
AA_FAILED = "A/A check failed"  # the start of the flag of a decided ratio between two runs of the same computation


def train_figure(batch: int) -> str:
    """A row's training tokens/s at `batch` (or why it was not run): `train_tokens_per_s_b12`."""
    return f"train_tokens_per_s_b{batch}"


def train_ratio(batch: int) -> str:
    """A row's paired training ratio to the reference at `batch`: `train_ratio_b12`."""
    return f"train_ratio_b{batch}"


def figure(w: workloads.Workload, rounds: list[list[float]]) -> Any:
    """A workload's own figure over `rounds`: latency statistics (prefill) or the median tokens/s (decode)."""
    return latency_stats(rounds) if w.kind == "prefill" else stats.median_of_rounds(rounds)


def peer_workloads() -> tuple[workloads.Workload, ...]:
    """The workloads of the peer table: every one but prefill at batch 1 (a forward too short to tell engines
    apart; it stays in each row's own figures), decode ones first."""
    return tuple(sorted((w for w in workloads.all_() if w.name != workloads.PREFILL_B1.name),
                        key=lambda w: w.kind != "decode"))


@dataclass(frozen=True)
class WorkloadFigures:
    """One workload in an artifact's row: its own figure over its own rounds, its paired ratio to the reference
    and, for a contender (which may have settled early and run a prefix of the reference's rounds), the
    reference's figure over those same rounds, so the row can be recomputed."""

    workload: workloads.Workload
    figure: Any  # latency statistics (prefill: p50_s, ...) or tokens/s (decode)
    ratio: dict[str, Any]  # a PairedRatio's dict
    same_rounds: dict[str, Any] | None = None  # {"rounds": n, "reference": its figure over those n rounds}


@dataclass(frozen=True)
class TrainFigures:
    """The training steps at one batch: tokens/s and the paired ratio to the reference, or why not run."""

    batch: int
    tokens_per_s: float | str
    ratio: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {train_figure(self.batch): self.tokens_per_s,
                **({train_ratio(self.batch): self.ratio} if self.ratio is not None else {})}


@dataclass(frozen=True)
class ArtifactRow:
    """One artifact in the bench: what was measured of it alone (`effkit.bench.static`, its per-block losses
    left out), its loss and size against the reference, its figures per workload and training batch, its flags,
    its compiled twin (with --compile) and, for all but the peers, its ratios against each peer. Made once, when
    all of it is known (`artifact_row`); only its table's Holm decision (`Family.close`) settles its ratios'
    levels afterwards."""

    measured: dict[str, Any]
    loss_delta: dict[str, Any]  # a LossDelta's dict, against the reference
    size_ratio: float
    workloads: list[WorkloadFigures]
    train: list[TrainFigures]
    flags: list[str] = field(default_factory=list)
    invalid: str | None = None  # why its measurements cannot be compared (never delivered)
    compiled: dict[str, Any] | None = None
    vs_peers: dict[str, dict[str, Any]] | None = None  # peer -> {w.key: ratio}
    same_computation_as: list[str] | None = None  # the peers whose engine runs this very computation (same digest)

    def to_dict(self) -> dict[str, Any]:
        """The row as bench.json has it (its keys and their order)."""
        out = dict(self.measured)
        generation = next((f for f in self.workloads if f.workload.name == workloads.GENERATION), None)
        if generation is not None:
            out["generation"] = {**out["generation"], "tokens_per_s": generation.figure}
        out[results.EVAL_LOSS_DELTA] = self.loss_delta
        out["delta"] = {"eval_loss": results.LossDelta.of(self.loss_delta).delta, "size": self.size_ratio - 1}
        out["size_ratio"] = self.size_ratio
        for i, f in enumerate(self.workloads):
            out[f.workload.figure], out[f.workload.ratio] = f.figure, f.ratio
            if i == 0 and f.same_rounds is not None:  # after the first workload's ratio, where it has always been
                out["same_rounds"] = {g.workload.key: g.same_rounds for g in self.workloads}
        if generation is not None:
            out[results.GENERATION_RATIO] = generation.ratio
        for t in self.train:
            out |= t.to_dict()
        out["flags"] = self.flags
        optional = {"invalid": self.invalid, "compiled": self.compiled, "vs_peers": self.vs_peers,
                    "same_computation_as": self.same_computation_as or None}
        return out | {k: v for k, v in optional.items() if v is not None}

    def non_finite(self) -> list[str]:
        """The comparisons of the row whose measurements held a NaN or an infinity."""
        return [k for k, v in self.to_dict().items() if isinstance(v, dict) and v.get("verdict") == results.INVALID]


def workload_figures(timed: dict[str, Any], tag: str, ref: str, table: Family) -> list[WorkloadFigures]:
    """`tag`'s figures at every workload, paired with `ref` in the same rounds (a ratio of the main `table`)."""
    out = []
    for w in workloads.all_():
        samples = timed[w.measure]
        same = None
        if tag != ref:  # a contender that settled early ran a prefix of the reference's rounds
            n = len(samples[tag])
            same = {"rounds": n, "reference": figure(w, samples[ref][:n])}
        ratio = (samples.ratio if tag == ref else partial(table.ratio, samples))(ref, tag, w.higher_is_better)
        out.append(WorkloadFigures(w, figure(w, samples[tag]), ratio, same))
    return out


def train_figures(timed: dict[str, Any], tag: str, ref: str, stage: str, table: Family) -> list[TrainFigures]:
    """`tag`'s training tokens/s at every training batch, paired with `ref` (a ratio of the main `table`); or
    why it was not run."""
    out = []
    for b in TRAIN_BATCHES:
        train = timed.get(train_measure(b), {})
        if tag in train and ref in train:
            ratio = (train.ratio if tag == ref else partial(table.ratio, train))(ref, tag, True)
            out.append(TrainFigures(b, stats.median_of_rounds(train[tag]), ratio))
        else:
            out.append(TrainFigures(b, timed.get(TRAIN_SKIPPED) or
                                    f"not run: {stage} artifacts (int8 or ONNX) do not train"))
    return out


def artifact_row(r: dict[str, Any], ref: dict[str, Any], timed: dict[str, Any], peers: list[str],
                 digests: dict[str, str | None], tables: dict[str, Family]) -> ArtifactRow:
    """The row of the artifact `r` (its static measurement) against the reference `ref` and the `peers`
    (`digests`: each peer's `computation`); its ratios join `tables` (`TABLES`: each decided under Holm as a
    whole once every row has joined, `Family.close`)."""
    tag = r["tag"]
    measured = ArtifactRow({k: v for k, v in r.items() if k not in PER_BLOCK},
                           stats.paired_delta(ref["block_losses"], r["block_losses"], ref["block_docs"]),
                           r["size_bytes"] / ref["size_bytes"],
                           workload_figures(timed, tag, ref["tag"], tables["main"]),
                           train_figures(timed, tag, ref["tag"], r["stage"], tables["main"]))
    flags = [r["generation"]["note"]] if "note" in r["generation"] else []
    invalid = None
    if not math.isfinite(r["eval_loss"]) or (bad := measured.non_finite()):
        invalid = ("non-finite held-out loss" if not math.isfinite(r["eval_loss"]) else
                   "non-finite measurements in " + ", ".join(bad))
        flags.append(f"invalid: {invalid} (never delivered; no verdict printed)")
    compiled = compiled_row(timed, tag, ref["tag"], tables["compiled"]) if tag in timed.get("compile_status", {}) \
        else None
    same, vs_peers = None, None
    if r["stage"] != "peer":
        same = [p for p, d in (digests or {}).items() if d and d == r.get("computation")]
        vs_peers = {p: peer_ratios(timed, p, tag, None if p in same else tables["peer"]) for p in peers}
        flags += [aa_problem(tag, p, w, ratio) for p in same for w, ratio in vs_peers[p].items()
                  if results.PairedRatio.of(ratio).verdict in ("faster", "slower")]
    return replace(measured, flags=flags, invalid=invalid, compiled=compiled, vs_peers=vs_peers,
                   same_computation_as=same)


def aa_problem(tag: str, peer: str, workload: str, ratio: dict[str, Any]) -> str:
    """The flag of a decided A/A ratio: two contenders running the very same computation measured apart."""
    return (f"{AA_FAILED}: {tag} vs {peer} at {workload} decided {results.PairedRatio.of(ratio).fmt()}, though "
            "both run the very same computation: a measurement problem on this machine (its ratios carry a bias "
            "the intervals do not cover)")


def artifact_rows(static: list[dict[str, Any]], timed: dict[str, Any]) -> list[ArtifactRow]:
    """One row per artifact: its own figures, and paired comparisons with the first (the reference), each table's
    ratios decided together under Holm (`TABLES`)."""
    peers = {r["tag"]: r.get("computation") for r in static if r["stage"] == "peer"}
    tables = {name: Family(name) for name in TABLES}
    rows = [artifact_row(r, static[0], timed, list(peers), peers, tables) for r in static]
    for t in tables.values():
        t.close()
    return rows


def combine(static: list[dict[str, Any]], timed: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows as bench.json has them (`artifact_rows`, each `to_dict()`)."""
    return [row.to_dict() for row in artifact_rows(static, timed)]


def peer_ratios(timed: dict[str, Any], peer: str, tag: str, table: Family | None) -> dict[str, Any]:
    """`tag` against the peer row `peer`, paired in the same rounds, per workload (`decode_b1`, ...): decode ratios
    above 1 and prefill ratios below 1 are faster than the peer. Ratios of the peer `table`; None for a peer that
    runs the very computation of `tag` (the A/A check, `aa_problem`): each of its ratios alone, at its look's level,
    is the check."""
    return {w.key: (partial(table.ratio, timed[w.measure]) if table else timed[w.measure].ratio)(
        peer, tag, w.higher_is_better) for w in peer_workloads()}


def compiled_row(timed: dict[str, Any], tag: str, ref: str, table: Family) -> dict[str, Any]:
    """An artifact's compiled twin: its latency, paired with the same artifact eager and with the (eager)
    reference, and its compiled decoding's tokens/s paired with the eager decoding; or why either did not run."""
    out: dict[str, Any] = {"status": timed["compile_status"][tag],
                           "generation_status": timed.get("generation_compile_status", {}).get(tag, "not run")}
    prefill = workloads.of_kind("prefill")
    if prefill and tag + COMPILED in timed[prefill[0].measure]:
        for w in prefill:
            samples = timed[w.measure]
            out[w.figure] = latency_stats(samples[tag + COMPILED])
            out[f"ratio_vs_eager_{w.tail}"] = table.ratio(samples, tag, tag + COMPILED)
            out[w.ratio] = table.ratio(samples, ref, tag + COMPILED)
    gen = timed[workloads.get(workloads.GENERATION).measure]
    if tag + COMPILED in gen:
        out["generation_tokens_per_s"] = stats.median_of_rounds(gen[tag + COMPILED])
        out["generation_ratio_vs_eager"] = table.ratio(gen, tag, tag + COMPILED, higher_is_better=True)
    return out
