"""`effkit bench`: every artifact of a run measured with one protocol against the first (dense) one, and
`bench.json` / `bench.csv` / `bench.md` / `leaderboard.json` in the run's report folder.

Two parts. (1) Each artifact alone in a fresh process: held-out loss per block, a greedy sample, and peak memory
(on CPU the process' RSS high-water mark, which an earlier artifact's freed memory would hide). (2) All artifacts
loaded side by side in one process and timed in interleaved rounds (forward latency at batch 1 and 12,
generation tokens/s, training tokens/s), so that every ratio to the reference is paired and comes with a 95%
interval and a verdict (`effkit.measure.stats`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, engines, workloads
from effkit.artifacts.loader import cannot_run_on, engine_of, is_quantized, kind, load_any, trainable
from effkit.child import run_isolated
from effkit.config import BenchConfig, DataConfig, build_config
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import evaluation, generation, hardware, memory, results, stats, stopping, timing
from effkit.measure.compare import generate_sample
from effkit.parallel import resolve_device
from effkit.report import atomic_write_text, write_rows_csv
from effkit.stage import Plan, RunContext, Stage, Step, best_of_each_mode, fingerprint, pruning_rounds

# the workloads (effkit.workloads: prefill and decode at batch 1 and 12, and any registered one) are timed for every
# artifact; the batches of the prefill ones are also what a compiled twin is compiled for
TRAIN_BATCHES = (4, 12)
LEADERBOARD_UNITS = {"loss": "nats/token (held-out eval loss)", "inference_latency_1": "seconds per forward "
                     "(batch 1, p50)", "inference_latency_12": "seconds per forward (batch 12, p50)",
                     "training_throughput_4": "tokens/s (batch 4)", "training_throughput_12": "tokens/s (batch 12)"}


def find_artifacts(cfg: BenchConfig) -> tuple[str, list[Path]]:
    if cfg.what.paths:
        paths = [Path(p) for p in cfg.what.paths]
        for p in paths:
            if not p.exists():
                raise EffkitError(f"artifact {p} does not exist")
            artifacts.read_meta(p)
        return artifacts.run_of(paths[0]), paths
    runs = Path(cfg.folders.runs_dir)
    run_dir = runs / cfg.what.run if cfg.what.run else artifacts.latest_run(runs)
    if not run_dir.is_dir():
        raise EffkitError(f"unknown run {cfg.what.run!r}: {run_dir} does not exist; see `ls {cfg.folders.runs_dir}`")
    found = [((artifacts.read_meta(d).get("time", ""), (d / artifacts.META).stat().st_mtime_ns), d)
             for d in sorted(run_dir.iterdir()) if (d / artifacts.META).is_file()]  # times to the second, then ns
    if not found:
        raise EffkitError(f"no artifacts found in {run_dir}; run `effkit train` first")
    order = {"import": 0, "train": 0, "prune": 1, "quantize": 2, "export": 3, "peer": 4}
    found.sort(key=lambda td: (order.get(artifacts.read_meta(td[1])["stage"], 3), td[0]))
    return run_dir.name, [d for _, d in found]


def dense_control_of(path: Path) -> Path | None:
    """The dense control of a pruned artifact or of anything made from one (its int8 or ONNX forms): the dense
    parent fine-tuned exactly as the pruning round was, which the prune stage names in its metrics. None for
    artifacts with no pruning round in their ancestry, or whose control folder is gone."""
    seen: set[Path] = set()
    while path not in seen and (path / artifacts.META).is_file():
        seen.add(path)
        meta = artifacts.read_meta(path)
        control = meta.get("metrics", {}).get("control_artifact")
        if control:
            return Path(control) if (Path(control) / artifacts.META).is_file() else None
        if not meta.get("parent"):
            return None
        path = Path(meta["parent"])
    return None


def make_peers(reference: Path, scratch: Path, only: list[str] | None = None) -> tuple[list[Path], dict[str, str]]:
    """The dense reference through the engines a user would pick instead of effkit (every engine of
    `effkit.registry.ENGINES` with a peer), written into `scratch` as artifacts of stage `peer` (measured like every
    artifact, never delivered); with why a peer is not run. `only`: these engines' peers (default: every one)."""
    from transformers import AutoTokenizer

    from effkit.model import load_model

    peers = engines.peers(only)
    if kind(reference) != "pytorch":
        return [], {e.peer_tag: f"not run: the reference {reference.name} is not a PyTorch artifact" for e in peers}
    made, not_run = [], {}
    tokenizer, model = AutoTokenizer.from_pretrained(reference), load_model(str(reference)).eval()
    data = artifacts.data_section(reference)
    for engine in peers:
        tag = engine.peer_tag
        if reason := engine.available(None, int8=True):
            not_run[tag] = f"not run: {reason}"
            continue
        folder = scratch / tag
        folder.mkdir()
        try:
            desc = engine.write_peer(folder, reference, model, tokenizer)
        except EffkitError as e:
            not_run[tag] = f"not run: {e}"
            continue
        artifacts.write_meta(folder, "peer", {"engine": engine.label, "how": engine.peer_how}, {}, data=data,
                             parent=str(reference), extra={"peer": desc})
        made.append(folder)
    return made, not_run


