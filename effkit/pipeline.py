"""`effkit run`: the whole pipeline from one recipe (train -> prune -> quantize -> bench -> report), resumable.

A stage is complete when its artifact folder exists (folders appear by an atomic rename, so existing means
complete) and the fingerprint it ran with (its recipe section and its parents' fingerprints, in
`runs/<run>/pipeline.json`) matches the recipe's now: complete stages are skipped; a stage whose recipe section
or parent changed runs again, with every stage after it, and says so; an interrupted stage starts again from
scratch (training resumes from its checkpoint when that was made by the same recipe); `--force` redoes
everything.

`quantize_from` lists what is quantized: `train`, a pruning round, or `best-pruned` (the most compressed round
within `max_loss_increase` of `train`), so a run delivers the composed model, pruned and int8. The run
ends with one line: the fastest artifact within the loss budget, how it compares, and how to load it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from effkit import artifacts
from effkit.artifacts import RunLayout, prune_tag
from effkit.artifacts.loader import load_command
from effkit.bench import PEERS as PEER_TAGS
from effkit.bench import run_bench
from effkit.checkpoint import Checkpointer
from effkit.child import Job
from effkit.config import (
    WORKLOADS,
    BenchConfig,
    PruneConfig,
    QuantizeConfig,
    RunConfig,
    TrainConfig,
    build_config,
    load_recipe,
)
from effkit.errors import EffkitError
from effkit.measure import results, stats
from effkit.measure.results import LossDelta, PairedRatio
from effkit.memplan import predict_quietly
from effkit.parallel.launch import launch_command, nproc_per_node
from effkit.prune.stage import run_prune
from effkit.quantize.stage import run_quantize
from effkit.report import render_run_report
from effkit.train import train_any


@dataclasses.dataclass
class Plan:
    recipe: str
    run: RunConfig
    train: TrainConfig
    prune: dict[str, PruneConfig]
    quantize: QuantizeConfig
    bench: BenchConfig

    @property
    def layout(self) -> RunLayout:
        return RunLayout.of(self.run.folders.runs_dir, self.run.folders.reports_dir, self.run.pipeline.run_name)

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    @property
    def report_dir(self) -> Path:
        return self.layout.report_dir


def make_plan(recipe: str) -> Plan:
    """Read and validate the whole recipe before anything runs."""
    load_recipe(recipe)
    run = build_config(RunConfig, recipe, {})
    dirs = {"runs_dir": run.folders.runs_dir, "reports_dir": run.folders.reports_dir}
    train = build_config(TrainConfig, recipe, {"run_name": run.pipeline.run_name, **dirs})
    layout = RunLayout.of(run.folders.runs_dir, run.folders.reports_dir, run.pipeline.run_name)
    dense = str(layout.artifact("train"))
    prune = {m: build_config(PruneConfig, recipe, {"mode": m, "source": dense, **dirs})
             for m in run.pipeline.prune_modes}
    if "prune" in run.pipeline.stages and not prune:
        raise EffkitError(f"recipe {recipe}: [run] lists the prune stage but prune_modes is empty")
    # auto picks its backend for the workload the deliverable is chosen for
    quantize = build_config(QuantizeConfig, recipe,
                            {"source": dense, "optimize_for": run.pipeline.optimize_for, **dirs})
    bench = build_config(BenchConfig, recipe, {"run": run.pipeline.run_name, **dirs})
    if bench.what.peers is None:  # `effkit run` measures the engines a user would pick instead, unless told not to
        bench = bench.replace(peers=True)
    valid_tags = {"train"} | {prune_tag(c.label, r) for c in prune.values() for r in range(1, c.method.rounds + 1)}
    for wanted in run.pipeline.quantize_from if "quantize" in run.pipeline.stages else []:
        if wanted not in valid_tags | ({BEST_PRUNED} if prune and "prune" in run.pipeline.stages else set()):
            raise EffkitError(f"recipe {recipe}: [run] quantize_from = {wanted!r} is not an artifact this recipe "
                              f"makes; choose among {', '.join(sorted(valid_tags))}"
                              + (f", {BEST_PRUNED}" if prune and "prune" in run.pipeline.stages else ""))
    return Plan(recipe, run, train, prune, quantize, bench)


def _complete(path: Path) -> bool:
    return (path / artifacts.META).is_file()


def _prune_done(plan: Plan, mode: str) -> bool:
    cfg = plan.prune[mode]
    return (plan.report_dir / f"prune-{cfg.label}.json").is_file() and _complete(
        plan.layout.artifact(prune_tag(cfg.label, cfg.method.rounds)))


def _quantize_done(plan: Plan, source: Path) -> Path | None:
    if not plan.run_dir.is_dir():
        return None
    for d in plan.run_dir.glob("*quantize-*"):
        if _complete(d) and artifacts.read_meta(d).get("parent") == str(source):
            return d
    return None


BEST_PRUNED = "best-pruned"


# ------------------------------------------------------------------------------------------ what is stale
RECORD = "pipeline.json"  # in the run folder: each stage's fingerprint and the folders it left


def quantize_key(plan: Plan, wanted: str) -> str:
    """How the run names the quantize stage of `wanted` (plain `quantize` when only the dense model is)."""
    return f"quantize {wanted}" if plan.run.pipeline.quantize_from != ["train"] else "quantize"


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprints(plan: Plan) -> dict[str, str]:
    """Each stage's fingerprint: its recipe section (as resolved, flags included) and its parents' fingerprints,
    so that a change reaches every stage downstream. Keyed by the stage names the run prints."""
    st, fp = plan.run.pipeline.stages, {}
    t = plan.train.to_dict()
    t["run"].pop("resume", None)  # how training is continued, not what it makes
    fp["train"] = _hash("train", t)
    for mode, c in plan.prune.items():
        fp[f"prune {mode}"] = _hash("prune", c.to_dict(), fp["train"])
    pruned = [fp[f"prune {m}"] for m in plan.prune] if "prune" in st else []
    q = {k: v for k, v in plan.quantize.to_dict().items() if k != "source"}
    for wanted in plan.run.pipeline.quantize_from if "quantize" in st else []:
        branch = artifacts.prune_branch(wanted)
        parents = ([fp["train"]] if wanted == "train" else [*pruned, plan.run.pipeline.max_loss_increase]
                   if wanted == BEST_PRUNED else [fp[f"prune {m}"] for m, c in plan.prune.items()
                                                  if branch == f"prune-{c.label}"])
        fp[quantize_key(plan, wanted)] = _hash("quantize", q, parents)
    fp["bench"] = _hash("bench", plan.bench.to_dict(), sorted(fp.values()))
    return fp


class StageRecord:
    """`runs/<run>/pipeline.json`: the fingerprint each stage ran with and the folders it left. A complete stage
    is reused only when its fingerprint matches the recipe's now; otherwise its folders are removed (they lie
    inside the run folder, which effkit owns) and it runs again."""

    def __init__(self, plan: Plan, console: Console):
        self.plan, self.console = plan, console
        self.path = plan.run_dir / RECORD
        self.now = fingerprints(plan)
        try:
            self.stages: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (json.JSONDecodeError, OSError):
            self.stages = {}

    def fresh(self, name: str) -> bool:
        return self.stages.get(name, {}).get("fingerprint") == self.now[name]

    def stale(self, name: str, also: tuple[Path, ...] = ()) -> bool:
        """Whether the stage must run (its fingerprint is not the recipe's now). What it left under another
        fingerprint (the recorded folders, and `also`: what the record may not name, e.g. from an older effkit or
        an interrupted run) is removed, in one line that says why; nothing is said when nothing is there."""
        if self.fresh(name):
            return False
        old = self.stages.pop(name, None)
        owned = [self.plan.run_dir.resolve(), self.plan.report_dir.resolve()]
        left = {f for f in (Path(x).resolve() for x in [*(old or {}).get("outputs", []), *also])
                if f.exists() and any(f.is_relative_to(d) and f != d for d in owned)}  # only this run's folders
        if left:
            why = ("no fingerprint recorded for what it left (interrupted, made by an older effkit, or outside "
                   "`effkit run`)" if old is None else "its recipe section or a stage before it changed since it ran")
            self.console.print(f"[yellow]{name}[/yellow]: {why}: running it again")
            for f in left:
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        self.save()
        return True

    def done(self, name: str, outputs: list[Path]) -> None:
        self.stages[name] = {"fingerprint": self.now[name], "outputs": [str(o) for o in outputs]}
        self.save()

    def save(self) -> None:
        if self.plan.run_dir.is_dir():
            artifacts.atomic_write_text(self.path, json.dumps(self.stages, indent=2))


def best_pruned(plan: Plan) -> tuple[Path | None, dict[str, Any]]:
    """The most compressed pruning round (smallest artifact folder: parameters really removed; then the lowest
    batch-12 latency) whose held-out loss is within `max_loss_increase` of the dense model it was pruned from
    (`train`: the model the user has), with its dense control's share beside it, and the table it was chosen
    from."""
    budget = plan.run.pipeline.max_loss_increase
    rows = []
    for cfg in plan.prune.values():
        for r in range(1, cfg.method.rounds + 1):
            d = plan.layout.artifact(prune_tag(cfg.label, r))
            if not _complete(d):
                continue
            m = artifacts.read_meta(d)["metrics"]
            delta = LossDelta.of(m[results.EVAL_LOSS_DELTA_VS_DENSE])
            control = m.get(results.EVAL_LOSS_DELTA_VS_CONTROL)
            rows.append({"tag": d.name, "size_bytes": artifacts.dir_size(d), "loss_delta": delta.delta,
                         "loss_delta_ci95": list(delta.ci95), "vs": "dense parent",
                         "loss_delta_vs_control": LossDelta.of(control).delta if control else None,
                         "latency_b12_s": m["latency_b12"]["p50_s"], "within_budget": delta.delta <= budget})
    within = [r for r in rows if r["within_budget"]]
    best = min(within, key=lambda r: (r["size_bytes"], r["latency_b12_s"])) if within else None
    return (plan.layout.artifact(best["tag"]) if best else None), {
        "picked": best["tag"] if best else None, "budget": budget, "rounds": rows,
        "how": f"pruning rounds whose held-out loss is at most {budget:.1%} above the dense model they were pruned "
               "from (relative, point estimate of the paired delta; the control's share, what the fine-tuning alone "
               "did, is beside it); among them the smallest folder, then the lowest latency b12"}


def deliverable(plan: Plan, bench: dict[str, Any]) -> dict[str, Any]:
    """The artifact to ship: among the benched artifacts (peers excluded: they are what a user has without effkit)
    whose held-out loss is within `max_loss_increase` of the dense reference's (the model the user has; paired
    point estimate), the best at the recipe's workload (`optimize_for`: decode tokens/s at batch 1 or 12, or
    prefill latency at batch 12), then the smallest; with the line that says so, its standing against the fastest
    peer at that workload, and, for a pruned artifact, its dense control's attribution."""
    budget, workload = plan.run.pipeline.max_loss_increase, plan.run.pipeline.optimize_for
    key, higher = WORKLOADS[workload]
    rows = [r for r in bench["artifacts"] if r["stage"] != "peer"]
    ref = rows[0]
    within = [r for r in rows if r is ref or LossDelta.of(r[results.EVAL_LOSS_DELTA]).delta <= budget]
    speed = lambda r: 1.0 if r is ref else PairedRatio.of(r[key]).ratio  # noqa: E731 - vs the reference, paired
    best = max(within, key=lambda r: (speed(r) if higher else -speed(r), -r["size_ratio"]))
    path = Path(best["artifact"])
    loss = "ref" if best is ref else stats.fmt_delta(best[results.EVAL_LOSS_DELTA]) + f" vs {ref['tag']}"
    if best.get(results.EVAL_LOSS_DELTA_VS_CONTROL):
        loss += (f" ({stats.fmt_delta(best[results.EVAL_LOSS_DELTA_VS_CONTROL])} of it against its dense control, "
                 "the dense model fine-tuned the same way: the rest is what that fine-tuning did)")
    cols = ", ".join(f"{w} " + ("1.00x (reference)" if best is ref else stats.fmt_ratio(best[k]))
                     for w, (k, _) in WORKLOADS.items())
    peers = best.get("vs_peers", {})
    peer_key = workload.replace("-", "_")  # bench.PEER_WORKLOADS names them decode_b1, decode_b12, prefill_b12
    vs_peers = "; ".join(f"vs {p}: " + ", ".join(f"{w} {stats.fmt_ratio(r[w])}" for w in r) for p, r in peers.items())
    line = (f"deliver {best['tag']} (chosen for {workload}): {cols}; size {best['size_ratio']:.2f}x, loss {loss}"
            + (f"; {vs_peers}" if vs_peers else "") + f"; load it: {load_command(path)}, or effkit generate --from "
            f"{path}")
    return {"tag": best["tag"], "artifact": str(path), "line": line, "budget": budget, "optimize_for": workload,
            "vs_peers": {p: r[peer_key] for p, r in peers.items()},
            "how": f"benched artifacts (not the peer rows) whose held-out loss is at most {budget:.1%} above "
                   f"{ref['tag']}'s (paired point estimate); the best paired ratio to {ref['tag']} at {workload}, "
                   "then the smallest size"}


