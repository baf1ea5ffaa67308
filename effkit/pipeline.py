"""`effkit run`: the whole pipeline from one recipe (train -> prune -> quantize -> bench -> report), resumable.

One loop over the recipe's stages (`effkit.stage`: each stage gives its steps; the registry `effkit.registry.STAGES`
says which exist and their order); this module never names a stage. A step is complete when what it leaves exists
(folders appear by an atomic rename, so existing means complete) and the fingerprint it ran with (its recipe
section and its parents' fingerprints, in `runs/<run>/pipeline.json`) matches the recipe's now: complete steps are
skipped; a step whose recipe section or parent changed runs again, with every step after it, and says so; an
interrupted step starts again from scratch (training resumes from its checkpoint when that was made by the same
recipe); `--force` redoes everything. While it runs, `Eta` prints the expected time of every step (its work in
training steps, times the step time that the stage declaring `measures_step_time` lets it measure, plus a share of
its time budget), updates it as steps finish and writes it to `eta.json`. The run ends with one line: the fastest
artifact within the loss budget, how it compares, and how to load it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from effkit import artifacts
from effkit.config import RunConfig, build_config, load_recipe
from effkit.registry import STAGES
from effkit.stage import Plan, RunContext, Stage, Step

RECORD = "pipeline.json"  # in the run folder: each step's fingerprint and the folders it left
# The rounds after a comparison's first look run until it is decided, within its time budget (seconds, the same on
# every machine): most comparisons decide well before their budget runs out, so the estimate counts this share of
# the budgets, the share a quickstart used (docs/benchmarks.md); the rescaling as steps finish corrects the rest
BUDGET_USED = 0.35


def make_plan(recipe: str, overrides: dict[str, Any] | None = None) -> Plan:
    """Read and validate the whole recipe before anything runs: [run] (with `overrides`, the command line's flat
    keys: `optimize_for`), then every stage's table, in order."""
    load_recipe(recipe)
    plan = Plan(recipe, build_config(RunConfig, recipe, dict(overrides or {})))
    for name in STAGES.names():
        STAGES.get(name).configure(plan)
    return plan


def steps(plan: Plan) -> list[Step]:
    """The steps of the recipe's stages, in run order."""
    return [s for name in STAGES.names() if name in plan.stages for s in STAGES.get(name).steps(plan)]


def fingerprints(plan: Plan) -> dict[str, str]:
    """Each step's fingerprint: its recipe section (as resolved, flags included) and its parents' fingerprints, so
    that a change reaches every step downstream. Keyed by the step names the run prints."""
    fp: dict[str, str] = {}
    for name in STAGES.names():
        fp.update(STAGES.get(name).fingerprints(plan, dict(fp)))
    return fp


def step_timer(plan: Plan) -> Stage | None:
    """The stage that measures the time of one training step (the unit of the estimate), if one is registered."""
    return next((st for name in STAGES.names() if (st := STAGES.get(name)).measures_step_time), None)


def describe(plan: Plan) -> list[dict[str, Any]]:
    """The steps, what each does, and what it leaves: printed by `--dry-run`."""
    return [s.describe(plan) for s in steps(plan)]


def stage_work(plan: Plan) -> dict[str, float]:
    """Each step's work in training steps of the recipe, keyed by the names the run prints."""
    return {s.key: w for s in steps(plan) if (w := s.work(plan)) is not None}


def stage_budgets(plan: Plan) -> dict[str, float]:
    """Each measuring step's time budget for the rounds after the first look (seconds; 0 with fixed rounds)."""
    return {s.key: s.budget(plan) for s in steps(plan) if s.work(plan) is not None and s.measures}


# ------------------------------------------------------------------------------------------ what is stale
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