def bench_one(path: Path, cfg: BenchConfig, tokenizer, eval_blocks: torch.Tensor, block: int,
              device: torch.device, eval_bytes: int = 0, docs: tuple[int, ...] = (),
              data: dict[str, Any] | None = None) -> dict[str, Any]:
    """One artifact alone: held-out loss (per block, for paired deltas), a greedy sample, size, parameters, and
    the peak memory of loading it and running every measured workload once. `data`: the data section the blocks
    come from (None: the artifact's own)."""
    meta = artifacts.read_meta(path)
    with memory.PeakMemory(device) as mem:
        model = load_any(path, device).eval()
        r: dict[str, Any] = {"artifact": str(path), "tag": path.name, "stage": meta["stage"],
                             "params": getattr(model, "n_params", None) or sum(p.numel() for p in model.parameters()),
                             "size_bytes": artifacts.dir_size(path), "quantized": is_quantized(path)}
        r.update(evaluation.evaluate(model, eval_blocks, cfg.measure.batch_size, eval_bytes=eval_bytes, docs=docs))
        r["generation"] = generate_sample(model, tokenizer, cfg.measure.gen_tokens)
        engine = engine_of(path)
        for w in workloads.of_kind("prefill"):
            engine.prefill(model, w.batch, w.tokens or block)()
        if trainable(path):
            for once in timing.train_step_timers(model, TRAIN_BATCHES, block).values():
                once()
    r["peak_memory_bytes"] = mem.peak_bytes
    if (control := dense_control_of(path)) is not None:  # after the peak: the control is not part of the footprint
        same_blocks = data is None or data == artifacts.data_section(path)  # what the prune stage evaluated on
        if results.EVAL_LOSS_DELTA_VS_CONTROL in meta["metrics"] and same_blocks:  # the prune stage's, same blocks
            r[results.EVAL_LOSS_DELTA_VS_CONTROL] = meta["metrics"][results.EVAL_LOSS_DELTA_VS_CONTROL]
        else:  # a descendant (int8, ONNX) of a pruned round, or other blocks (--data): against the same control,
            # paired on these blocks
            ctrl = evaluation.evaluate(load_any(control, device).eval(), eval_blocks, cfg.measure.batch_size)
            r[results.EVAL_LOSS_DELTA_VS_CONTROL] = stats.paired_delta(ctrl["block_losses"], r["block_losses"],
                                                                       r["block_docs"])
        r["control_artifact"] = str(control)
    return r


def bench_in_this_process(path: str, cfg: dict[str, Any], data: dict[str, Any], tokenizer_from: str,
                          device: str) -> dict[str, Any]:
    """`bench_one` from JSON-able arguments: what `run_isolated` calls in a fresh process."""
    data_cfg = DataConfig.from_dict(data)
    prepared = prepare(data_cfg, tokenizer_from=tokenizer_from)
    return bench_one(Path(path), BenchConfig.from_dict(cfg), prepared.tokenizer, prepared.blocks.eval,
                     data_cfg.block_size, resolve_device(device), prepared.blocks.eval_bytes,
                     prepared.blocks.eval_docs, data)


def bench_isolated(path: Path, cfg: BenchConfig, data: dict[str, Any], tokenizer_from: Path) -> dict[str, Any]:
    """`bench_one` in a fresh Python process."""
    return run_isolated("effkit.bench:bench_in_this_process",
                        {"path": str(path), "cfg": cfg.to_dict(), "data": data, "tokenizer_from": str(tokenizer_from),
                         "device": cfg.what.device}, what=f"bench of {path}")


def tags(paths: list[Path]) -> list[str]:
    """The artifacts' names, or run/name where two artifacts of different runs share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else f"{p.parent.name}/{p.name}" for p in paths]


COMPILED = " (compiled)"


def timed_side_by_side(paths: list[Path], cfg: BenchConfig, tokenizer, block: int, device: torch.device,
                       contest: tuple[str, list[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Every artifact loaded at once and timed in interleaved rounds: {measure: {tag: per-round samples}}.
    Measures: latency_b1, latency_b12 (prefill, seconds), decode_b1, decode_b12 (new tokens/s of greedy decoding
    with the KV cache), train_b4, train_b12 (tokens/s, dense and pruned artifacts only). With `compile`, each
    PyTorch artifact's compiled twin (`<tag> (compiled)`) joins the latency rounds, and its compiled decoding
    (static KV cache) the decode_b1 rounds; `compile_status` and `generation_compile_status` say, per artifact,
    whether they compiled. `contest`: (workload, tags) of a decision read off that workload's rounds (the
    deliverable): its leader against each of them must settle too (`stopping.contest_pairs`)."""
    models = {tag: load_any(p, device).eval() for tag, p in zip(tags(paths), paths, strict=True)}
    engine = {tag: engine_of(p) for tag, p in zip(tags(paths), paths, strict=True)}
    new_tokens = min(generation.generation_budget(m, tokenizer, cfg.measure.gen_tokens)[0] for m in models.values())
    forward = dict(models)
    status: dict[str, str] = {}
    compiled_decoding: dict[str, tuple[dict[str, Any], Any]] = {}  # tag -> its compiled twin's (kwargs, timer)
    gen_status: dict[str, str] = {}
    prefill_batches = tuple(w.batch for w in workloads.of_kind("prefill"))
    if cfg.measure.compile:
        for tag, m in models.items():
            compiled, status[tag] = timing.compile_for_inference(m, prefill_batches, block,
                                                                  **engine[tag].prefill_kwargs)
            if compiled is not None:
                forward[tag + COMPILED] = compiled
            kwargs, gen_status[tag] = generation.compiled_generation(m)
            if kwargs is not None:
                timer = engine[tag].decode(m, tokenizer, 1, new_tokens, kwargs)
                try:
                    timer()  # compiles
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    first = (str(e).strip().splitlines() or [""])[0]
                    gen_status[tag] = f"not run: torch.compile failed ({type(e).__name__}: {first[:120]})"
                else:
                    compiled_decoding[tag] = (kwargs, timer)
    plan: dict[str, tuple[dict[str, Any], int]] = {}
    for w in workloads.all_():
        if w.kind == "prefill":
            plan[w.measure] = ({t: engine[t.removesuffix(COMPILED)].prefill(m, w.batch, w.tokens or block)
                                for t, m in forward.items()}, cfg.measure.repeats)
            continue
        n = new_tokens if w.tokens is None else min(generation.generation_budget(m, tokenizer, w.tokens)[0]
                                                    for m in models.values())
        fns = {t: engine[t].decode(m, tokenizer, w.batch, n) for t, m in models.items()}
        if w.batch == 1:  # compiled decoding (static KV cache) joins the batch-1 rounds
            fns |= {t + COMPILED: timer if n == new_tokens else engine[t].decode(models[t], tokenizer, 1, n, kw)
                    for t, (kw, timer) in compiled_decoding.items()}
        plan[w.measure] = (fns, 1)
    steppers = {tag: timing.train_step_timers(models[tag], TRAIN_BATCHES, block)
                for tag, p in zip(tags(paths), paths, strict=True) if trainable(p)}
    for b in TRAIN_BATCHES:
        plan[f"train_b{b}"] = ({t: timers[b] for t, timers in steppers.items()}, cfg.measure.train_steps)
    stop = stopping.Stopping.of(cfg.measure)
    peers = [t for t, p in zip(tags(paths), paths, strict=True) if artifacts.read_meta(p)["stage"] == "peer"]
    decision = workloads.get(contest[0]) if contest else None
    plan = {name: (fns, repeats) for name, (fns, repeats) in plan.items() if fns}  # nothing trainable: no train_b*
    timed = {name: stopping.measure(fns, stop, repeats, warmup=2, pairs=compared(list(fns), peers),
                                    contest=(contest[1], decision.higher_is_better)
                                    if decision is not None and decision.measure == name else None)
             for name, (fns, repeats) in plan.items()}
    return {**timed, "compile_status": status, "generation_compile_status": gen_status, "new_tokens": new_tokens,
            "stopping": {name: m.record for name, m in timed.items()}}


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


