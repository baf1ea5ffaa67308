"""The stage protocol `effkit run` loops over, and what its stages share.

A `Stage` (train, prune, quantize, bench, report, or one a user registers in `effkit.registry.STAGES`) reads its
recipe table into the plan (`configure`; `Plan`: the whole recipe, validated before anything runs) and gives the
run its `steps`: the units the run prints, fingerprints, skips when complete, times and runs (`prune row`,
`quantize best-pruned`, ...). A step declares its inputs (the fingerprints of the steps it depends on), its outputs
(the folders it leaves), its fingerprint, its estimate (work in training steps, whether that work is counted
exactly or by the measuring weights (`measures`), and a time budget for sequential rounds) and its run; the steps
of one run share a `RunContext`. The stage that trains says so (`measures_step_time`) and tells the run how to time
its steps and where a finished training's step time can be read (`untimed_steps`, `step_time`), and, for the run's
time budget, how many steps the recipe trains, how to time one before training and how to train fewer
(`training_steps`, `probe_step_time`, `with_training_steps`, `schedule_free_steps`), and every measuring stage how
to run on a share of what the recipe gives it (`with_share`), so that `effkit.pipeline` never names a stage. Adding
a stage: a module with a `STAGE` object and one line in `effkit.registry.STAGES` (or `STAGES.register`).

Also here, for the stages that read one another's results: `fingerprint` and `complete` (an artifact folder's
completeness), and the pruning rounds a run made (`pruning_rounds`, `most_compressed`, `best_of_each_mode`), which
quantize, bench and report read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit import artifacts
from effkit.artifacts import META, RunLayout
from effkit.measure import results

# Work is counted in training steps of the recipe (one forward + backward + AdamW step at its batch x block), times
# the step time measured on this machine after the first training steps: exact for training and fine-tuning; the
# measuring work (evaluations, timed rounds, exports) is counted by the operations it runs, with per-operation
# weights (step equivalents) calibrated once against a quickstart run: they differ from machine to machine, which is
# why `effkit run` rescales them as the measuring stages finish.
FORWARD = 1 / 3  # a forward pass at the training batch, in training steps
# the weights, fitted from measured runs by benchmarks/stage_costs.py (its `fitted_from` says which), and the speeds
# measured there that rank `auto`'s backends and the bench's peers on a share of their budget (`by_share`)
COSTS = Path(__file__).with_name("stage_costs.json")


@functools.cache
def costs() -> dict[str, Any]:
    """effkit/stage_costs.json: each measuring stage's weights in training steps and the measured speeds."""
    return json.loads(COSTS.read_text())


def by_share(names: list[str], share: float, fewest: int, speed: dict[str, float],
             first: str | None = None) -> tuple[list[str], list[str]]:
    """The rule a measuring stage on `share` of its budget keeps candidates by: the `max(fewest, ceil(share x n))`
    of the `n` `names` measured fastest before (`speed`: relative rates; one never measured after those that were),
    `first` always among them. Returns (kept, left out), each in the order of `names`."""
    n = max(fewest, math.ceil(round(share * len(names), 6)))
    ranked = sorted(names, key=lambda b: (b != first, -speed.get(b, 0.0)))
    kept = set(ranked[:n])
    return [b for b in names if b in kept], [b for b in names if b not in kept]


def left_out_why(share: float, speed: dict[str, float], name: str) -> str:
    """The line a candidate left out by `by_share` is listed with (nothing is dropped silently)."""
    rate = f"{speed[name]:.2g}x the fastest's" if name in speed else "never measured"
    return (f"not run: budget share {share:.0%} (the time budget keeps the candidates measured fastest before, "
            f"effkit/stage_costs.json: this one {rate})")


NOT_RESULTS = frozenset({"force"})  # options that change whether a stage runs, never what it makes


def _results_only(part: Any) -> Any:
    if isinstance(part, dict):
        return {k: _results_only(v) for k, v in part.items() if k not in NOT_RESULTS}
    return part


def fingerprint(*parts: Any) -> str:
    """A short hash of JSON-able parts (a recipe section as resolved, the parents' fingerprints), less the options
    that change nothing a stage makes (`--force` past a memory plan)."""
    parts = tuple(_results_only(p) for p in parts)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def complete(path: Path) -> bool:
    """An artifact folder is complete when its effkit.json exists (folders appear by an atomic rename)."""
    return (path / META).is_file()


