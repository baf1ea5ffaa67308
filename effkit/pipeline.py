"""`effkit run`: the whole pipeline from one recipe (train -> prune -> quantize -> bench -> report), resumable.

A stage is complete when its artifact folder exists (folders appear by an atomic rename, so existing means
complete); complete stages are skipped, an interrupted stage starts again from scratch (training resumes from
its checkpoint), and `--force` redoes everything.

`quantize_from` lists what is quantized: `train`, a pruning round, or `best-pruned` (the most compressed round
within `max_loss_increase` of its dense control), so a run delivers the composed model, pruned and int8. The run
ends with one line: the fastest artifact within the loss budget, how it compares, and how to load it.
"""

from __future__ import annotations

import dataclasses
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
from effkit.bench import run_bench
from effkit.checkpoint import Checkpointer
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
from effkit.measure import stats
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
        return RunLayout.for_run(self.run)

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
    dirs = {"runs_dir": run.runs_dir, "reports_dir": run.reports_dir}
    train = build_config(TrainConfig, recipe, {"run_name": run.run_name, **dirs})
    layout = RunLayout.for_run(run)
    dense = str(layout.artifact("train"))
    prune = {m: build_config(PruneConfig, recipe, {"mode": m, "source": dense, **dirs}) for m in run.prune_modes}
    if "prune" in run.stages and not prune:
        raise EffkitError(f"recipe {recipe}: [run] lists the prune stage but prune_modes is empty")
    # auto picks its backend for the workload the deliverable is chosen for
    quantize = build_config(QuantizeConfig, recipe, {"source": dense, "optimize_for": run.optimize_for, **dirs})
    bench = build_config(BenchConfig, recipe, {"run": run.run_name, **dirs})
    if bench.peers is None:  # `effkit run` measures the engines a user would pick instead, unless told not to
        bench = bench.replace(peers=True)
    valid_tags = {"train"} | {prune_tag(c.label, r) for c in prune.values() for r in range(1, c.rounds + 1)}
    for wanted in run.quantize_from if "quantize" in run.stages else []:
        if wanted not in valid_tags | ({BEST_PRUNED} if prune and "prune" in run.stages else set()):
            raise EffkitError(f"recipe {recipe}: [run] quantize_from = {wanted!r} is not an artifact this recipe "
                              f"makes; choose among {', '.join(sorted(valid_tags))}"
                              + (f", {BEST_PRUNED}" if prune and "prune" in run.stages else ""))
    return Plan(recipe, run, train, prune, quantize, bench)


def _complete(path: Path) -> bool:
    return (path / artifacts.META).is_file()


def _prune_done(plan: Plan, mode: str) -> bool:
    cfg = plan.prune[mode]
    return (plan.report_dir / f"prune-{cfg.label}.json").is_file() and _complete(
        plan.layout.artifact(prune_tag(cfg.label, cfg.rounds)))


def _quantize_done(plan: Plan, source: Path) -> Path | None:
    if not plan.run_dir.is_dir():
        return None
    for d in plan.run_dir.glob("*quantize-*"):
        if _complete(d) and artifacts.read_meta(d).get("parent") == str(source):
            return d
    return None


BEST_PRUNED = "best-pruned"


