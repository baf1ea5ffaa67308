"""Which artifact `effkit run` ships, by the decision rule (`effkit.measure.choice.decide`) over its own paired,
interleaved rounds among its contenders at the recipe's workload (the bench's `deliverable_rounds`,
`effkit.bench.timing.deliverable_rounds`: the artifacts within the loss budget, with a budget for each contender
still open, as every decision of effkit's), the best lossless one beside it, each one's standing against the peers
(`beaten_by`), and the line the run prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effkit import workloads
from effkit.artifacts.loader import load_command
from effkit.bench.rows import AA_FAILED, peer_workloads
from effkit.bench.timing import within_budget
from effkit.errors import EffkitError
from effkit.measure import choice, results, stats
from effkit.stage import Plan

LOSSLESS = 0.002  # a loss increase up to this over the reference (the interval's upper end) counts as no loss


def deliverable(plan: Plan, bench: dict[str, Any]) -> dict[str, Any]:
    """The artifact to ship, by the decision rule (`effkit.measure.choice.decide`) over its own rounds at the
    recipe's workload (`optimize_for`; the bench's `deliverable_rounds`): among the benched artifacts (peers
    excluded: they are what a user has without effkit) whose held-out loss is within `max_loss_increase` of the
    dense reference's (the upper end of the paired interval), the leader (the best paired point estimate among those
    measured longest that no other is decided faster than), decided against each of the others, or tied within the
    precision (then the smallest), or still undecided (then labelled a point estimate; but where it is undecided
    against the best lossless artifact, that one ships), Holm over the contest as in every decision. Beside it: the
    best lossless artifact (within +0.2%) by the same rule over the same rounds, each
    one's standing against every peer at that workload (a peer that beats it is named), and, for a pruned artifact,
    its dense control's attribution."""
    budget, chosen = plan.run.pipeline.max_loss_increase, workloads.get(plan.run.pipeline.optimize_for)
    rows = {r["tag"]: r for r in bench["artifacts"]}
    ours = [r for r in bench["artifacts"] if r["stage"] != "peer"]
    ref = ours[0]
    losses, docs = bench["block_losses"], bench.get("block_docs")
    rounds = bench.get("deliverable_rounds")
    if rounds is None or rounds.get("workload") != chosen.name:
        raise EffkitError(f"the bench report has no rounds of the deliverable's own at {chosen.name}: bench again "
                          "(effkit run --force)")
    samples, record = rounds["samples"], rounds["record"]
    level, precision = record["level"], record["precision"]

    def pick(limit: float, with_ref: bool, default: str | None = None) -> choice.Choice | None:
        members = [r["tag"] for r in ours if not r.get("invalid") and r["tag"] in samples and (
            (r is ref and with_ref) or (r is not ref and within_budget(losses[ref["tag"]], losses[r["tag"]], docs,
                                                                       limit)))]
        if not members:
            return None
        c = choice.decide({t: samples[t] for t in members}, chosen.higher_is_better, level, precision,
                          prefer=lambda t: (rows[t]["size_ratio"], members.index(t)), record=dict(record),
                          default=default)
        c.far = {t: why for t, why in rounds.get("far", {}).items() if t in members}
        return c

    lossless = pick(LOSSLESS, False)
    # loss ships only where it buys a decided speed-up: a leader still undecided against the best lossless artifact
    # leaves that one in place
    picked = pick(budget, True)
    if lossless and picked.verdict == choice.UNDECIDED and picked.picked not in lossless.samples \
            and picked.picked != ref["tag"]:
        picked = pick(budget, True, default=lossless.picked)
    best = rows[picked.picked]
    path = Path(best["artifact"])
    loss = "ref" if best is ref else stats.fmt_delta(best[results.EVAL_LOSS_DELTA]) + f" vs {ref['tag']}"
    if best.get(results.EVAL_LOSS_DELTA_VS_CONTROL):
        loss += (f" ({stats.fmt_delta(best[results.EVAL_LOSS_DELTA_VS_CONTROL])} of it against its dense control, "
                 "the dense model fine-tuned the same way: the rest is what that fine-tuning did)")
    cols = ", ".join(f"{w.name} " + ("1.00x (reference)" if best is ref else stats.fmt_ratio(best[w.ratio]))
                     for w in peer_workloads() if best is ref or w.ratio in best)
    peers = best.get("vs_peers", {})
    same = best.get("same_computation_as", ())
    vs_peers = "; ".join(f"vs {p}" + (" (the same computation: the protocol's A/A check)" if p in same else "")
                         + ": " + ", ".join(f"{w} {stats.fmt_ratio(r[w])}" for w in r) for p, r in peers.items())
    against = against_peer(rounds, best["tag"], chosen)
    vs_peers += (("; " if vs_peers else "") + f"in the deliverable's own rounds vs the fastest peer {against['peer']}: "
                 f"{stats.fmt_ratio(against['ratio'])}") if against else ""
    aa = [f for r in ours for f in r.get("flags", ()) if f.startswith(AA_FAILED)]
    judged = {"delivered": best["tag"], "lossless": lossless.picked if lossless else None}
    beaten = {name: beaten_by(rows[tag], chosen) for name, tag in judged.items() if tag}
    warn = "; ".join(f"the {name} artifact {judged[name]} is slower at {chosen.name} than "
                     + ", ".join(f"{p} ({stats.fmt_ratio(r)})" for p, r in by.items())
                     for name, by in beaten.items() if by)
    line = (f"deliver {best['tag']} (chosen for {chosen.name}: {picked.label}): {cols}; "
            f"size {best['size_ratio']:.2f}x, loss {loss}" + (f"; {vs_peers}" if vs_peers else "")
            + (f"; NOTE: {warn}" if warn else "") + "".join(f"; NOTE: {f}" for f in aa)
            + f"; load it: {load_command(path)}, or effkit generate --from {path}")
    return {"tag": best["tag"], "artifact": str(path), "line": line, "budget": budget, "optimize_for": chosen.name,
            "verdict": picked.label, "choice": picked.to_dict(),
            "lossless": {"tag": lossless.picked, "verdict": lossless.label, "choice": lossless.to_dict(),
                         "limit": LOSSLESS} if lossless else None,
            "beaten_by_peers": beaten,
            "vs_peers": {p: r[chosen.key] for p, r in peers.items() if chosen.key in r},
            "vs_fastest_peer": against,
            "aa_check": {"pairs": {f"{r['tag']} vs {p}": r["vs_peers"][p] for r in ours
                                   for p in r.get("same_computation_as", ())},
                         "failed": aa},
            "how": _how(ref["tag"], budget, chosen.name, precision, level, len(picked.ratios) + 1)}