@dataclass
class Plan:
    """The whole recipe, read and validated before anything runs: `run` is its [run] table; `configs` holds each
    stage's config under the stage's name (`plan.configs["prune"]`), as its `configure` made it."""

    recipe: str
    run: Any  # RunConfig
    configs: dict[str, Any] = field(default_factory=dict)
    # the time budget's decision (`effkit.pipeline.fit_time_budget`: the step time measured before training, the
    # recipe's steps and those trained), once made for this run; None: the recipe's schedule, no budget
    schedule: dict[str, Any] | None = None
    # each stage's config as the recipe gives it, before a time budget shared the run among the stages (empty: the
    # configs are the recipe's)
    unshared: dict[str, Any] = field(default_factory=dict)
    # the budget was typed on the command line (`--time-budget-min`): one its floors cannot meet is refused; the
    # recipe's own budget is a target, and a run predicted over it at its floors says so and goes on at them
    budget_typed: bool = False

    def __getattr__(self, name: str) -> Any:  # plan.train, plan.prune, ...: a stage's config
        configs = self.__dict__.get("configs", {})
        if name in configs:
            return configs[name]
        raise AttributeError(name)

    @property
    def stages(self) -> list[str]:
        return self.run.pipeline.stages

    @property
    def layout(self) -> RunLayout:
        return RunLayout.of(self.run.folders.runs_dir, self.run.folders.reports_dir, self.run.pipeline.run_name)

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    @property
    def report_dir(self) -> Path:
        return self.layout.report_dir


@dataclass
class ShapeRun:
    """The artifacts a run would leave, as shapes without weights (`artifacts.shape_only`), in a temporary
    `folders` (`effkit run --plan`): `artifacts` by tag, in the order the stages made them; `notes` on what is
    planned at an upper bound."""

    folders: Any  # config.Folders
    run_dir: Path
    artifacts: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class RunContext:
    """What the steps of one `effkit run` share while it runs: the plan, the console, the expected-time tracker,
    and what earlier steps left for later ones (`results`: e.g. the bench's report, the best-pruned choice)."""

    plan: Plan
    console: Any
    eta: Any
    results: dict[str, Any] = field(default_factory=dict)


class Step:
    """One unit of `effkit run`. Subclasses set `key` (the name the run prints and records) and override what
    applies; the defaults are a step that leaves nothing and always runs."""

    key: str = ""
    record_before_run = False  # record the fingerprint before running (a resumed training continues only a
    # checkpoint of the same recipe)
    known_early = True  # whether `complete` can be asked before the steps before it ran (for the estimate)
    records = True  # whether it has a fingerprint in pipeline.json (a step that always runs has none)
    # a measuring step (evaluations, timed rounds, exports): its work is counted by per-operation weights, it may
    # have a time budget for sequential rounds, and its estimate is rescaled by how the measuring steps that
    # finished compared to theirs. False: its work is training steps, counted exactly (training itself): no
    # budget, never rescaled, and not part of the rescaling
    measures = True

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str | None:
        """Its fingerprint from its config and `before` (the fingerprints of the steps before it); None: none."""
        return None

    def outputs(self, ctx: RunContext) -> list[Path]:
        """What it leaves (removed when it must run again under another fingerprint)."""
        return []

    def complete(self, ctx: RunContext) -> bool:
        """Whether what it leaves is all there (then a fresh fingerprint skips it)."""
        return False

    def label(self, ctx: RunContext) -> str:
        """The header the run prints (the key, or more once inputs are known)."""
        return self.key

    def skip_why(self, ctx: RunContext) -> str | None:
        """A reason not to run at all this time (printed), e.g. no pruning round within the loss budget."""
        return None

    def run(self, ctx: RunContext) -> None:
        raise NotImplementedError

    def reuse(self, ctx: RunContext) -> None:
        """Called when a complete step is skipped: load what later steps need from what it left."""

    def recorded_outputs(self, ctx: RunContext) -> list[Path]:
        """The folders recorded with its fingerprint after it ran."""
        return self.outputs(ctx)

    def work(self, plan: Plan) -> float | None:
        """Its expected work in training steps of the recipe (None: not estimated)."""
        return None

    def budget(self, plan: Plan) -> float:
        """Seconds of sequential rounds after the first look it may spend (0 with fixed rounds)."""
        return 0.0

    def describe(self, plan: Plan) -> dict[str, Any]:
        """What `effkit run --dry-run` prints for it: stage, what, leaves."""
        return {"stage": self.key, "what": "", "leaves": ""}


