"""The bench's timing: every artifact loaded at once and timed in interleaved rounds, one measure per registered
workload (`effkit.workloads`) and per training batch, each until the ratios it reports are settled
(`effkit.measure.stopping`), each ratio judged at its Holm level within its table (`table_cells`); which ratios
those are (`compared`), and the deliverable's decision in its own rounds (`deliverable_rounds` among `contest_of`'s
artifacts, `within_budget`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, workloads
from effkit.artifacts.loader import engine_of, load_any, trainable
from effkit.bench.discover import tags
from effkit.config import BenchConfig
from effkit.measure import choice, generation, results, stats, stopping
from effkit.measure.timing import compile_for_inference, train_step_timers

TRAIN_SKIPPED = "train_skipped"  # the timed result's key saying why no training was measured (--train-steps 0)

# the batches of the training steps timed for every trainable artifact (tokens/s); the batches of the prefill
# workloads are also what a compiled twin is compiled for
TRAIN_BATCHES = (4, 12)
COMPILED = " (compiled)"  # the suffix of a compiled twin's contender name


def train_measure(batch: int) -> str:
    """The measure of the training steps at `batch` (its rounds, its stopping record): `train_b12`."""
    return f"train_b{batch}"


def compiled_twins(models: dict[str, Any], engine: dict[str, Any], tokenizer, block: int, new_tokens: int,
                   prompts: list[Any]) -> tuple[dict[str, Any], dict[str, str], dict[str, tuple[dict[str, Any], Any]],
                                                dict[str, str]]:
    """With `--compile`: (forwards of the compiled twins by `<tag> (compiled)`, whether each compiled, each tag's
    compiled decoding (static KV cache) as (its kwargs, its timer at the generation's batch of `prompts`, already
    compiled), whether each did)."""
    forward, status, decoding, gen_status = {}, {}, {}, {}
    prefill_batches = tuple(w.batch for w in workloads.of_kind("prefill"))
    for tag, m in models.items():
        compiled, status[tag] = compile_for_inference(m, prefill_batches, block, **engine[tag].prefill_kwargs)
        if compiled is not None:
            forward[tag + COMPILED] = compiled
        kwargs, gen_status[tag] = generation.compiled_generation(m)
        if kwargs is not None:
            timer = engine[tag].decode(m, tokenizer, workloads.get(workloads.GENERATION).batch, new_tokens, kwargs,
                                       prompts=prompts)
            try:
                timer()  # compiles
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                first = (str(e).strip().splitlines() or [""])[0]
                gen_status[tag] = f"not run: torch.compile failed ({type(e).__name__}: {first[:120]})"
            else:
                decoding[tag] = (kwargs, timer)
    return forward, status, decoding, gen_status


def decode_fns(models: dict[str, Any], engine: dict[str, Any], tokenizer, w: workloads.Workload, new_tokens: int,
               prompts: list[Any], compiled: dict[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    """The timers of decode workload `w`, every one on the same `prompts` (`generation.prompt_batches`), and the
    compiled decoding (static KV cache) of each artifact that has one at the generation's batch."""
    n = new_tokens if w.tokens is None else min(
        generation.generation_budget(m, tokenizer, w.tokens, prompts[0].shape[1])[0] for m in models.values())
    fns = {t: engine[t].decode(m, tokenizer, w.batch, n, prompts=prompts) for t, m in models.items()}
    gen = workloads.get(workloads.GENERATION)
    if w.batch == gen.batch:  # compiled decoding (static KV cache) joins the rounds at its batch
        fns |= {t + COMPILED: timer if n == new_tokens and w.prompts == gen.prompts else
                engine[t].decode(models[t], tokenizer, w.batch, n, kw, prompts=prompts)
                for t, (kw, timer) in compiled.items()}
    return fns