def _how(ref: str, budget: float, workload: str, precision: float, level: float, contenders: int) -> str:
    """How the deliverable was chosen, in words (its record's `how`)."""
    return (f"benched artifacts (not the peer rows) whose held-out loss is at most {budget:.1%} above "
            f"{ref}'s (upper end of the paired interval), and {ref} itself; at {workload}, "
            "in their own paired, interleaved rounds (the decision rule's screen, then its head to head; "
            "its record and every sample under `choice`): the leader (best paired point estimate among "
            "those measured longest that no other is decided faster than over the rounds both ran), "
            "decided against each of the others, or tied (interval inside "
            f"[1/{1 + precision:g}, {1 + precision:g}]; then the smallest), or undecided (labelled a point "
            f"estimate; a leader undecided against the best lossless artifact, within +{LOSSLESS:.1%}, "
            "leaves that one in place: loss ships only where it buys a decided speed-up); "
            f"family-wise error {1 - level:.2%} per look under Holm over every pair of its "
            f"{contenders} contenders; the lossless one the same way, over the same rounds, "
            f"among those within +{LOSSLESS:.1%}")


def against_peer(rounds: dict[str, Any], tag: str, w: workloads.Workload) -> dict[str, Any] | None:
    """The artifact `tag` against the fastest peer the deliverable's own rounds timed beside it (`peer`, the
    decision's reference): its paired ratio to that peer over the screen's rounds, at the contest's level, or None
    (no peer in those rounds, or `tag` not timed in its screen)."""
    peer, ratio = rounds.get("peer"), rounds.get("reference", {}).get(tag)
    if peer is None or ratio is None:
        return None
    return {"peer": peer, "ratio": ratio, "how": f"{tag} over {peer} at {w.name}, paired over the "
                                                 f"{ratio.get('rounds', '?')} rounds of the deliverable's screen"}


def beaten_by(row: dict[str, Any], w: workloads.Workload) -> dict[str, dict[str, Any]]:
    """The peers that are decided faster than the artifact of `row` at `w` (its paired ratio to each); never a peer
    that runs the artifact's very computation (`same_computation_as`): a difference between the two is noise."""
    same = row.get("same_computation_as", ())
    return {p: r[w.key] for p, r in row.get("vs_peers", {}).items()
            if p not in same and w.key in r and results.PairedRatio.of(r[w.key]).verdict == "slower"}