def _bench_done(plan: Plan) -> bool:
    bench = plan.report_dir / "bench.json"
    if not bench.is_file():
        return False
    newest = max((d / artifacts.META).stat().st_mtime for d in plan.run_dir.iterdir() if _complete(d))
    return bench.stat().st_mtime >= newest


def describe(plan: Plan) -> list[dict[str, Any]]:
    """The stages, what each does, and what it leaves: printed by `--dry-run`."""
    rows = []
    st = plan.run.pipeline.stages
    if "train" in st:
        t = plan.train
        what = (f"{t.model.name} on {t.data.source}, {t.optim.max_steps} steps, batch {t.optim.batch_size} x "
                f"{t.data.block_size}, parallel {t.parallel.mode}, "
                f"amp {'auto (measured)' if t.optim.amp is None else t.optim.amp_dtype if t.optim.amp else 'off'}")
        mem = predict_quietly(t)
        if mem is not None:
            fits = {True: "fits", False: "does NOT fit", None: "fit unknown"}[mem["fits"]]
            what += (f"; memory plan: {mem['total_bytes'] / 2**20:,.0f} MiB per rank at the peak, {fits} in "
                     f"{mem['device']}" + (f" ({mem['device_bytes'] / 2**20:,.0f} MiB)" if mem["device_bytes"] else ""))
        entry = {"stage": "train", "what": what, "leaves": str(plan.layout.artifact("train"))}
        if t.parallel.launched:
            p = t.parallel.replace(nproc=nproc_per_node(t.parallel))  # as resolved on this machine
            cmd, env = launch_command(p, Job(Path("<tmp>/job")))
            cpu = " ACCELERATE_USE_CPU=1" if env.get("ACCELERATE_USE_CPU") else ""
            entry["launch"] = f"{cpu.strip()} {shlex.join(cmd)}".strip()
        rows.append(entry)
    if "prune" in st:
        for m, c in plan.prune.items():
            rows.append({"stage": f"prune {m}", "what": f"to {c.method.target} in {c.method.rounds} rounds, "
                         f"{c.finetune.finetune_steps} fine-tuning steps each"
                         + (" (distilled from the dense model)" if c.distilling else ""),
                         "leaves": ", ".join(
                             str(plan.layout.artifact(prune_tag(c.label, r))) for r in range(1, c.method.rounds + 1))})
    if "quantize" in st:
        q = plan.quantize
        for wanted in plan.run.pipeline.quantize_from:
            what = (f"the most compressed pruning round within {plan.run.pipeline.max_loss_increase:.1%} of train"
                    if wanted == BEST_PRUNED else str(plan.layout.artifact(wanted)))
            rows.append({"stage": f"quantize {wanted}", "what": f"{q.method.backend} int8 of {what}",
                         "leaves": str(plan.run_dir / ("quantize-<backend>" if wanted == "train"
                                                       else f"<{wanted}>+quantize-<backend>"))})
    if "bench" in st:
        rows.append({"stage": "bench", "what": "every artifact of the run, one protocol: prefill and decode at batch "
                                               f"1 and 12{', with the peer engines' if plan.bench.what.peers else ''}; "
                                               f"the artifact to ship chosen for {plan.run.pipeline.optimize_for}",
                     "leaves": str(plan.report_dir / "bench.json")})
    if "report" in st:
        rows.append({"stage": "report", "what": "summary.md with plots", "leaves": str(plan.report_dir / "summary.md")})
    return rows