def best_pruned(plan: Plan) -> tuple[Path | None, dict[str, Any]]:
    """The most compressed pruning round (smallest artifact folder: parameters really removed; then the lowest
    batch-12 latency) whose held-out loss is within `max_loss_increase` of its dense control (of the dense parent
    when the round ran without a control), and the table it was chosen from."""
    budget = plan.run.max_loss_increase
    rows = []
    for cfg in plan.prune.values():
        for r in range(1, cfg.rounds + 1):
            d = plan.layout.artifact(prune_tag(cfg.label, r))
            if not _complete(d):
                continue
            m = artifacts.read_meta(d)["metrics"]
            vs = "control" if m.get("eval_loss_delta_vs_control") else "dense parent"
            delta = m.get("eval_loss_delta_vs_control") or m["eval_loss_delta_vs_dense"]
            rows.append({"tag": d.name, "size_bytes": artifacts.dir_size(d), "loss_delta": delta["delta"],
                         "loss_delta_ci95": delta["ci95"], "vs": vs, "latency_b12_s": m["latency_b12"]["p50_s"],
                         "within_budget": delta["delta"] <= budget})
    within = [r for r in rows if r["within_budget"]]
    best = min(within, key=lambda r: (r["size_bytes"], r["latency_b12_s"])) if within else None
    return (plan.layout.artifact(best["tag"]) if best else None), {
        "picked": best["tag"] if best else None, "budget": budget, "rounds": rows,
        "how": f"pruning rounds whose held-out loss is at most {budget:.1%} above their dense control's (relative, "
               "point estimate of the paired delta); among them the smallest folder, then the lowest latency b12"}


