"""`effkit bench` and the `bench` stage of `effkit run`: `run_bench` finds the artifacts (and makes the peers),
measures each alone in a fresh process (`effkit.bench.static`), times them side by side (`effkit.bench.timing`),
makes the rows (`effkit.bench.rows`) and the report with its protocol, and writes bench.json / bench.csv /
bench.md / leaderboard.json (`effkit.bench.render`); `BenchStep` runs it in `effkit run` and writes the
deliverable (`effkit.bench.deliverable`)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

import effkit.bench.speculative as speculative
from effkit import artifacts, engines, stageplan, workloads
from effkit.artifacts.loader import cannot_run_on
from effkit.bench.deliverable import deliverable
from effkit.bench.discover import make_peers, tags
from effkit.bench.plan import TOP, benched, plan_and_processes
from effkit.bench.render import verdicts, write_reports
from effkit.bench.rows import combine
from effkit.bench.static import bench_all_isolated
from effkit.bench.timing import TRAIN_BATCHES, contest_of, ties_of, timed_side_by_side
from effkit.config import BenchConfig, DataConfig, build_config
from effkit.data import prepare
from effkit.measure import evaluation, generation, hardware, memory, stats, stopping
from effkit.measure.timing import INTERLEAVED_PROTOCOL
from effkit.parallel import resolve_device
from effkit.report import atomic_write_text
from effkit.stage import (
    Plan,
    RunContext,
    ShapeRun,
    Stage,
    Step,
    best_of_each_mode,
    by_share,
    costs,
    fingerprint,
    left_out_why,
    pruning_rounds,
)

# the fewest rounds of the first look a time budget leaves the bench (`--quick`'s)
FEWEST_ROUNDS = 3
FEWEST_PEERS = 2  # a time budget leaves the bench at least this many peers (`peers_at_share`)


def run_bench(cfg: BenchConfig, progress: bool = True, deliver: tuple[str, float] | None = None,
              elsewhere: dict[str, str] | None = None) -> dict[str, Any]:
    """Bench every artifact of the run (and the peers); `deliver`: (workload, loss budget) of the deliverable to
    be chosen from this bench (`effkit run`): the artifacts within the budget are timed until the leader among
    them stands decided or tied against each of the others (see `deliverable`). `elsewhere`: artifacts of the run
    left out, each with where its figures are."""
    cfg = cfg.validate()
    device = resolve_device(cfg.what.device)
    run_name, paths, not_run = benched(cfg, device, elsewhere)
    plan, processes = plan_and_processes(cfg, elsewhere)  # before any model is loaded: one that does not fit stops
    stageplan.check(plan, cfg.what.force)  # here, unless --force
    run_dir = Path(cfg.folders.runs_dir) / run_name
    with artifacts.run_lock(run_dir), memory.PeakMemory(device) as mem:
        memory_of = partial(_memory, plan, processes, mem)
        paths, made_not = speculative.add(cfg, run_dir, paths, cfg.measure.gen_tokens)
        not_run = {**not_run, **made_not}
        if not cfg.what.peers:
            return _bench(cfg, device, run_name, paths, progress, not_run, deliver, processes, memory_of)
        # the peers live as long as this bench; removed below, or by the next run lock if the process is killed
        scratch = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tmp-peers-"))
        try:
            kept, left_out = peers_at_share(cfg)
            peers, peers_not_run = make_peers(paths[0], scratch, kept)
            peers_not_run |= left_out
            peers_not_run |= {p.name: f"not run: {reason}" for p in peers if (reason := cannot_run_on(p, device))}
            peers = [p for p in peers if p.name not in peers_not_run]
            return _bench(cfg, device, run_name, paths + peers, progress, {**not_run, **peers_not_run}, deliver,
                          processes, memory_of)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def peers_at_share(cfg: BenchConfig) -> tuple[list[str], dict[str, str]]:
    """The peer engines a bench on `what.peer_share` of its time budget makes (`by_share`: at least `FEWEST_PEERS`,
    those measured fastest before), and each peer left out, by tag, with why."""
    tag = {e.name: e.peer_tag for e in engines.peers(cfg.peer_engine_names)}
    speed, share = costs()["speed"]["peers"], cfg.what.peer_share
    kept, left = by_share(list(tag), share, FEWEST_PEERS, speed)
    return kept, {tag[n]: left_out_why(share, speed, n) for n in left}


def _memory(plan: stageplan.StagePlan, processes: dict[str, int], mem: memory.PeakMemory,
            static: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's `memory`: the plan made before the bench beside the peaks it measured, the top process's (so
    far) and each alone process's, each process beside its prediction."""
    measured = mem.record()
    return {"plan": plan.to_dict(), **measured, "measured_how": f"the top process: {measured['measured_how']}",
            "top_process_predicted_bytes": processes[TOP],
            "alone_processes": {r["tag"]: {"predicted_bytes": processes.get(Path(r["artifact"]).name),
                                           "measured_absolute_bytes": r.get("peak_memory_absolute_bytes")}
                                for r in static}}