# ------------------------------------------------------------------------------------------ expected time
# Every stage's work counted in training steps of the recipe (one forward + backward + AdamW step at its batch x
# block), times the step time measured on this machine after the first training steps. Counts are exact for
# training and fine-tuning; the measuring work (evaluations, timed rounds, exports) is counted by the operations it
# runs, with the per-operation weights below (step equivalents); they were read off one quickstart on a 2-core Xeon
# and are estimates on any other machine: `effkit run` rescales what is left by how the finished stages compared
# and records predicted against actual in eta.json and the summary.
FORWARD = 1 / 3  # a forward pass at the training batch, in training steps
PRUNE_ROUND = 25.0  # per pruning round: calibration, the paired latency, evaluations, saving (steps)
QUANTIZE = 150.0  # per quantized artifact: conversion or export, loss, latency, generation (steps)
BENCH_ARTIFACT_ROUND = 10.0  # per artifact per bench round: prefill b1/b12, decode b1/b12 (steps, 128 tokens)
BENCH_ARTIFACT = 16.0  # per artifact: loading, its held-out loss, a sample, its memory (steps)
# The rounds after a comparison's first look run until it is decided, within its time budget (seconds, the same on
# every machine): counted as this share of the budgets (the quickstart on the Xeon used 132 s of its 380, 35%)
BUDGET_USED = 0.35
BENCH_MEASURES = 6  # prefill b1/b12, decode b1/b12, training b4/b12