def timed_side_by_side(paths: list[Path], cfg: BenchConfig, tokenizer, block: int, device: torch.device,
                       contest: tuple[str, list[str]] | None = None,
                       ties: frozenset[frozenset[str]] = frozenset()) -> dict[str, dict[str, Any]]:
    """Every artifact loaded at once and timed in interleaved rounds: {measure: {tag: per-round samples}}. Measures:
    each workload's (`w.measure`: prefill seconds, or new tokens/s of greedy decoding with the KV cache, from the
    held-out prompts of `generation.reference_prompts`, the same for every contender in every round), and the
    training steps' (`train_b4`, `train_b12`: tokens/s, dense and pruned artifacts only). With `compile`, each
    PyTorch artifact's compiled twin (`<tag> (compiled)`) joins the prefill rounds, and its compiled decoding (static
    KV cache) the decode rounds at the generation's batch (`workloads.GENERATION`); `compile_status` and
    `generation_compile_status` say, per artifact, whether they compiled. `contest`: (workload, tags) of the
    deliverable's decision: measured after them in its own rounds at that workload (`deliverable_rounds`, under
    `decision`). `ties`: pairs of tags that run the very same computation (`ties_of`): their ratio is reported, but
    no round is run to settle it."""
    names = tags(paths)
    models = {tag: load_any(p, device).eval() for tag, p in zip(names, paths, strict=True)}
    engine = {tag: engine_of(p) for tag, p in zip(names, paths, strict=True)}
    cut, prompts = generation.reference_prompts(paths[0], tokenizer, cfg.what.data)
    batches = {w.name: generation.prompt_batches(tokenizer, w.batch, cut.get(w.prompts))
               for w in workloads.of_kind("decode")}
    longest = max(b[0].shape[1] for b in batches.values())  # prompt and new tokens fit the smallest context
    new_tokens = min(generation.generation_budget(m, tokenizer, cfg.measure.gen_tokens, longest)[0]
                     for m in models.values())
    forward, status, compiled_decoding, gen_status = dict(models), {}, {}, {}
    if cfg.measure.compile:
        twins, status, compiled_decoding, gen_status = compiled_twins(models, engine, tokenizer, block, new_tokens,
                                                                      batches[workloads.GENERATION])
        forward |= twins
    plan: dict[str, tuple[dict[str, Any], int]] = {}
    for w in workloads.all_():
        if w.kind == "prefill":
            plan[w.measure] = ({t: engine[t.removesuffix(COMPILED)].prefill(m, w.batch, w.tokens or block)
                                for t, m in forward.items()}, cfg.measure.repeats)
        else:
            plan[w.measure] = (decode_fns(models, engine, tokenizer, w, new_tokens, batches[w.name],
                                          compiled_decoding), 1)
    steppers = {tag: train_step_timers(models[tag], TRAIN_BATCHES, block)
                for tag, p in zip(names, paths, strict=True) if trainable(p) and cfg.measure.train_steps}
    for b in TRAIN_BATCHES:
        plan[train_measure(b)] = ({t: timers[b] for t, timers in steppers.items()}, cfg.measure.train_steps)
    stop = stopping.Stopping.of(cfg.measure)
    peers = [t for t, p in zip(names, paths, strict=True) if artifacts.read_meta(p)["stage"] == "peer"]
    plan = {name: (fns, repeats) for name, (fns, repeats) in plan.items() if fns}  # nothing trainable: no train_b*
    tables = stopping.Tables(table_cells(names, peers, ties, {name: list(fns) for name, (fns, _) in plan.items()}))
    timed = {}
    for name, (fns, repeats) in plan.items():  # each ratio judged at its Holm level within its table
        timed[name] = stopping.measure(fns, stop, repeats, warmup=2, pairs=compared(list(fns), peers, ties),
                                       tables=(tables, name))
        tables.done(name, timed[name])
    skipped = {} if cfg.measure.train_steps else {TRAIN_SKIPPED: "not run: --train-steps 0 (no training measure)"}
    judged = None if contest is None else workloads.get(contest[0])
    decision = {} if contest is None else {"decision": deliverable_rounds(
        plan[judged.measure][0], contest, stop, cfg.measure.contest_budget_s * cfg.what.peer_share,
        peer=fastest(timed.get(judged.measure, {}), peers, judged.higher_is_better))}
    return {**timed, **skipped, "compile_status": status, "generation_compile_status": gen_status,
            "new_tokens": new_tokens, "prompts": prompts, **decision,
            "stopping": {name: m.record for name, m in timed.items()}}


def deliverable_rounds(fns: dict[str, Any], contest: tuple[str, list[str]], stop: stopping.Stopping,
                       budget_s: float, peer: str | None = None, **clocks: Any) -> dict[str, Any]:
    """The deliverable's own evidence: its contenders (`contest_of`) in their own paired, interleaved rounds at the
    judged workload, by the decision rule (`choice.choose`: screen, then head to head), as every other decision of
    effkit's; `budget_s` seconds for each contender still open against the leader (the bench's `contest_budget_s`
    times its share of its time budget), so that its evidence scales with what is at stake. `peer`: the fastest
    peer at that workload (`fastest`), timed in the screen's rounds as the decision's `reference` (never picked,
    never the measure of how far behind a contender is), so that each contender is set against what a user has
    without effkit in the same rounds (`reference` of the record). Every sample kept (`Choice.to_dict`). `clocks`:
    `choose`'s clock and sleep."""
    w = workloads.get(contest[0])
    rule = choice.Rule(rounds=stop.rounds, precision=stop.precision, budget_s=budget_s, seed=stop.seed)
    timed = [t for t in contest[1] if t in fns] + ([peer] if peer in fns and peer not in contest[1] else [])
    c = choice.choose({t: fns[t] for t in timed}, w.higher_is_better, rule, reference=peer if peer in timed else None,
                      **clocks)
    return {"workload": w.name, "measure": w.measure, **c.to_dict(), **({"peer": peer} if peer in timed else {})}