def compared(names: list[str], peers: list[str]) -> list[tuple[str, str]]:
    """The ratios the bench reports, which its rounds must settle: every contender against the first (the
    reference), every artifact against every peer, a compiled twin against its eager self."""
    ref = names[0]
    pairs = [(ref, n) for n in names[1:]]
    pairs += [(p, n) for p in peers for n in names if n not in peers and not n.endswith(COMPILED)]
    pairs += [(n.removesuffix(COMPILED), n) for n in names if n.endswith(COMPILED)]
    return pairs


def figure(w: workloads.Workload, rounds: list[list[float]]) -> Any:
    """A workload's own figure over `rounds`: latency statistics (prefill) or the median tokens/s (decode)."""
    return timing.latency_stats(rounds) if w.kind == "prefill" else stats.median_of_rounds(rounds)


def combine(static: list[dict[str, Any]], timed: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per artifact: its own figures, and paired comparisons with the first (the reference)."""
    ref = static[0]
    peers = [r["tag"] for r in static if r["stage"] == "peer"]
    rows = []
    for r in static:
        tag = r["tag"]
        row = {k: v for k, v in r.items() if k not in ("block_losses", "block_docs")}
        loss = stats.paired_delta(ref["block_losses"], r["block_losses"], ref["block_docs"])
        row[results.EVAL_LOSS_DELTA] = loss
        row["delta"] = {"eval_loss": results.LossDelta.of(loss).delta, "size": r["size_bytes"] / ref["size_bytes"] - 1}
        row["size_ratio"] = r["size_bytes"] / ref["size_bytes"]
        for w in workloads.all_():
            samples = timed[w.measure]
            row[w.figure] = figure(w, samples[tag])
            row[w.ratio] = samples.ratio(ref["tag"], tag, higher_is_better=w.higher_is_better)
            if tag != ref["tag"]:  # a contender that settled early ran a prefix of the reference's rounds: the
                n = len(samples[tag])  # reference's figure over those same rounds, so the row can be recomputed
                row.setdefault("same_rounds", {})[w.key] = {"rounds": n,
                                                            "reference": figure(w, samples[ref["tag"]][:n])}
        row["generation"]["tokens_per_s"] = row["decode_tokens_per_s_b1"]  # the b1 decode, under its old names
        row[results.GENERATION_RATIO] = row[results.decode_ratio(1)]
        for b in TRAIN_BATCHES:
            train = timed.get(f"train_b{b}", {})
            if tag in train and ref["tag"] in train:
                row[f"train_tokens_per_s_b{b}"] = stats.median_of_rounds(train[tag])
                row[f"train_ratio_b{b}"] = train.ratio(ref["tag"], tag, higher_is_better=True)
            else:
                row[f"train_tokens_per_s_b{b}"] = f"not run: {r['stage']} artifacts (int8 or ONNX) do not train"
        row["flags"] = [row["generation"]["note"]] if "note" in row["generation"] else []
        invalid = [k for k, v in row.items() if isinstance(v, dict) and v.get("verdict") == results.INVALID]
        if not math.isfinite(r["eval_loss"]) or invalid:
            row["invalid"] = ("non-finite held-out loss" if not math.isfinite(r["eval_loss"]) else
                              "non-finite measurements in " + ", ".join(invalid))
            row["flags"].append(f"invalid: {row['invalid']} (never delivered; no verdict printed)")
        if tag in timed.get("compile_status", {}):
            row["compiled"] = compiled_row(timed, tag, ref["tag"])
        if r["stage"] != "peer":
            row["vs_peers"] = {p: peer_ratios(timed, p, tag) for p in peers}
        rows.append(row)
    return rows


def peer_workloads() -> tuple[workloads.Workload, ...]:
    """The workloads of the peer table: every one but prefill at batch 1 (a forward too short to tell engines
    apart; it stays in each row's own figures), decode ones first."""
    return tuple(sorted((w for w in workloads.all_() if w.name != "prefill-b1"), key=lambda w: w.kind != "decode"))


def peer_ratios(timed: dict[str, Any], peer: str, tag: str) -> dict[str, Any]:
    """`tag` against the peer row `peer`, paired in the same rounds, per workload (`decode_b1`, ...): decode ratios
    above 1 and prefill ratios below 1 are faster than the peer."""
    return {w.key: timed[w.measure].ratio(peer, tag, higher_is_better=w.higher_is_better) for w in peer_workloads()}


def peer_lines(report: dict[str, Any]) -> list[str]:
    """bench.md's table of every artifact against the engines a user would pick instead (the peer rows)."""
    peers = [r["tag"] for r in report["artifacts"] if r["stage"] == "peer"]
    if not peers:
        return []
    ws = peer_workloads()
    head = " | ".join(f"vs {p}: " + " | ".join(w.label for w in ws) for p in peers)
    lines = ["Against the engines a user would pick instead (the dense reference through them, same rounds; decode "
             "ratios above 1 and prefill ratios below 1 are faster than the peer):", "",
             f"| artifact | {head} |", "|---|" + "---|" * len(ws) * len(peers)]
    for r in report["artifacts"]:
        if "vs_peers" in r:
            cells = [stats.fmt_ratio(r["vs_peers"][p][w.key]) for p in peers for w in ws]
            lines.append(f"| {r['tag']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def compiled_row(timed: dict[str, Any], tag: str, ref: str) -> dict[str, Any]:
    """An artifact's compiled twin: its latency, paired with the same artifact eager and with the (eager)
    reference, and its compiled decoding's tokens/s paired with the eager decoding; or why either did not run."""
    out: dict[str, Any] = {"status": timed["compile_status"][tag],
                           "generation_status": timed.get("generation_compile_status", {}).get(tag, "not run")}
    prefill = workloads.of_kind("prefill")
    if prefill and tag + COMPILED in timed[prefill[0].measure]:
        for w in prefill:
            samples = timed[w.measure]
            out[w.figure] = timing.latency_stats(samples[tag + COMPILED])
            out[f"ratio_vs_eager_b{w.batch}"] = samples.ratio(tag, tag + COMPILED)
            out[w.ratio] = samples.ratio(ref, tag + COMPILED)
    gen = timed["decode_b1"]
    if tag + COMPILED in gen:
        out["generation_tokens_per_s"] = stats.median_of_rounds(gen[tag + COMPILED])
        out["generation_ratio_vs_eager"] = gen.ratio(tag, tag + COMPILED, higher_is_better=True)
    return out


def compiled_lines(report: dict[str, Any]) -> list[str]:
    """bench.md's table of compiled vs eager latency and generation (present with --compile)."""
    rows = [r for r in report["artifacts"] if "compiled" in r]
    if not rows:
        return []
    ref = report["artifacts"][0]["tag"]
    lines = ["Compiled (torch.compile, Inductor; forward with freezing, decoding with a static KV cache) vs eager, "
             "same interleaved rounds:", "",
             f"| artifact | eager b12 ms | compiled b12 ms | compiled vs eager b12 | compiled vs {ref} (eager) b12 | "
             "compiled vs eager b1 | compiled gen tok/s | compiled vs eager gen |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["compiled"]
        if "latency_b12" in c:
            fwd = (f"{c['latency_b12']['p50_s'] * 1e3:.1f} | {stats.fmt_ratio(c['ratio_vs_eager_b12'])} | "
                   f"{stats.fmt_ratio(c[results.LATENCY_RATIO_B12])} | {stats.fmt_ratio(c['ratio_vs_eager_b1'])}")
        else:
            fwd = f"{c['status']} | | |"
        gen = (f"{c['generation_tokens_per_s']:.0f} | {stats.fmt_ratio(c['generation_ratio_vs_eager'])}"
               if "generation_tokens_per_s" in c else f"{c.get('generation_status', 'not run')} |")
        lines.append(f"| {r['tag']} | {r['latency_b12']['p50_s'] * 1e3:.1f} | {fwd} | {gen} |")
    return [*lines, ""]


def leaderboard(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def num(v):
        return v if isinstance(v, float) else None

    return {"units": LEADERBOARD_UNITS, "artifacts": {r["tag"]: {
        "loss": r["eval_loss"], "inference_latency_1": r["latency_b1"]["p50_s"],
        "inference_latency_12": r["latency_b12"]["p50_s"], "training_throughput_4": num(r["train_tokens_per_s_b4"]),
        "training_throughput_12": num(r["train_tokens_per_s_b12"])} for r in rows}}


def run_bench(cfg: BenchConfig, progress: bool = True, deliver: tuple[str, float] | None = None,
              elsewhere: dict[str, str] | None = None) -> dict[str, Any]:
    """Bench every artifact of the run (and the peers); `deliver`: (workload, loss budget) of the deliverable to
    be chosen from this bench (`effkit run`): the artifacts within the budget are timed until the leader among
    them stands decided or tied against each of the others (see `deliverable`). `elsewhere`: artifacts of the run
    left out, each with where its figures are."""
    cfg = cfg.validate()
    device = resolve_device(cfg.what.device)
    run_name, found = find_artifacts(cfg)
    found = [p for p in found if p.name not in (elsewhere or {})]
    not_run = {p.name: f"not run: {reason}" for p in found if (reason := cannot_run_on(p, device))}
    not_run |= {tag: f"not benched here: {where}" for tag, where in (elsewhere or {}).items()}
    paths = [p for p in found if p.name not in not_run]
    if not paths:
        raise EffkitError(f"no artifact of run {run_name} can run on {device}: "
                          + "; ".join(f"{t}: {r}" for t, r in not_run.items()))
    run_dir = Path(cfg.folders.runs_dir) / run_name
    with artifacts.run_lock(run_dir):
        if not cfg.what.peers:
            return _bench(cfg, device, run_name, paths, progress, not_run, deliver)
        # the peers live as long as this bench; removed below, or by the next run lock if the process is killed
        scratch = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tmp-peers-"))
        try:
            peers, peers_not_run = make_peers(paths[0], scratch, cfg.peer_engine_names)
            peers_not_run |= {p.name: f"not run: {reason}" for p in peers if (reason := cannot_run_on(p, device))}
            peers = [p for p in peers if p.name not in peers_not_run]
            return _bench(cfg, device, run_name, paths + peers, progress, {**not_run, **peers_not_run}, deliver)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _bench(cfg: BenchConfig, device: torch.device, run_name: str, paths: list[Path],
           progress: bool, not_run: dict[str, str] | None = None,
           deliver: tuple[str, float] | None = None) -> dict[str, Any]:
    # every artifact is evaluated on the first one's held-out blocks
    data = artifacts.data_section(paths[0], cfg.what.data)
    data_cfg = DataConfig.from_dict(data)
    prepared = prepare(data_cfg, tokenizer_from=str(paths[0]))  # builds the caches once
    block = data_cfg.block_size
    t0 = time.perf_counter()
    if progress:
        from rich.progress import Progress

        with Progress() as bar:
            task = bar.add_task("bench", total=len(paths) + 1)
            static = []
            for p in paths:
                bar.update(task, description=f"bench {p.name} (loss, memory)")
                static.append(bench_isolated(p, cfg, data, paths[0]))
                bar.advance(task)
            bar.update(task, description=f"bench: timing {len(paths)} artifacts side by side")
            timed = timed_side_by_side(paths, cfg, prepared.tokenizer, block, device, contest_of(static, paths,
                                                                                                 deliver))
            bar.advance(task)
    else:
        static = [bench_isolated(p, cfg, data, paths[0]) for p in paths]
        timed = timed_side_by_side(paths, cfg, prepared.tokenizer, block, device, contest_of(static, paths, deliver))
    for row, tag in zip(static, tags(paths), strict=True):
        row["tag"] = tag
    rows = combine(static, timed)
    interleave = timing.INTERLEAVED_PROTOCOL.format(warmup=2, rounds=stopping.Stopping.of(cfg.measure).describe(),
                                                     repeats="{repeats}")
    report = {
        "stage": "bench", "run": run_name, "config": cfg.to_dict(), "artifacts": rows, "reference": rows[0]["tag"],
        "device": hardware.describe_device(device), "versions": artifacts.versions(),
        "git_commit": artifacts.git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.perf_counter() - t0,
        "verdicts": verdicts(rows), "not_run": not_run or {}, "stopping": timed["stopping"],
        # every timing of every round, per measure and contender: every ratio above can be recomputed from these
        "samples": {m: dict(timed[m]) for m in timed["stopping"]},
        # each artifact's held-out loss per block, and each block's document: every loss delta can be recomputed
        "block_losses": {r["tag"]: r["block_losses"] for r in static},
        "block_docs": static[0]["block_docs"],
        "protocol": {
            "eval_loss": evaluation.EVAL_PROTOCOL + f"; the blocks of {paths[0].name}'s data "
                         f"({len(prepared.blocks.eval)} blocks, {prepared.blocks.eval[:, 1:].numel()} predicted "
                         f"tokens); {stats.LOSS_METHOD}",
            "latency": f"forward of (batch, {block}) fixed random tokens under torch.inference_mode; "
                       + interleave.format(repeats=cfg.measure.repeats)
                       + f"; {stats.RATIO_METHOD}; p50/p90/p99 over all timed repeats"
                       + ("; with --compile each PyTorch artifact's torch.compile twin (Inductor, "
                                          "freezing, static shapes, compiled and warmed up before the rounds) is "
                                          "timed in the same rounds, and its compiled decoding (static KV cache) "
                                          "in the generation rounds" if cfg.measure.compile else ""),
            "generation": "decode: greedy decoding with the KV cache (PyTorch's generate; ONNX Runtime's with-past "
                          "graph; older ONNX artifacts without past recompute the prefix, see the notes) from 1 and "
                          f"12 copies of the prompt, {timed['new_tokens']} new tokens per row (capped by the "
                          "smallest context when needed), new tokens of all rows / wall time (prefill included); "
                          + interleave.format(repeats=1) + "; the b1 decode is also reported as `generation`",
            "training_throughput": f"one forward+backward+AdamW step on a private copy, batch x {block} tokens, "
                                   "tokens / wall time; " + interleave.format(repeats=cfg.measure.train_steps),
            "peak_memory": memory.PeakMemory(device).method + ", while loading the artifact, evaluating it and "
                           "running each timed workload once, each artifact in a fresh process",
            "reference": f"ratios and deltas are relative to the first artifact ({rows[0]['tag']})",
        },
    }
    out = Path(cfg.folders.reports_dir) / run_name
    atomic_write_text(out / "bench.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "leaderboard.json", json.dumps(leaderboard(rows), indent=2))
    write_rows_csv(out / "bench.csv", [flat_row(r) for r in rows])
    atomic_write_text(out / "bench.md", bench_markdown(report))
    return report


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per artifact, in words, following the statistics."""
    out = []
    for r in rows[1:]:
        parts = [stats.summary_of(r[results.LATENCY_RATIO_B12], "latency b12"), f"size {r['size_ratio']:.2f}x",
                 stats.summary_of(r[results.EVAL_LOSS_DELTA], f"loss vs {rows[0]['tag']}")]
        if r.get(results.EVAL_LOSS_DELTA_VS_CONTROL):
            parts.append(stats.summary_of(r[results.EVAL_LOSS_DELTA_VS_CONTROL],
                                          "loss vs its dense control (same fine-tuning)"))
        out.append(f"{r['tag']}: " + "; ".join(parts))
    return out


def flat_row(r: dict[str, Any]) -> dict[str, Any]:
    def num(v):
        return round(v, 2) if isinstance(v, float) else v

    def ratio(key: str) -> dict[str, Any]:
        c = results.PairedRatio.of(r[key]) if r.get(key) else None
        return {f"{key}": c.ratio, f"{key}_lo": c.ci95[0], f"{key}_hi": c.ci95[1],
                f"{key}_verdict": c.verdict} if c else {f"{key}": "", f"{key}_lo": "", f"{key}_hi": "",
                                                          f"{key}_verdict": ""}

    d = results.LossDelta.of(r[results.EVAL_LOSS_DELTA])
    return {"tag": r["tag"], "stage": r["stage"], "eval_loss": r["eval_loss"], "eval_loss_lo": r["eval_loss_ci95"][0],
            "eval_loss_hi": r["eval_loss_ci95"][1], "perplexity": r["perplexity"],
            "eval_loss_delta": d.delta, "eval_loss_delta_lo": d.ci95[0], "eval_loss_delta_hi": d.ci95[1],
            "eval_loss_delta_verdict": d.verdict,
            "latency_b1_p50_ms": r["latency_b1"]["p50_s"] * 1e3, **ratio(results.LATENCY_RATIO_B1),
            "latency_b12_p50_ms": r["latency_b12"]["p50_s"] * 1e3, **ratio(results.LATENCY_RATIO_B12),
            "generation_tokens_per_s": r["generation"]["tokens_per_s"], **ratio(results.GENERATION_RATIO),
            "decode_tokens_per_s_b12": r["decode_tokens_per_s_b12"], **ratio(results.decode_ratio(12)),
            "train_tokens_per_s_b4": num(r["train_tokens_per_s_b4"]),
            "train_tokens_per_s_b12": num(r["train_tokens_per_s_b12"]), **ratio("train_ratio_b12"),
            "peak_memory_mb": r["peak_memory_bytes"] / 2**20, "params": r["params"],
            "size_mb": r["size_bytes"] / 2**20, "size_ratio": r["size_ratio"], "flags": "; ".join(r["flags"])}


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The bench table: each artifact's own figures, and its paired ratios to the reference with 95% intervals
    (`≈` marks a ratio whose interval contains 1: no difference shown; `?` one left undecided)."""
    cols = ["artifact", "eval loss (95% CI)", "bits/byte", "Δ loss vs ref", "prefill b1 ms", "prefill b1 vs ref",
            "prefill b12 ms", "prefill b12 vs ref", "decode b1 tok/s", "decode b1 vs ref", "decode b12 tok/s",
            "decode b12 vs ref", "train tok/s b12", "train vs ref", "size MiB", "peak MiB"]
    ref = report["artifacts"][0]["tag"]
    rows = []
    for r in report["artifacts"]:
        is_ref = r["tag"] == ref

        def vs(key: str, is_ref: bool = is_ref, r: dict = r) -> str:
            if is_ref:
                return "ref"
            return (stats.fmt_ratio(r[key]) + same_rounds_note(report, r, key)) if key in r else "n/a"

        lo, hi = r["eval_loss_ci95"]
        train = r["train_tokens_per_s_b12"]
        bpb = r.get("bits_per_byte")
        rows.append([r["tag"], f"{r['eval_loss']:.4f} ({lo:.3f}-{hi:.3f})", f"{bpb:.4f}" if bpb else "n/a",
                     "ref" if is_ref else stats.fmt_delta(r[results.EVAL_LOSS_DELTA]),
                     f"{r['latency_b1']['p50_s'] * 1e3:.1f}", vs(results.LATENCY_RATIO_B1),
                     f"{r['latency_b12']['p50_s'] * 1e3:.1f}", vs(results.LATENCY_RATIO_B12),
                     f"{r['decode_tokens_per_s_b1']:.0f}", vs(results.decode_ratio(1)),
                     f"{r['decode_tokens_per_s_b12']:.0f}", vs(results.decode_ratio(12)),
                     f"{train:,.0f}" if isinstance(train, float) else "n/a", vs("train_ratio_b12"),
                     f"{r['size_bytes'] / 2**20:.1f} ({r['size_ratio']:.2f}x)",
                     f"{r['peak_memory_bytes'] / 2**20:.0f}"])
    return cols, rows


def same_rounds_note(report: dict[str, Any], row: dict[str, Any], ratio_key: str) -> str:
    """`; ref 278 in these 6 rounds` beside a ratio whose contender stopped before the reference did (settled
    early): its figure and the ratio are over fewer rounds than the reference's own figure in the first row."""
    w = next((w for w in workloads.all_() if w.ratio == ratio_key), None)
    same = row.get("same_rounds", {}).get(w.key) if w else None
    total = report.get("stopping", {}).get(w.measure, {}).get("rounds") if w else None
    if not same or not total or same["rounds"] >= total:
        return ""
    ref = same["reference"]
    value = f"{ref['p50_s'] * 1e3:.1f} ms" if isinstance(ref, dict) else f"{ref:,.0f}"
    return f"; ref {value} in these {same['rounds']} rounds"


def bench_markdown(report: dict[str, Any]) -> str:
    cols, rows = table_rows(report)
    lines = [f"# effkit bench: {report['run']}", "", f"Device: {report['device']}; torch "
             f"{report['versions'].get('torch')}; {report['time']}", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    # the level the printed intervals were computed at, as the ratios carry it, else the stopping records'
    levels = [v.get("level") for r in report["artifacts"][1:] for v in r.values()
              if isinstance(v, dict) and "ci95" in v and "ratio" in v] or [
        s.get("level") for s in report.get("stopping", {}).values()]
    intervals = stats.interval_words(levels)
    lines += ["", f"Ratios are paired with the reference and carry {intervals}; ≈ marks an interval that "
              "contains 1 (no difference shown) and ? one that also stopped wider than the precision asked for "
              "(undecided: more rounds could still decide it). A contender whose ratios settled early ran fewer "
              "rounds than the reference: its figure and ratio are over its own rounds, and the reference's figure "
              "over those same rounds is beside the ratio (`ref ... in these N rounds`).", ""]
    lines += stopping_lines(report.get("stopping", {}))
    lines += peer_lines(report)
    lines += compiled_lines(report)
    if report.get("verdicts"):
        lines += ["Verdicts:", *[f"- {v}" for v in report["verdicts"]], ""]
    flags = [f"- {r['tag']}: {f}" for r in report["artifacts"] for f in r["flags"]]
    flags += [f"- {tag}: {why}" for tag, why in report.get("not_run", {}).items()]
    if flags:
        lines += ["Notes:", *flags, ""]
    lines += ["How measured:", *[f"- {k}: {v}" for k, v in report["protocol"].items()], ""]
    lines += sample_lines(report["artifacts"])
    return "\n".join(lines)


def stopping_lines(records: dict[str, dict[str, Any]]) -> list[str]:
    """How many rounds each measure needed, and why it stopped."""
    if not records:
        return []
    why = {"fixed": "fixed rounds", "decided": "every ratio decided or within the precision",
           "max-rounds": "last look done, some ratios undecided", "budget": "time budget spent, some undecided"}
    def looks(r: dict[str, Any]) -> str:
        per_look = r.get("contenders_per_look", [])
        return f"; contenders per look {'/'.join(map(str, per_look))}" if len(per_look) > 1 else ""
    cells = [f"{name} {r['rounds']} ({why.get(r['stopped'], r['stopped'])}, {r['seconds']:.0f} s{looks(r)})"
             for name, r in records.items()]
    return ["Rounds per measure (a contender whose ratios are settled is not measured in later looks; each ratio "
            "gives its own rounds): " + "; ".join(cells) + ".", ""]


def sample_lines(artifacts_: list[dict[str, Any]]) -> list[str]:
    """Each artifact's greedy text and its seeded sample, side by side (greedy decoding loops at this scale:
    the share of its 8-token windows that repeat says how much)."""
    first = next((r["generation"] for r in artifacts_ if "sampled_text" in r.get("generation", {})), None)
    if first is None:
        return []
    lines = ["Samples (prompt " + repr(first["prompt"]) + f"; sampled: {first['sampling']}):", "",
             "| artifact | greedy | repeated 8-grams | sampled |", "|---|---|---|---|"]
    cell = lambda t: t.replace("\n", "⏎")[:300].replace("|", "\\|")  # noqa: E731  (line breaks shown)
    for r in artifacts_:
        g = r["generation"]
        if "sampled_text" in g:
            lines.append(f"| {r['tag']} | {cell(g['text'])} | {g['greedy_repeated_fraction']:.0%} | "
                         f"{cell(g['sampled_text'])} |")
    return [*lines, ""]


# ------------------------------------------------------------------------------------- the stage in `effkit run`
BENCH_ARTIFACT_ROUND = 10.0  # per artifact per bench round: prefill b1/b12, decode b1/b12 (training steps, 128 tokens)
BENCH_ARTIFACT = 16.0  # per artifact: loading, its held-out loss, a sample, its memory (training steps)
BENCH_MEASURES = 6  # prefill b1/b12, decode b1/b12, training b4/b12


LOSSLESS = 0.002  # a loss within +0.2% of the reference (the interval's upper end) counts as no loss


def deliverable(plan: Plan, bench: dict[str, Any]) -> dict[str, Any]:
    """The artifact to ship, by the decision rule (`effkit.measure.choice.decide`) over the bench's own rounds at
    the recipe's workload (`optimize_for`): among the benched artifacts (peers excluded: they are what a user has
    without effkit) whose held-out loss is within `max_loss_increase` of the dense reference's (the upper end of
    the paired interval), the leader by paired point estimate, decided against each of the others, or tied within
    the precision (then the smallest), or still undecided (then labelled a point estimate). Beside it: the best
    lossless artifact (within +0.2%) by the same rule, each one's standing against every peer at that workload
    (a peer that beats it is named), and, for a pruned artifact, its dense control's attribution."""
    from effkit.artifacts.loader import load_command
    from effkit.measure import choice

    budget, chosen = plan.run.pipeline.max_loss_increase, workloads.get(plan.run.pipeline.optimize_for)
    rows = {r["tag"]: r for r in bench["artifacts"]}
    ours = [r for r in bench["artifacts"] if r["stage"] != "peer"]
    ref = ours[0]
    losses, docs = bench["block_losses"], bench.get("block_docs")
    samples, record = bench["samples"][chosen.measure], bench["stopping"][chosen.measure]
    level, precision = record["level"], record.get("precision", plan.bench.measure.precision)

    def pick(limit: float, with_ref: bool) -> choice.Choice | None:
        members = [r["tag"] for r in ours if not r.get("invalid") and r["tag"] in samples and (
            (r is ref and with_ref) or (r is not ref and within_budget(losses[ref["tag"]], losses[r["tag"]], docs,
                                                                       limit)))]
        if not members:
            return None
        return choice.decide({t: samples[t] for t in members}, chosen.higher_is_better, level, precision,
                             prefer=lambda t: (rows[t]["size_ratio"], members.index(t)))

    picked, lossless = pick(budget, True), pick(LOSSLESS, False)
    best = rows[picked.picked]
    path = Path(best["artifact"])
    loss = "ref" if best is ref else stats.fmt_delta(best[results.EVAL_LOSS_DELTA]) + f" vs {ref['tag']}"
    if best.get(results.EVAL_LOSS_DELTA_VS_CONTROL):
        loss += (f" ({stats.fmt_delta(best[results.EVAL_LOSS_DELTA_VS_CONTROL])} of it against its dense control, "
                 "the dense model fine-tuned the same way: the rest is what that fine-tuning did)")
    shown = peer_workloads()
    cols = ", ".join(f"{w.name} " + ("1.00x (reference)" if best is ref else stats.fmt_ratio(best[w.ratio]))
                     for w in shown if best is ref or w.ratio in best)
    peers = best.get("vs_peers", {})
    vs_peers = "; ".join(f"vs {p}: " + ", ".join(f"{w} {stats.fmt_ratio(r[w])}" for w in r) for p, r in peers.items())
    judged = {"delivered": best["tag"], "lossless": lossless.picked if lossless else None}
    beaten = {name: beaten_by(rows[tag], chosen) for name, tag in judged.items() if tag}
    warn = "; ".join(f"the {name} artifact {judged[name]} is slower at {chosen.name} than "
                     + ", ".join(f"{p} ({stats.fmt_ratio(r)})" for p, r in by.items())
                     for name, by in beaten.items() if by)
    line = (f"deliver {best['tag']} (chosen for {chosen.name}: {picked.label}): {cols}; "
            f"size {best['size_ratio']:.2f}x, loss {loss}" + (f"; {vs_peers}" if vs_peers else "")
            + (f"; NOTE: {warn}" if warn else "")
            + f"; load it: {load_command(path)}, or effkit generate --from {path}")
    return {"tag": best["tag"], "artifact": str(path), "line": line, "budget": budget, "optimize_for": chosen.name,
            "verdict": picked.label, "choice": picked.to_dict(),
            "lossless": {"tag": lossless.picked, "verdict": lossless.label, "choice": lossless.to_dict(),
                         "limit": LOSSLESS} if lossless else None,
            "beaten_by_peers": beaten,
            "vs_peers": {p: r[chosen.key] for p, r in peers.items() if chosen.key in r},
            "how": f"benched artifacts (not the peer rows) whose held-out loss is at most {budget:.1%} above "
                   f"{ref['tag']}'s (upper end of the paired interval), and {ref['tag']} itself; at {chosen.name}, "
                   "over the bench's own rounds: the leader by paired point estimate, decided against each of the "
                   f"others, or tied within +-{precision:.0%} (then the smallest), or undecided (labelled a point "
                   f"estimate); the lossless one the same way among those within +{LOSSLESS:.1%}"}


def beaten_by(row: dict[str, Any], w: workloads.Workload) -> dict[str, dict[str, Any]]:
    """The peers that are decided faster than the artifact of `row` at `w` (its paired ratio to each)."""
    return {p: r[w.key] for p, r in row.get("vs_peers", {}).items()
            if w.key in r and results.PairedRatio.of(r[w.key]).verdict == "slower"}


def other_rounds(plan: Plan) -> dict[str, str]:
    """The pruning rounds a user would not choose between: every round but the one of each mode a user would look
    at (`best_of_each_mode`; the prune stage timed and judged them all against the dense model and their controls),
    each with where its figures are."""
    keep = set(best_of_each_mode(plan).values())
    return {r["tag"]: f"not its mode's most compressed round within the budget; its figures (loss, latency, "
                      f"against its dense control) are in {plan.report_dir / ('prune-' + r['label'] + '.json')}"
            for r in pruning_rounds(plan) if r["tag"] not in keep}


class BenchStep(Step):
    key = "bench"

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str:
        return fingerprint("bench", plan.bench.to_dict(), sorted(before.values()))

    def outputs(self, ctx: RunContext) -> list[Path]:
        return [ctx.plan.report_dir / "bench.json"]

    def recorded_outputs(self, ctx: RunContext) -> list[Path]:
        return []

    def complete(self, ctx: RunContext) -> bool:
        plan = ctx.plan
        bench = plan.report_dir / "bench.json"
        if not bench.is_file() or not plan.run_dir.is_dir():
            return False
        newest = max(((d / artifacts.META).stat().st_mtime for d in plan.run_dir.iterdir()
                      if (d / artifacts.META).is_file()), default=0.0)
        return bench.stat().st_mtime >= newest

    def run(self, ctx: RunContext) -> None:
        pipeline = ctx.plan.run.pipeline
        ctx.results["bench"] = run_bench(ctx.plan.bench, deliver=(pipeline.optimize_for, pipeline.max_loss_increase),
                                         elsewhere=other_rounds(ctx.plan))
        self.deliver(ctx)

    def reuse(self, ctx: RunContext) -> None:
        ctx.results["bench"] = json.loads((ctx.plan.report_dir / "bench.json").read_text())
        self.deliver(ctx)

    def deliver(self, ctx: RunContext) -> None:
        ship = deliverable(ctx.plan, ctx.results["bench"])
        if choice := ctx.results.get("best-pruned"):
            ship["best_pruned"] = choice[1]
        ctx.results["deliverable"] = ship
        atomic_write_text(ctx.plan.report_dir / "deliverable.json", json.dumps(ship, indent=2))

    def work(self, plan: Plan) -> float:
        st = plan.stages
        n = 1 + (len(plan.prune) if "prune" in st else 0)  # the round of each mode a user would look at
        n += len(plan.run.pipeline.quantize_from) if "quantize" in st else 0
        b = plan.bench
        n += len(engines.peers(b.peer_engine_names)) if b.what.peers else 0
        ms = b.measure
        return n * (ms.rounds * BENCH_ARTIFACT_ROUND * ms.gen_tokens / 128 * ms.repeats / 3 + BENCH_ARTIFACT)

    def budget(self, plan: Plan) -> float:
        ms = plan.bench.measure
        return 0.0 if ms.fixed_rounds else ms.budget_s * BENCH_MEASURES

    def describe(self, plan: Plan) -> dict[str, Any]:
        return {"stage": "bench", "what": "every artifact of the run, one protocol: "
                + ", ".join(w.label for w in workloads.all_())
                + f"{', with the peer engines' if plan.bench.what.peers else ''}; the artifact to ship chosen for "
                  f"{plan.run.pipeline.optimize_for}", "leaves": str(plan.report_dir / "bench.json")}


class BenchStage(Stage):
    name = "bench"

    def configure(self, plan: Plan) -> None:
        f = plan.run.folders
        # `effkit run` measures the engines a user would pick instead unless told not: peers on by default, before
        # validation, so a recipe's peer_engines with peers unset is valid here
        plan.configs["bench"] = build_config(BenchConfig, plan.recipe, {"run": plan.run.pipeline.run_name,
                                                                        "runs_dir": f.runs_dir,
                                                                        "reports_dir": f.reports_dir},
                                             defaults={"peers": True})

    def steps(self, plan: Plan) -> list[Step]:
        return [BenchStep()]

    def fingerprints(self, plan: Plan, before: dict[str, str]) -> dict[str, str]:
        return {"bench": BenchStep().fingerprint(plan, before)}


STAGE = BenchStage()