class Stage:
    """A stage of `effkit run`: its name (the recipe's `stages` entry and its [table]), how it reads the recipe,
    and its steps."""

    name: str = ""
    # whether it runs the recipe's training steps, whose time is the unit of the run's estimate: the run times
    # them as they go (leaving out `untimed_steps`) or reads the time off what it left (`step_time`); one stage
    # does (training), whether or not the recipe lists it (an earlier run's training report still tells the time)
    measures_step_time = False

    def untimed_steps(self, plan: Plan) -> int:
        """Of the stage that measures the step time: its first steps, which the timing leaves out (warm-up)."""
        return 0

    def step_time(self, plan: Plan, report: dict[str, Any] | None = None) -> tuple[float, str] | None:
        """Of the stage that measures the step time: (seconds of one training step, how it was measured) read off
        a finished training's `report` (default: the report it left in this run's folders, if any); None when
        that says nothing."""
        return None

    def training_steps(self, plan: Plan) -> int:
        """Of the stage that measures the step time: the training steps the recipe asks for (0: bounded otherwise,
        by tokens or time, which no time budget shortens)."""
        return 0

    def fewest_training_steps(self, plan: Plan) -> int:
        """Of the stage that measures the step time: the fewest training steps a time budget may leave (e.g. past
        the learning-rate warm-up)."""
        return 1

    def with_training_steps(self, plan: Plan, steps: int) -> None:
        """Of the stage that measures the step time: train `steps` instead of the recipe's (its schedule built for
        them), in `plan` (before fingerprints and estimates are taken from it)."""

    def probe_step_time(self, plan: Plan) -> tuple[float | None, str]:
        """Of the stage that measures the step time: (seconds of one training step, how it was predicted) before
        training, for the time budget; (None, why not) where it cannot be predicted so."""
        return None, "this stage cannot time a training step before training"

    def schedule_free_steps(self, plan: Plan) -> int:
        """Of the stage that measures the step time: the first training steps whose learning rate does not depend on
        how many steps are trained (the warm-up): until the last of them, a time budget may re-fit the steps from
        training's own step time without changing any learning rate already used."""
        return 0

    def with_share(self, plan: Plan, share: float) -> dict[str, Any]:
        """Of a measuring stage: run on `share` (at most 1) of what the recipe gives it (its time budgets for
        sequential rounds, rounds, fine-tuning steps: what its estimate counts), none below its floor, in `plan`
        (whose configs are the recipe's); returns what it gets now, for the run's report ({}: nothing to share)."""
        return {}

    def configure(self, plan: Plan) -> None:
        """Read and check this stage's recipe table into `plan.configs[self.name]` (before anything runs)."""

    def steps(self, plan: Plan) -> list[Step]:
        """The steps it runs when the recipe lists it."""
        return []

    def memory_plans(self, plan: Plan, shapes: ShapeRun) -> list[tuple[str, str, Any]]:
        """`effkit run --plan`: this stage's memory plans for the recipe, as (label, what, plan), each plan a
        `stageplan.StagePlan` made as the stage makes its own before loading, from
        the shape-only artifacts in `shapes` (`effkit.runplan`), to which it adds those it would leave for the
        stages after it. None by default."""
        return []

    def fingerprints(self, plan: Plan, before: dict[str, str]) -> dict[str, str]:
        """Fingerprints of its steps (even when the recipe leaves it out, if later stages depend on them)."""
        if self.name not in plan.stages:
            return {}
        out = {}
        for s in self.steps(plan):
            fp = s.fingerprint(plan, {**before, **out})
            if fp is not None:
                out[s.key] = fp
        return out


# ------------------------------------------------------------------------------ the pruning rounds a run made
def pruning_rounds(plan: Plan) -> list[dict[str, Any]]:
    """Every complete pruning round of the run: its tag, mode label, size, loss against the dense model it was
    pruned from (`train`: the model the user has) and whether the upper end of that paired interval is within
    `max_loss_increase`, with its dense control's share beside it."""
    budget = plan.run.pipeline.max_loss_increase
    rows = []
    for cfg in plan.prune.values():
        for r in range(1, cfg.method.rounds + 1):
            d = plan.layout.artifact(artifacts.prune_tag(cfg.label, r))
            if not complete(d):
                continue
            m = artifacts.read_meta(d)["metrics"]
            delta = results.LossDelta.of(m[results.EVAL_LOSS_DELTA_VS_DENSE])
            control = m.get(results.EVAL_LOSS_DELTA_VS_CONTROL)
            rows.append({"tag": d.name, "label": cfg.label, "size_bytes": artifacts.dir_size(d),
                         "loss_delta": delta.delta, "loss_delta_ci95": list(delta.ci95), "vs": "dense parent",
                         "loss_delta_vs_control": results.LossDelta.of(control).delta if control else None,
                         f"{results.LATENCY_B12}_s": m[results.LATENCY_B12]["p50_s"],
                         "within_budget": delta.verdict != results.INVALID and delta.ci95[1] <= budget})
    return rows


def most_compressed(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Among rounds within the budget: the smallest folder (parameters really removed), then the lowest latency."""
    within = [r for r in rows if r["within_budget"]]
    return min(within, key=lambda r: (r["size_bytes"], r[f"{results.LATENCY_B12}_s"])) if within else None


def best_of_each_mode(plan: Plan) -> dict[str, str]:
    """Each pruning mode's most compressed round within the budget, or, where none is, its least damaged round
    (the lowest loss): the round of that mode a user would look at."""
    rows = pruning_rounds(plan)
    best = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        best[label] = (most_compressed(mine) or min(mine, key=lambda r: r["loss_delta"]))["tag"]
    return best