def _measure(cfg: BenchConfig, device: torch.device, paths: list[Path], data: dict[str, Any], prepared,
             block: int, progress: bool, deliver: tuple[str, float] | None,
             processes: dict[str, int] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(each artifact alone, in a fresh process; all of them timed side by side), with a progress bar or not.
    `processes`: each alone process as the memory plan predicts it, by folder name (how many run at once)."""
    predicted = [processes[p.name] for p in paths] if processes and all(p.name in processes for p in paths) else None
    if not progress:
        static = bench_all_isolated(paths, cfg, data, paths[0], device, process_bytes=predicted)
        return static, timed_side_by_side(paths, cfg, prepared.tokenizer, block, device,
                                          contest_of(static, paths, deliver), ties_of(static))
    from rich.progress import Progress

    with Progress() as bar:
        task = bar.add_task(f"bench: {len(paths)} artifacts alone (loss, memory)", total=len(paths) + 1)
        static = bench_all_isolated(paths, cfg, data, paths[0], device, done=lambda p: bar.advance(task),
                                    process_bytes=predicted)
        bar.update(task, description=f"bench: timing {len(paths)} artifacts side by side")
        timed = timed_side_by_side(paths, cfg, prepared.tokenizer, block, device, contest_of(static, paths, deliver),
                                   ties_of(static))
        bar.advance(task)
    return static, timed


def _bench(cfg: BenchConfig, device: torch.device, run_name: str, paths: list[Path],
           progress: bool, not_run: dict[str, str] | None = None,
           deliver: tuple[str, float] | None = None, processes: dict[str, int] | None = None,
           memory_of: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> dict[str, Any]:
    # every artifact is evaluated on the first one's held-out blocks
    data = artifacts.data_section(paths[0], cfg.what.data)
    data_cfg = DataConfig.from_dict(data)
    prepared = prepare(data_cfg, tokenizer_from=str(paths[0]))  # builds the caches once
    block = data_cfg.block_size
    t0 = time.perf_counter()
    static, timed = _measure(cfg, device, paths, data, prepared, block, progress, deliver, processes)
    for row, tag in zip(static, tags(paths), strict=True):
        row["tag"] = tag
    rows = combine(static, timed)
    speculative.annotate(rows)
    report = {
        "stage": "bench", "run": run_name, "config": cfg.to_dict(), "artifacts": rows, "reference": rows[0]["tag"],
        "device": hardware.describe_device(device), "versions": artifacts.versions(),
        "git_commit": artifacts.git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.perf_counter() - t0,
        "verdicts": verdicts(rows), "not_run": not_run or {}, "stopping": timed["stopping"],
        # every timing of every round, per measure and contender: every ratio above can be recomputed from these
        "samples": {m: dict(timed[m]) for m in timed["stopping"]},
        # the deliverable's decision in its own rounds among its contenders, every sample kept
        **({"deliverable_rounds": timed["decision"]} if "decision" in timed else {}),
        # each artifact's held-out loss per block, and each block's document: every loss delta can be recomputed
        "block_losses": {r["tag"]: r["block_losses"] for r in static},
        "block_docs": static[0]["block_docs"],
        "protocol": protocol(cfg, device, paths[0], prepared, block, rows[0]["tag"], timed["new_tokens"],
                             timed["prompts"]),
        # the decode workloads' prompts: how many, how long, where from (or why the fixed prompt instead)
        "prompts": timed["prompts"],
        # the plan made before the stage, beside the peaks it measured (the top process's, each alone process's)
        "memory": memory_of(static) if memory_of else None,
    }
    write_reports(Path(cfg.folders.reports_dir) / run_name, report)
    return report


def prompts_protocol(prompts: dict[str, Any]) -> str:
    """Which prompts the decode workloads time, in words (`generation.reference_prompts`' record, bench.json's
    `prompts`)."""
    decode = workloads.of_kind("decode")
    fixed = [w for w in decode if w.name not in prompts.get("workloads", ())]
    batches = [str(b) for b in sorted({w.batch for w in fixed})]
    copies = " and ".join([", ".join(batches[:-1]), batches[-1]] if len(batches) > 1 else batches)
    n, said = prompts["count"], []
    if n:
        said.append(f"from {n} prompts of {prompts['tokens']} tokens cut from {prompts['from']}, the same for every "
                    f"artifact and peer: round r times prompt r mod {n} (at batch b, prompts r..r+b-1 mod {n}), so "
                    f"that every contender decodes the same prompts in each round, the paired ratio cancels each "
                    f"prompt's own speed, and the rounds cover the set")
    if fixed:
        said.append(f"{'; ' + ', '.join(w.name for w in fixed) + ': ' if n else ''}from {copies} copies of the "
                    f"prompt {generation.GENERATION_PROMPT!r}"
                    + (f" (no held-out prompts: {prompts['fallback']})" if "fallback" in prompts else ""))
    return "".join(said)


def protocol(cfg: BenchConfig, device: torch.device, first: Path, prepared, block: int, reference: str,
             new_tokens: int, prompts: dict[str, Any]) -> dict[str, str]:
    """How each figure of the report was measured, in words (bench.md's `How measured`)."""
    interleave = INTERLEAVED_PROTOCOL.format(warmup=2, rounds=stopping.Stopping.of(cfg.measure).describe(),
                                             repeats="{repeats}")
    return {
        "eval_loss": evaluation.EVAL_PROTOCOL + f"; the blocks of {first.name}'s data "
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
                      "graph; older ONNX artifacts without past recompute the prefix, see the notes) "
                      f"{prompts_protocol(prompts)}, {new_tokens} new tokens per row (capped by the "
                      "smallest context when needed), new tokens of all rows / wall time (prefill included); "
                      + interleave.format(repeats=1) + "; the b1 decode is also reported as `generation`",
        "training_throughput": (f"one forward+backward+AdamW step on a private copy, batch x {block} tokens, "
                                "tokens / wall time; " + interleave.format(repeats=cfg.measure.train_steps)
                                if cfg.measure.train_steps else "not measured (--train-steps 0)"),
        "peak_memory": memory.PeakMemory(device).method + ", while loading the artifact, evaluating it and "
                       "running each timed workload once, each artifact in a fresh process (two at a time on a "
                       "CPU where memory allows: each process's high-water mark is its own, and nothing there is "
                       "timed)",
        "reference": f"ratios and deltas are relative to the first artifact ({reference}); a ratio between two "
                     "artifacts whose engines run the very same computation (the same digest of the graph or "
                     "model and its compute type) is a tie by construction: reported, but no round is run to "
                     "settle it",
    }


# ------------------------------------------------------------------------------------- the stage in `effkit run`
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
        n += len(peers_at_share(b)[0]) if b.what.peers else 0
        spec = speculative.runs(b)  # one more artifact in the rounds, and its k chosen before them
        ms, w = b.measure, costs()["bench"]
        return (n + spec) * (ms.rounds * w["artifact_round"] * ms.gen_tokens / 128 * ms.repeats / 3 + w["artifact"]) \
            + spec * speculative.cost()["choose_k"] * ms.gen_tokens / 128

    def budget(self, plan: Plan) -> float:
        """The measures' time budgets: one per workload and per training batch (none with fixed rounds)."""
        ms = plan.bench.measure
        return 0.0 if ms.fixed_rounds else ms.budget_s * (len(workloads.all_()) + len(TRAIN_BATCHES))

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
                                             defaults={"peers": True, "speculative": True})

    def steps(self, plan: Plan) -> list[Step]:
        return [BenchStep()]

    def memory_plans(self, plan: Plan, shapes: ShapeRun) -> list[tuple[str, str, Any]]:
        """The plan (`effkit bench --plan`) of every artifact the stages before it would leave, as shapes: the
        dense model and each prune mode's first round (the run's int8 artifacts are not known before the run:
        the notes say so)."""
        from effkit.bench.plan import bench_plan

        if self.name not in plan.stages or not shapes.artifacts:
            return []
        b = plan.bench
        b = b.replace(paths=tuple(str(p) for p in shapes.artifacts.values()), **shapes.folders.to_dict()).validate()
        if "quantize" in plan.stages:
            shapes.notes.append("the bench planned without the run's int8 artifacts (each a quarter of its parent's "
                                "fp32 bytes or less), which do not exist before the run")
        return [("bench", f"{len(shapes.artifacts)} artifact(s)" + (", the peers" if b.what.peers else ""),
                 bench_plan(b))]

    def with_share(self, plan: Plan, share: float) -> dict[str, Any]:
        """The rounds of its first look (at least `FEWEST_ROUNDS`, never more than the recipe's), the time budget
        of each measure's later looks, and the peers (`peers_at_share`: the rest listed as not run), by `share`:
        every artifact of the run is still timed."""
        ms = plan.bench.measure
        rounds = min(ms.rounds, max(FEWEST_ROUNDS, round(ms.rounds * share)))
        plan.configs["bench"] = plan.bench.replace(rounds=rounds, budget_s=ms.budget_s * share, peer_share=share)
        got = {"rounds": rounds, "budget_s": plan.bench.measure.budget_s}
        if plan.bench.what.peers:
            kept, left = peers_at_share(plan.bench)
            got.update(peers=kept, not_run=left)
        if plan.bench.what.speculative:
            got["speculative"] = speculative.left_out(plan.bench) or "made and benched"
        return got

    def fingerprints(self, plan: Plan, before: dict[str, str]) -> dict[str, str]:
        return {"bench": BenchStep().fingerprint(plan, before)}


STAGE = BenchStage()