class Eta:
    """The expected time of every stage on this machine, printed once the training step time is measured and
    updated as stages finish; written to `eta.json` (predicted at the first estimate against actual)."""

    def __init__(self, plan: Plan, console: Console):
        self.plan, self.console = plan, console
        self.work = stage_work(plan)
        self.budgets = stage_budgets(plan)
        self.exact = {s.key for s in steps(plan) if not s.measures}  # work counted exactly: never rescaled
        self.timer = step_timer(plan)
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
        skip = self.timer.untimed_steps(self.plan) if self.timer else 0
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

    def step_time_from_report(self, report: dict[str, Any] | None = None) -> None:
        """The step time from a finished training's report (a launched run's; default: the one an earlier run
        left, if any), as the stage that measures it reads it."""
        if self.timer and (found := self.timer.step_time(self.plan, report)):
            self.set_step_time(*found)

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
        """What is left, rescaled by how the finished measuring stages (all but those whose work is counted
        exactly: training) compared to their estimate."""
        done = [k for k in self.actual if k in self.first and k not in self.exact]
        scale = (sum(self.actual[k] for k in done) / sum(self.first[k] for k in done)) if done else 1.0
        return {k: self.first[k] * (1.0 if k in self.exact else scale) for k in left}

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


def run_pipeline(recipe: str, force: bool = False, dry_run: bool = False, console: Console | None = None,
                 overrides: dict[str, Any] | None = None) -> dict:
    console = console or Console()
    plan = make_plan(recipe, overrides)
    rows = describe(plan)
    if dry_run:
        return {"plan": rows, "dry_run": True}
    if force:  # run names are plain names (config), so these stay inside the runs and reports folders
        with artifacts.run_lock(plan.run_dir):  # refuses while another process uses the run
            pass
        shutil.rmtree(plan.run_dir, ignore_errors=True)
        shutil.rmtree(plan.report_dir, ignore_errors=True)
    with artifacts.run_lock(plan.run_dir):  # also removes half-written folders of an interrupted stage
        return _run_steps(plan, rows, console)


def _run_steps(plan: Plan, rows: list[dict[str, Any]], console: Console) -> dict:
    t0 = time.perf_counter()
    done: list[str] = []
    todo = steps(plan)
    ctx = RunContext(plan, console, Eta(plan, console))
    eta, record = ctx.eta, StageRecord(plan, console)
    # complete steps whose completeness is known now are left out of the estimate (printed during training)
    eta.skipped += [s.key for s in todo if s.known_early and s.key in eta.work and record.fresh(s.key)
                    and s.complete(ctx)]
    for i, step in enumerate(todo, 1):
        if i > 1 and eta.step_s is None:  # trained earlier: its report has the speed
            eta.step_time_from_report()
        start = time.perf_counter()

        def header(label: str, skipped: bool = False, total: int = len(todo), i: int = i):
            status = "[dim]skipped: already complete[/dim]" if skipped else ""
            console.rule(f"[bold]stage {i}/{total}: {label}[/bold] {status}")

        if why := step.skip_why(ctx):
            header(step.label(ctx))
            console.print(why)
            done.append(f"{step.label(ctx)} (not run)")
            eta.finished(step.key, 0.0, skipped=True)
            continue
        if step.records and record.fresh(step.key) and step.complete(ctx):
            header(step.label(ctx), skipped=True)
            step.reuse(ctx)
            done.append(f"{step.label(ctx)} (skipped)")
            eta.finished(step.key, time.perf_counter() - start, skipped=True)
            continue
        header(step.label(ctx))
        if step.records:
            record.stale(step.key, also=tuple(step.outputs(ctx)))  # what another recipe left is removed
            if step.record_before_run:
                record.done(step.key, step.outputs(ctx))
        step.run(ctx)
        if step.records:
            record.done(step.key, step.recorded_outputs(ctx))
        done.append(step.label(ctx))
        if step.work(plan) is not None:
            eta.finished(step.key, time.perf_counter() - start)
        eta.write()
    return {"plan": rows, "done": done, "wall_s": time.perf_counter() - t0, "bench": ctx.results.get("bench"),
            "report": str(plan.report_dir / "summary.md"), "deliverable": ctx.results.get("deliverable"),
            "eta": eta.record()}