def deliverable(plan: Plan, bench: dict[str, Any]) -> dict[str, Any]:
    """The artifact to ship: among the benched artifacts (peers excluded: they are what a user has without effkit)
    whose held-out loss is within `max_loss_increase` of the dense reference's (the model the user has; paired
    point estimate), the best at the recipe's workload (`optimize_for`: decode tokens/s at batch 1 or 12, or
    prefill latency at batch 12), then the smallest; with the line that says so, its standing against the fastest
    peer at that workload, and, for a pruned artifact, its dense control's attribution."""
    budget, workload = plan.run.max_loss_increase, plan.run.optimize_for
    key, higher = WORKLOADS[workload]
    rows = [r for r in bench["artifacts"] if r["stage"] != "peer"]
    ref = rows[0]
    within = [r for r in rows if r is ref or r["eval_loss_delta"]["delta"] <= budget]
    speed = lambda r: 1.0 if r is ref else r[key]["ratio"]  # noqa: E731 - vs the reference, paired
    best = max(within, key=lambda r: (speed(r) if higher else -speed(r), -r["size_ratio"]))
    path = Path(best["artifact"])
    loss = "ref" if best is ref else stats.fmt_delta(best["eval_loss_delta"]) + f" vs {ref['tag']}"
    if best.get("eval_loss_delta_vs_control"):
        loss += (f" ({stats.fmt_delta(best['eval_loss_delta_vs_control'])} of it against its dense control, the dense "
                 "model fine-tuned the same way: the rest is what that fine-tuning did)")
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
    st = plan.run.stages
    if "train" in st:
        t = plan.train
        what = (f"{t.model.name} on {t.data.source}, {t.optim.max_steps} steps, batch {t.optim.batch_size} x "
                f"{t.data.block_size}, parallel {t.parallel.mode}, "
                f"amp {'auto (measured)' if t.optim.amp is None else t.optim.amp_dtype if t.optim.amp else 'off'}")
        entry = {"stage": "train", "what": what, "leaves": str(plan.layout.artifact("train"))}
        if t.parallel.launched:
            p = t.parallel.replace(nproc=nproc_per_node(t.parallel))  # as resolved on this machine
            cmd, env = launch_command(p, Path("<tmp>/launch-config.json"), Path("<tmp>/errors"))
            cpu = " ACCELERATE_USE_CPU=1" if env.get("ACCELERATE_USE_CPU") else ""
            entry["launch"] = f"{cpu.strip()} {shlex.join(cmd)}".strip()
        rows.append(entry)
    if "prune" in st:
        for m, c in plan.prune.items():
            rows.append({"stage": f"prune {m}", "what": f"to {c.target} in {c.rounds} rounds, {c.finetune_steps} "
                         "fine-tuning steps each" + (" (distilled from the dense model)" if c.distilling else ""),
                         "leaves": ", ".join(
                             str(plan.layout.artifact(prune_tag(c.label, r))) for r in range(1, c.rounds + 1))})
    if "quantize" in st:
        q = plan.quantize
        for wanted in plan.run.quantize_from:
            what = (f"the most compressed pruning round within {plan.run.max_loss_increase:.1%} of its control"
                    if wanted == BEST_PRUNED else str(plan.layout.artifact(wanted)))
            rows.append({"stage": f"quantize {wanted}", "what": f"{q.backend} int8 of {what}",
                         "leaves": str(plan.run_dir / ("quantize-<backend>" if wanted == "train"
                                                       else f"<{wanted}>+quantize-<backend>"))})
    if "bench" in st:
        rows.append({"stage": "bench", "what": "every artifact of the run, one protocol: prefill and decode at batch "
                                               f"1 and 12{', with the peer engines' if plan.bench.peers else ''}; "
                                               f"the artifact to ship chosen for {plan.run.optimize_for}",
                     "leaves": str(plan.report_dir / "bench.json")})
    if "report" in st:
        rows.append({"stage": "report", "what": "summary.md with plots", "leaves": str(plan.report_dir / "summary.md")})
    return rows


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

    def header(i: int, name: str, skipped: bool = False):
        status = "[dim]skipped: already complete[/dim]" if skipped else ""
        console.rule(f"[bold]stage {i}/{total}: {name}[/bold] {status}")

    i = 0
    st = plan.run.stages
    if "train" in st:
        i += 1
        if _complete(plan.run_dir / "train"):
            header(i, "train", skipped=True)
            done.append("train (skipped)")
        else:
            header(i, "train")
            resume = Checkpointer(plan.layout.checkpoint_dir).exists()
            if resume:
                console.print("resuming training from its last checkpoint")
            train_any(plan.train.replace(run=plan.train.run.replace(resume=resume)))
            done.append("train")
    if "prune" in st:
        for mode, cfg in plan.prune.items():
            i += 1
            if _prune_done(plan, mode):
                header(i, f"prune {mode}", skipped=True)
                done.append(f"prune {mode} (skipped)")
                continue
            header(i, f"prune {mode}")
            run_prune(cfg)
            done.append(f"prune {mode}")
    choice = None
    for wanted in plan.run.quantize_from if "quantize" in st else []:
        i += 1
        name = f"quantize {wanted}" if plan.run.quantize_from != ["train"] else "quantize"
        source = plan.layout.artifact(wanted)
        if wanted == BEST_PRUNED:
            source, choice = best_pruned(plan)
            if source is None:
                header(i, name)
                console.print(f"no pruning round is within {plan.run.max_loss_increase:.1%} of its control: nothing "
                              "to quantize")
                done.append(f"{name} (none within the loss budget)")
                continue
            name = f"{name} ({source.name})"
        if _quantize_done(plan, source):
            header(i, name, skipped=True)
            done.append(f"{name} (skipped)")
        else:
            header(i, name)
            run_quantize(plan.quantize.replace(source=str(source)))
            done.append(name)
    bench_report = None
    if "bench" in st:
        i += 1
        if _bench_done(plan):
            header(i, "bench", skipped=True)
            bench_report = json.loads((plan.report_dir / "bench.json").read_text())
            done.append("bench (skipped)")
        else:
            header(i, "bench")
            bench_report = run_bench(plan.bench)
            done.append("bench")
    ship = None
    if bench_report:
        ship = deliverable(plan, bench_report)
        if choice:
            ship["best_pruned"] = choice
        artifacts.atomic_write_text(plan.report_dir / "deliverable.json", json.dumps(ship, indent=2))
    if "report" in st:
        i += 1
        header(i, "report")
        render_run_report(Path(plan.run.reports_dir), plan.run.run_name)
        done.append("report")
    return {"plan": steps, "done": done, "wall_s": time.perf_counter() - t0, "bench": bench_report,
            "report": str(plan.report_dir / "summary.md"), "deliverable": ship}
