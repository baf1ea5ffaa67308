"""`effkit run`: the whole pipeline from one recipe (train -> prune -> quantize -> bench -> report), resumable.

A stage is complete when its artifact folder exists (folders appear by an atomic rename, so existing means
complete); complete stages are skipped, an interrupted stage starts again from scratch (training resumes from
its checkpoint), and `--force` redoes everything.
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
from effkit.bench import run_bench
from effkit.checkpoint import Checkpointer
from effkit.config import BenchConfig, PruneConfig, QuantizeConfig, RunConfig, TrainConfig, build_config, load_recipe
from effkit.errors import EffkitError
from effkit.parallel.launch import launch_command, nproc_per_node
from effkit.prune.stage import run_prune
from effkit.quantize import run_quantize
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
    qsource = str(layout.artifact(run.quantize_from))
    quantize = build_config(QuantizeConfig, recipe, {"source": qsource, **dirs})
    bench = build_config(BenchConfig, recipe, {"run": run.run_name, **dirs})
    valid_tags = {"train"} | {prune_tag(m, r) for m, c in prune.items() for r in range(1, c.rounds + 1)}
    if "quantize" in run.stages and run.quantize_from not in valid_tags:
        raise EffkitError(f"recipe {recipe}: [run] quantize_from = {run.quantize_from!r} is not an artifact this "
                          f"recipe makes; choose one of {', '.join(sorted(valid_tags))}")
    return Plan(recipe, run, train, prune, quantize, bench)


def _complete(path: Path) -> bool:
    return (path / artifacts.META).is_file()


def _prune_done(plan: Plan, mode: str) -> bool:
    cfg = plan.prune[mode]
    return (plan.report_dir / f"prune-{mode}.json").is_file() and _complete(
        plan.layout.artifact(prune_tag(mode, cfg.rounds)))


def _quantize_done(plan: Plan) -> Path | None:
    if not plan.run_dir.is_dir():
        return None
    for d in plan.run_dir.glob("quantize-*"):
        if _complete(d) and artifacts.read_meta(d).get("parent") == plan.quantize.source:
            return d
    return None


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
                f"amp {t.optim.amp_dtype if t.optim.amp else 'off'}")
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
                         "fine-tuning steps each", "leaves": ", ".join(
                             str(plan.layout.artifact(prune_tag(m, r))) for r in range(1, c.rounds + 1))})
    if "quantize" in st:
        q = plan.quantize
        rows.append({"stage": "quantize", "what": f"{q.backend} int8 of {q.source}",
                     "leaves": str(plan.run_dir / "quantize-<backend>")})
    if "bench" in st:
        rows.append({"stage": "bench", "what": "every artifact of the run, one protocol",
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
    if "quantize" in st:
        i += 1
        if _quantize_done(plan):
            header(i, "quantize", skipped=True)
            done.append("quantize (skipped)")
        else:
            header(i, "quantize")
            run_quantize(plan.quantize)
            done.append("quantize")
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
    if "report" in st:
        i += 1
        header(i, "report")
        render_run_report(Path(plan.run.reports_dir), plan.run.run_name)
        done.append("report")
    return {"plan": steps, "done": done, "wall_s": time.perf_counter() - t0, "bench": bench_report,
            "report": str(plan.report_dir / "summary.md")}