def stage_budgets(plan: Plan) -> dict[str, float]:
    """Each measuring stage's time budget for the rounds after the first look (seconds; 0 with fixed rounds)."""
    st, out = plan.run.pipeline.stages, {}

    def budget(measure: Any, comparisons: int) -> float:
        return 0.0 if measure.fixed_rounds else measure.budget_s * comparisons

    for mode, c in (plan.prune.items() if "prune" in st else []):
        out[f"prune {mode}"] = c.method.rounds * budget(c.measure, 2)  # latency b1, b12 per round
    for wanted in plan.run.pipeline.quantize_from if "quantize" in st else []:
        q = plan.quantize
        out[quantize_key(plan, wanted)] = budget(q.measure, 3 + (q.method.backend == "auto"))
    if "bench" in st:
        out["bench"] = budget(plan.bench.measure, BENCH_MEASURES)
    return out


def stage_work(plan: Plan) -> dict[str, float]:
    """Each stage's work in training steps of the recipe (see above), keyed by the names the run prints."""
    st, work = plan.run.pipeline.stages, {}
    t = plan.train
    evals = (t.optim.max_steps // t.run.eval_interval if t.run.eval_interval else 0) + 1
    eval_steps = -(-t.data.eval_blocks // t.optim.batch_size) * FORWARD
    if "train" in st:
        work["train"] = t.optim.max_steps + evals * eval_steps
    n_artifacts = 1
    for mode, c in (plan.prune.items() if "prune" in st else []):
        ft = c.finetune
        per_round = ft.finetune_steps * (1 + (FORWARD if c.distilling else 0)) * (2 if ft.control else 1)
        work[f"prune {mode}"] = c.method.rounds * (per_round + PRUNE_ROUND)
        n_artifacts += c.method.rounds
    for wanted in plan.run.pipeline.quantize_from if "quantize" in st else []:
        work[quantize_key(plan, wanted)] = QUANTIZE
        n_artifacts += 1
    if "bench" in st:
        b = plan.bench
        n = n_artifacts + (len(PEER_TAGS) if b.what.peers else 0)
        ms = b.measure
        work["bench"] = n * (ms.rounds * BENCH_ARTIFACT_ROUND * ms.gen_tokens / 128 * ms.repeats / 3 + BENCH_ARTIFACT)
    return work


class Eta:
    """The expected time of every stage on this machine, printed once the training step time is measured and
    updated as stages finish; written to `eta.json` (predicted at the first estimate against actual)."""

    def __init__(self, plan: Plan, console: Console):
        self.plan, self.console = plan, console
        self.work = stage_work(plan)
        self.budgets = stage_budgets(plan)
        self.step_s: float | None = None
        self.how: str | None = None  # how the step time was measured
        self.first: dict[str, float] = {}  # the first prediction, seconds per stage
        self.actual: dict[str, float] = {}
        self.skipped: list[str] = []
        self.start = time.time()
        self._steps: list[float] = []
        self.clock = time.perf_counter

    def on_train_step(self, step: int, _loss: float) -> None:
        """Time the first training steps (after the warm-up ones): the estimate is printed once 20 are seen."""
        now = self.clock()
        self._steps.append(now)
        skip = self.plan.train.run.warmup_steps_excluded
        if self.step_s is None and len(self._steps) >= skip + 21:
            gaps = sorted(b - a for a, b in zip(self._steps[skip:-1], self._steps[skip + 1:], strict=True))
            self.set_step_time(gaps[len(gaps) // 2], f"the median of training steps {skip + 2}-{step}")

    def set_step_time(self, seconds: float, how: str) -> None:
        if self.step_s is not None or seconds <= 0:
            return
        self.step_s, self.how = seconds, how
        self.first = {k: w * seconds + BUDGET_USED * self.budgets.get(k, 0.0) for k, w in self.work.items()
                      if k not in self.skipped}
        total = sum(self.first.values())
        parts = ", ".join(f"{k} {_mins(v)}" for k, v in self.first.items())
        self.console.print(f"[bold]expected on this machine[/bold] (one training step {seconds:.3f} s, {how}): "
                           f"{parts}; about {_mins(total)} in all, done around "
                           f"{time.strftime('%H:%M', time.localtime(self.start + total))}")

    def step_time_from_report(self, report: dict[str, Any]) -> None:
        """The step time from a finished training's report (a launched or an earlier run)."""
        tps = report.get("metrics", report).get("train_tokens_per_s")
        if tps:
            o = self.plan.train
            self.set_step_time(o.optim.batch_size * o.optim.grad_accum * o.data.block_size / tps,
                               "from the training report's steady tokens/s")

    def finished(self, name: str, seconds: float, skipped: bool = False) -> None:
        if skipped:
            self.skipped += [] if name in self.skipped else [name]
            return
        self.actual[name] = seconds
        if self.step_s is None or name not in self.first:
            return
        left = [k for k in self.first if k not in self.actual and k not in self.skipped]
        if left:
            rest = self.remaining(left)
            end = time.strftime("%H:%M", time.localtime(time.time() + sum(rest.values())))
            self.console.print(f"{name} took {_mins(seconds)} (expected {_mins(self.first[name])}); left: "
                               + ", ".join(f"{k} {_mins(v)}" for k, v in rest.items()) + f"; done around {end}")
        self.write()

    def remaining(self, left: list[str]) -> dict[str, float]:
        """What is left, rescaled by how the finished measuring stages (all but train) compared to their estimate."""
        done = [k for k in self.actual if k in self.first and k != "train"]
        scale = (sum(self.actual[k] for k in done) / sum(self.first[k] for k in done)) if done else 1.0
        return {k: self.first[k] * (1.0 if k == "train" else scale) for k in left}

    def record(self) -> dict[str, Any]:
        return {"step_time_s": self.step_s, "step_time_how": self.how,
                "work_in_steps": self.work, "sequential_budgets_s": self.budgets, "predicted_s": self.first,
                "actual_s": self.actual,
                "skipped": self.skipped,
                "how": "each stage's work counted in training steps of the recipe (training and fine-tuning steps "
                       "exactly; evaluations, timed rounds and exports by per-operation weights read off one "
                       "quickstart on a 2-core Xeon), times the step time measured here, plus "
                       f"{BUDGET_USED:.0%} of each measuring stage's time budget for the rounds after the first "
                       "look; predicted = the first estimate, printed after the first training steps"}

    def write(self) -> None:
        """eta.json, once a stage has run (a rerun that skips every stage keeps the file of the run that did);
        stages skipped now keep what an earlier invocation recorded for them."""
        path = self.plan.report_dir / "eta.json"
        if self.step_s is None or not self.actual or not self.plan.report_dir.is_dir():
            return
        rec = self.record()
        try:
            old = json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, OSError):
            old = {}
        for k in self.skipped:
            if k in old.get("actual_s", {}) and k in old.get("predicted_s", {}):
                rec["predicted_s"][k], rec["actual_s"][k] = old["predicted_s"][k], old["actual_s"][k]
        artifacts.atomic_write_text(path, json.dumps(rec, indent=2))


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def run_pipeline(recipe: str, force: bool = False, dry_run: bool = False, console: Console | None = None) -> dict:
    console = console or Console()
    plan = make_plan(recipe)
    steps = describe(plan)
    if dry_run:
        return {"plan": steps, "dry_run": True}
    if force:  # run names are plain names (config), so these stay inside the runs and reports folders
        with artifacts.run_lock(plan.run_dir):  # refuses while another process uses the run
            pass
        shutil.rmtree(plan.run_dir, ignore_errors=True)
        shutil.rmtree(plan.report_dir, ignore_errors=True)
    with artifacts.run_lock(plan.run_dir):  # also removes half-written folders of an interrupted stage
        return _run_stages(plan, steps, console)


def _run_stages(plan: Plan, steps: list[dict[str, Any]], console: Console) -> dict:
    t0 = time.perf_counter()
    done: list[str] = []
    total = len(steps)
    eta = Eta(plan, console)
    clock = {"t": time.perf_counter()}

    def header(i: int, name: str, skipped: bool = False):
        status = "[dim]skipped: already complete[/dim]" if skipped else ""
        console.rule(f"[bold]stage {i}/{total}: {name}[/bold] {status}")
        clock["t"] = time.perf_counter()

    def finished(name: str, skipped: bool = False, key: str | None = None):
        done.append(f"{name} (skipped)" if skipped else name)
        eta.finished(key or name, time.perf_counter() - clock["t"], skipped=skipped)

    i = 0
    st = plan.run.pipeline.stages
    record = StageRecord(plan, console)
    if "train" in st:
        i += 1
        outputs = [plan.run_dir / "train", plan.run_dir / "checkpoints", plan.layout.report("train")]
        if _complete(plan.run_dir / "train") and record.fresh("train"):
            header(i, "train", skipped=True)
            finished("train", skipped=True)
        else:
            header(i, "train")
            record.stale("train", also=tuple(outputs))  # another recipe's artifact or checkpoint is removed
            resume = Checkpointer(plan.layout.checkpoint_dir).exists()
            if resume:
                console.print("resuming training from its last checkpoint")
            record.done("train", outputs)  # before training: a resumed run continues only a matching checkpoint
            report = train_any(plan.train.replace(run=plan.train.run.replace(resume=resume)),
                               on_step=eta.on_train_step, plan=predict_quietly(plan.train))
            record.save()  # the run folder exists now
            eta.step_time_from_report(report)  # a launched run, or one too short for the in-run estimate
            finished("train")
    if "prune" in st:  # complete stages are left out of the estimate (known before it is printed)
        eta.skipped += [f"prune {m}" for m in plan.prune if _prune_done(plan, m) and record.fresh(f"prune {m}")]
    if "bench" in st and _bench_done(plan) and record.fresh("bench"):
        eta.skipped.append("bench")
    if eta.step_s is None and plan.layout.report("train").is_file():  # trained earlier: its report has the speed
        eta.step_time_from_report(json.loads(plan.layout.report("train").read_text()))
    if "prune" in st:
        for mode, cfg in plan.prune.items():
            i += 1
            name = f"prune {mode}"
            # (the control chains under controls/ are a cache keyed by their whole fine-tuning: never stale)
            outputs = [*(plan.layout.artifact(prune_tag(cfg.label, r)) for r in range(1, cfg.method.rounds + 1)),
                       plan.report_dir / f"prune-{cfg.label}.json"]
            if not record.stale(name, also=tuple(outputs)) and _prune_done(plan, mode):
                header(i, name, skipped=True)
                finished(name, skipped=True)
                continue
            header(i, name)
            run_prune(cfg)
            record.done(name, outputs)
            finished(name)
    choice = None
    for wanted in plan.run.pipeline.quantize_from if "quantize" in st else []:
        i += 1
        name = key = quantize_key(plan, wanted)
        source = plan.layout.artifact(wanted)
        if wanted == BEST_PRUNED:
            source, choice = best_pruned(plan)
            if source is None:
                header(i, name)
                console.print(f"no pruning round is within {plan.run.pipeline.max_loss_increase:.1%} of train: "
                              "nothing to quantize")
                done.append(f"{name} (none within the loss budget)")
                eta.finished(key, 0.0, skipped=True)
                continue
            name = f"{name} ({source.name})"
        made = _quantize_done(plan, source)
        if not record.stale(key, also=(made,) if made else ()) and made:
            header(i, name, skipped=True)
            finished(name, skipped=True, key=key)
        else:
            header(i, name)
            run_quantize(plan.quantize.replace(source=str(source)))
            record.done(key, [p for p in [_quantize_done(plan, source)] if p])
            finished(name, key=key)
    bench_report = None
    if "bench" in st:
        i += 1
        if not record.stale("bench", also=(plan.report_dir / "bench.json",)) and _bench_done(plan):
            header(i, "bench", skipped=True)
            bench_report = json.loads((plan.report_dir / "bench.json").read_text())
            finished("bench", skipped=True)
        else:
            header(i, "bench")
            bench_report = run_bench(plan.bench)
            record.done("bench", [])
            finished("bench")
    ship = None
    if bench_report:
        ship = deliverable(plan, bench_report)
        if choice:
            ship["best_pruned"] = choice
        artifacts.atomic_write_text(plan.report_dir / "deliverable.json", json.dumps(ship, indent=2))
    eta.write()
    if "report" in st:
        i += 1
        header(i, "report")
        render_run_report(Path(plan.run.folders.reports_dir), plan.run.pipeline.run_name)
        done.append("report")
    return {"plan": steps, "done": done, "wall_s": time.perf_counter() - t0, "bench": bench_report,
            "report": str(plan.report_dir / "summary.md"), "deliverable": ship, "eta": eta.record()}