def fastest(samples: dict[str, list[list[float]]], among: list[str], higher_is_better: bool) -> str | None:
    """The one of `among` with the best median of its per-round medians in `samples` (a measure's rounds), or
    None."""
    medians = {t: statistics.median(statistics.median(r) for r in samples[t]) for t in among if samples.get(t)}
    return (max if higher_is_better else min)(medians, key=medians.get) if medians else None


def table_cells(names: list[str], peers: list[str], ties: frozenset[frozenset[str]],
                measures: dict[str, list[str]]) -> list[tuple[str, str, str, str]]:
    """Every ratio the bench's tables will hold (`effkit.bench.rows.TABLES`) as (table, measure, reference, other),
    before it is measured: the main table every artifact against the first at every measure both ran, the peer
    table every artifact against every peer at the peer workloads (not a pair of the same computation, `ties`), the
    compiled table each compiled twin against its eager self and against the first."""
    ref = names[0]
    cells = [("main", m, ref, t) for m, fns in measures.items() for t in names[1:] if ref in fns and t in fns]
    peer_measures = [w.measure for w in workloads.all_() if w.name != workloads.PREFILL_B1.name]  # rows.peer_workloads
    cells += [("peer", m, p, t) for t in names if t not in peers for p in peers
              for m in peer_measures if frozenset((p, t)) not in ties]
    for t in names:
        prefill = [w.measure for w in workloads.of_kind("prefill") if t + COMPILED in measures.get(w.measure, ())]
        cells += [("compiled", m, a, t + COMPILED) for m in prefill for a in (t, ref)]
        gen = workloads.get(workloads.GENERATION).measure
        cells += [("compiled", gen, t, t + COMPILED)] if t + COMPILED in measures.get(gen, ()) else []
    return cells


def within_budget(reference_losses: list[float], losses: list[float], docs: list[int] | None, budget: float) -> bool:
    """Whether an artifact's held-out loss is within `budget` of the reference's: the upper end of the paired
    delta's interval (as quantize's auto), never the point estimate alone."""
    delta = results.LossDelta.of(stats.paired_delta(reference_losses, losses, docs))
    return delta.verdict != results.INVALID and delta.ci95[1] <= budget


def contest_of(static: list[dict[str, Any]], paths: list[Path],
               deliver: tuple[str, float] | None) -> tuple[str, list[str]] | None:
    """(workload, tags) of the deliverable's decision: the reference and the artifacts (not the peers) within the
    loss budget."""
    if deliver is None:
        return None
    ref = static[0]
    members = [t for t, r in zip(tags(paths), static, strict=True) if r["stage"] != "peer" and (
        r is ref or within_budget(ref["block_losses"], r["block_losses"], ref.get("block_docs"), deliver[1]))]
    return deliver[0], members


def ties_of(static: list[dict[str, Any]]) -> frozenset[frozenset[str]]:
    """The pairs of artifacts (by tag) whose engines report one and the same computation (`Engine.computation`):
    ties by construction, such as effkit's standard int8 and ONNX Runtime's own of the same export."""
    digests = [(r["tag"], r.get("computation")) for r in static]
    return frozenset(frozenset((a, b)) for i, (a, da) in enumerate(digests) for b, db in digests[i + 1:]
                     if da and da == db)


def compared(names: list[str], peers: list[str],
             ties: frozenset[frozenset[str]] = frozenset()) -> list[tuple[str, str]]:
    """The ratios the bench reports, which its rounds must settle: every contender against the first (the
    reference), every artifact against every peer, a compiled twin against its eager self; none between two
    contenders that run the same computation (`ties`): their difference is noise, which no number of rounds
    settles (on a 2-core EPYC that one pair alone kept two workloads running to the last look)."""
    ref = names[0]
    pairs = [(ref, n) for n in names[1:]]
    pairs += [(p, n) for p in peers for n in names if n not in peers and not n.endswith(COMPILED)]
    pairs += [(n.removesuffix(COMPILED), n) for n in names if n.endswith(COMPILED)]
    return [(a, b) for a, b in pairs if frozenset((a, b)) not in ties]
