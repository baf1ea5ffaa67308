"""`effkit run`: the whole pipeline from one recipe (train -> prune -> quantize -> bench -> report), resumable.

One loop over the recipe's stages (`effkit.stage`: each stage gives its steps; the registry `effkit.registry.STAGES`
says which exist and their order); this module never names a stage. A step is complete when what it leaves exists
(folders appear by an atomic rename, so existing means complete) and the fingerprint it ran with (its recipe
section and its parents' fingerprints, in `runs/<run>/pipeline.json`) matches the recipe's now: complete steps are
skipped; a step whose recipe section or parent changed runs again, with every step after it, and says so; an
interrupted step starts again from scratch (training resumes from its checkpoint when that was made by the same
recipe); `--force` redoes everything. With a time budget ([run] `time_budget_min`), the whole run is shared among
its stages before training starts (`fit_time_budget`: the step time `train --plan` predicts, the whole run
predicted the way `Eta` predicts it; training and every measuring stage on one share of what the recipe gives them,
the largest that fits, never under a fifth: `HOW_SHARED`; where even that does not fit, a typed budget is refused
in one line and the recipe's own said to be over),
re-fitted once from training's own first steps while the learning rate warms up (`refit_time_budget`), kept in
`pipeline.json` and reused on resume, so that fingerprints and the estimate see what is run. While it
runs, `Eta` prints the expected time of every step (its work in training steps, times the step time that the stage
declaring `measures_step_time` lets it measure for training, and for a measuring step the seconds fitted for it
times this machine's measured speed against the fitting one's (`machine_factor`), plus a share of its time
budget), updates it as steps finish and writes it to `eta.json`. The run ends with one line: the fastest artifact
within the loss budget, how it compares, and how to load it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any

from rich.console import Console

from effkit import artifacts
from effkit.config import RunConfig, build_config, load_recipe
from effkit.errors import EffkitError
from effkit.measure import machine_cache
from effkit.registry import STAGES
from effkit.stage import Plan, RunContext, Stage, Step, costs, fingerprint

RECORD = "pipeline.json"  # in the run folder: each step's fingerprint and the folders it left
SCHEDULE = "time_budget"  # its entry holding the time budget's decision (no step has this name)
# a time budget trains at least this share of the recipe's steps: below it the model is not the recipe's any more (a
# run still over its budget says so)
FEWEST_SHARE = 0.2
# The rounds after a comparison's first look run until it is decided, within its time budget (seconds, the same on
# every machine): most comparisons decide well before their budget runs out, so the estimate counts this share of
# the budgets, the share a quickstart used (docs/benchmarks.md); the rescaling as steps finish corrects the rest
BUDGET_USED = 0.35


def make_plan(recipe: str, overrides: dict[str, Any] | None = None) -> Plan:
    """Read and validate the whole recipe before anything runs: [run] (with `overrides`, the command line's flat
    keys: `optimize_for`), then every stage's table, in order."""
    load_recipe(recipe)
    plan = Plan(recipe, build_config(RunConfig, recipe, dict(overrides or {})),
                budget_typed=bool((overrides or {}).get("time_budget_min")))
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


def expected_seconds(work: dict[str, float], budgets: dict[str, float], unit: float | dict[str, float],
                     leave_out: list[str] | tuple[str, ...] = ()) -> dict[str, float]:
    """The estimate of each step: its work times its seconds per unit of work (`unit`: one figure for every step, or
    each step's: `unit_seconds`), plus `BUDGET_USED` of its time budget for sequential rounds (what `Eta` prints and
    the time budget fits the training steps into)."""
    per = unit if isinstance(unit, dict) else dict.fromkeys(work, unit)
    return {k: w * per[k] + BUDGET_USED * budgets.get(k, 0.0) for k, w in work.items() if k not in leave_out}


# ------------------------------------------------------------------------------------------ this machine's speed
# The measuring steps (evaluations, exports, timed rounds of other engines) do not run training's code, so training's
# step time is no measure of their speed: it moves with training's code and its first steps while theirs stays (the
# runs in effkit/stage_costs.json's `measuring_s`). They are priced in seconds per unit of their work fitted on one
# machine, on another CPU times this machine's speed against that one: a short fixed piece of interpreter and
# single-threaded tensor work, timed in the thread's CPU seconds, which a busy moment at start-up does not inflate
# as it does wall time, the least of `REFERENCE_REPEATS`.
REFERENCE_REPEATS = 10


def reference_work() -> None:
    """The fixed work `reference_s` times: a Python loop and small matrix products on one thread."""
    import torch

    total = 0
    for i in range(100_000):
        total += i * i % 7
    a, b = torch.ones(192, 192) * 0.01, torch.eye(192)
    for _ in range(100):
        a = torch.tanh(a @ b)


def reference_s(repeats: int = REFERENCE_REPEATS) -> float:
    """Thread CPU seconds of `reference_work`, the least of `repeats` (torch on one thread while it runs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference_work()  # its first call loads what it uses
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            reference_work()
            times.append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return min(times)


@cache
def machine_factor() -> dict[str, Any]:
    """This machine's speed for the measuring steps against the machine their seconds were fitted on: 1 on the CPU
    they were fitted on (effkit/stage_costs.json's `measuring_s.cpu`, `cpu_identity`), else `reference_s` here over
    `measuring_s.reference_s` (1 where the file has none), measured once per process."""
    from effkit.measure.hardware import cpu_identity

    m = costs().get("measuring_s", {})
    fitted, cpu = m.get("reference_s"), cpu_identity()
    if cpu == m.get("cpu"):  # the reference's spread between idle runs on one machine is wider than a CPU's speed
        return {"factor": 1.0, "cpu": cpu, "how": "the seconds were fitted on this CPU: taken as they are"}
    here = reference_s()
    return {"factor": here / fitted if fitted else 1.0, "reference_s": here, "fitted_reference_s": fitted, "cpu": cpu,
            "how": "another CPU than the one the seconds were fitted on: scaled by the reference timing's ratio"}


def unit_seconds(plan: Plan, step_s: float, factor: float) -> dict[str, float]:
    """Seconds per unit of each step's work: a training step's time for training (counted exactly); for a
    measuring step, the seconds per unit of its work fitted for it (effkit/stage_costs.json's `measuring_s`, by run
    name and step, each step's runs apart: prune row and depth, quantize of the dense and the pruned parent; any
    other step their `default`) times this machine's `factor` (`machine_factor`); the training step where the file
    has none."""
    m, run = costs().get("measuring_s"), plan.run.pipeline.run_name
    return {s.key: m["steps"].get(f"{run}|{s.key}", m["default"]) * factor if s.measures and m else step_s
            for s in steps(plan)}


# ------------------------------------------------------------------------------------------ the caches steps fill
# the machine cache (`effkit.measure.machine_cache`) of the caches each step of a run consulted the last time it ran
# here, by run name and step: the keys the stages' own key functions gave, and what filling each cost then
STEP_CACHES = "run_caches"


def cache_fills(plan: Plan, keys: Any) -> dict[str, list[dict[str, Any]]]:
    """For each step of `keys`, the caches it will consult and whether each is warm now, with what a cold one adds
    to its work (`fill_steps`, in units of its work). Which caches and keys: those the step consulted the last time
    this run ran on this machine (`remember_caches`), each looked up as the stage looks it up (`machine_cached`, by the
    recorded key, so that age and `--remeasure` count); a cold one costs what filling it cost then. A step not run
    here before: the caches effkit/stage_costs.json's `step_caches` lists for it (by run name and step: what it
    filled in the runs fitted), cold, at its `cache_fill`."""
    fill = costs().get("cache_fill", {})
    out: dict[str, list[dict[str, Any]]] = {}
    for k in keys:
        rec, _ = machine_cache.machine_cached(STEP_CACHES, (which := f"{plan.run.pipeline.run_name}|{k}"), None)
        if rec is None:
            uses = [{"cache": c, "warm": False, "fill_steps": fill.get(c, 0.0),
                     "how": "not run here before: assumed cold, at effkit/stage_costs.json's `cache_fill`"}
                    for c in costs().get("step_caches", {}).get(which, [])]
        else:
            uses = [{**u, "warm": (warm := machine_cache.machine_cached(u["cache"], u["key"], None)[1]),
                     "fill_steps": 0.0 if warm else u.get("fill_steps") or fill.get(u["cache"], 0.0),
                     "how": "consulted the last time this step ran here; " + ("cached" if warm else "not cached")}
                    for u in rec]
        if uses:
            out[k] = uses
    return out


def with_fills(work: dict[str, float], fills: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Each step's work plus the cold caches it fills (`cache_fills`), in training steps."""
    return {k: w + sum(u["fill_steps"] for u in fills.get(k, []) if not u["warm"]) for k, w in work.items()}


def remember_caches(plan: Plan, key: str, consulted: list[dict[str, Any]], unit_s: float | None) -> list[dict]:
    """Record the caches step `key` consulted (`machine_cache.CONSULTED` while it ran), once each, with what filling
    each cost in units of its work (now, or when its entry was filled; `unit_s`: the step's seconds per unit,
    `unit_seconds`), for the next run's `cache_fills`."""
    uses: dict[tuple[str, str], dict[str, Any]] = {}
    for u in consulted:
        fill_s = u.get("fill_s", machine_cache.entry_of(u["cache"], u["key"]).get("fill_s"))
        uses.setdefault((u["cache"], u["key"]), {
            "cache": u["cache"], "key": u["key"], "warm": u["warm"], "fill_s": fill_s,
            "fill_steps": fill_s / unit_s if fill_s is not None and unit_s else None})
    machine_cache.keep(STEP_CACHES, f"{plan.run.pipeline.run_name}|{key}",  # none is a record too
                       [{k: v for k, v in u.items() if k != "warm"} for u in uses.values()])
    return list(uses.values())


# ------------------------------------------------------------------------------------------ the time budget
def step_grain(steps: int) -> int:
    """The step counts a time budget chooses among: multiples of 50 for a schedule of 1,000-9,999 steps (5 for
    100-999, 500 for 10,000-99,999), so that the choice moves in round steps, not with every wobble of the
    measured step time."""
    return max(1, 10 ** (len(str(steps)) - 2) // 2)


def shared(plan: Plan, timer: Stage, steps: int) -> tuple[Plan, dict[str, Any]]:
    """A copy of `plan`, from the recipe's configs, that trains `steps` of the recipe's training steps and gives
    every measuring stage the same share of what the recipe gives it, `steps` / the recipe's steps (each down to its
    own floors: `Stage.with_share`); and what each stage gets, by stage (the run's report records it)."""
    base = plan.unshared or plan.configs
    trial = Plan(plan.recipe, plan.run, dict(base), unshared=dict(base))
    share = min(1.0, steps / timer.training_steps(trial))
    timer.with_training_steps(trial, steps)
    shares: dict[str, Any] = {timer.name: {"share": share, "training_steps": steps}}
    for name in STAGES.names():
        st = STAGES.get(name)
        if st is not timer and name in plan.stages and (got := st.with_share(trial, share)):
            shares[name] = {"share": share, **got}
    return trial, shares


def predicted_total(plan: Plan, timer: Stage, train_steps: int, step_s: float,
                    fills: dict[str, list[dict[str, Any]]] | None = None, factor: float | None = None) -> float:
    """Seconds the whole run is expected to take on this machine with `train_steps` training steps and every
    measuring stage on the same share (`shared`), by the model `Eta` prints (on a copy of the plan), the cold caches
    `fills` included; the measuring steps at this machine's `factor` (default: `machine_factor`)."""
    trial, _ = shared(plan, timer, train_steps)
    units = unit_seconds(plan, step_s, machine_factor()["factor"] if factor is None else factor)
    return sum(expected_seconds(with_fills(stage_work(trial), fills or {}), stage_budgets(trial), units).values())


# seconds a run spends outside its steps' estimates with its caches warm (starting, the imports, the report, the last
# lines), fitted by benchmarks/stage_costs.py from runs' wall times (`outside_s`); the time budget counts them, and
# what filling the caches consulted before training cost (the step-time prediction's), measured then
OUTSIDE_S = float(costs().get("outside_s", 30.0))
# the share of the budget the chosen steps leave unused, so that a run the estimate under-predicts still ends within
# it: the largest under-prediction of the runs effkit/stage_costs.json is fitted from, each predicted from the others
# (`python benchmarks/stage_costs.py --check`, its `margin_needed`), rounded up
BUDGET_MARGIN = 0.07
# the step time predicted before training and training's own disagree when one is more than this much above the other
PROBE_TOLERANCE = 0.25
# the machine cache of the step time a run's training measured in its own first steps after a given prediction made
# before training: a prediction read from its cache is off the same way the next time, so the next run here uses it
PROBE_VS_TRAINING = "step_time_vs_prediction"
# the fewest steps of training's own a re-fit is made from (when the warm-up ends before the estimate's 20)
REFIT_FEWEST = 5
HOW_SHARED = (f"one share for every stage: training the largest multiple of the grain (`step_grain`) up to the "
              f"recipe's steps, every measuring stage that share of its recipe's time budgets, bench rounds and "
              f"fine-tuning steps, quantize auto that share of the backends that run here and the bench that share "
              f"of the peers (those measured fastest before first: effkit/stage_costs.json; the others listed as "
              f"not run: budget share) (each down to its floor), whose whole run, predicted as each step's work in "
              f"training steps (its weights from effkit/stage_costs.json, for what it runs at that share) x the "
              f"step time for training, x the seconds fitted for each measuring step there x this machine's speed "
              f"against that one's (`machine_factor`) for the others (+ the caches it consults that are cold here, "
              f"at what filling them cost) + {BUDGET_USED:.0%} "
              f"of each measuring step's time budget + {OUTSIDE_S:.0f} s outside the steps (+ what filling the "
              f"caches consulted before training cost), fits the budget less {BUDGET_MARGIN:.0%} (the largest "
              f"under-prediction of the runs fitted, each predicted from the others); the share is never under "
              f"{FEWEST_SHARE:.0%} (nor training past its warm-up): where even that is predicted over the budget, "
              "a budget typed on the command line is refused before training, and the recipe's own is said to be "
              "over before training and the run goes on at the floors")


def choose_steps(full: int, fewest: int, total: Any, budget_s: float) -> int:
    """The largest round count of training steps (`step_grain`) up to the recipe's `full` whose predicted `total`
    (seconds, a function of the steps) fits `budget_s`; `full` when it fits; never under `fewest` (rounded up)."""
    if total(full) <= budget_s:
        return full
    g = step_grain(full)
    floor = min(full, -(-fewest // g) * g)
    return next((n for n in range(full // g * g, floor - 1, -g) if n < full and total(n) <= budget_s), floor)


def decide(plan: Plan, timer: Stage, step_s: float, budget_min: float,
           outside_s: float | None = None, factor: float | None = None) -> dict[str, Any]:
    """The time budget's choice for a training step of `step_s` seconds (`HOW_SHARED`): the training steps, the
    share every stage gets and what that is (`shares`), each step's predicted seconds (`stage_s`, its cold caches'
    fills included: `caches`, by step), the whole run's with the recipe's steps and with those (`predicted_full_s`,
    `predicted_s`, `outside_s` seconds outside the steps included); `fits`: within the budget itself. The measuring
    steps are priced at this machine's `factor` (default: `machine_factor`, measured now; both recorded)."""
    outside_s = OUTSIDE_S if outside_s is None else outside_s
    speed = machine_factor() if factor is None else {"factor": factor}
    units = unit_seconds(plan, step_s, speed["factor"])
    full = timer.training_steps(Plan(plan.recipe, plan.run, dict(plan.unshared or plan.configs)))
    fills = cache_fills(plan, stage_work(plan))
    total = lambda n: predicted_total(plan, timer, n, step_s, fills, speed["factor"]) + outside_s  # noqa: E731
    fewest = max(math.ceil(FEWEST_SHARE * full), timer.fewest_training_steps(plan))
    steps = choose_steps(full, fewest, total, budget_min * 60 * (1 - BUDGET_MARGIN))
    trial, shares = shared(plan, timer, steps)
    return {"steps": steps, "share": shares[timer.name]["share"], "shares": shares,
            "stage_s": expected_seconds(with_fills(stage_work(trial), fills), stage_budgets(trial), units),
            "caches": priced(fills, units), "outside_s": outside_s, "machine": speed, "seconds_per_unit": units,
            "predicted_full_s": total(full), "predicted_s": total(steps), "fits": total(steps) <= budget_min * 60}


def priced(fills: dict[str, list[dict[str, Any]]], units: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
    """`cache_fills` as the reports keep it: each cache warm or cold and the seconds it adds (`added_s`, at its
    step's seconds per unit: `unit_seconds`; 0 where none is known yet)."""
    return {k: [{**u, "added_s": 0.0 if u["warm"] else u["fill_steps"] * units.get(k, 0.0)} for u in uses]
            for k, uses in fills.items()}


def apply_decision(plan: Plan, timer: Stage, decision: dict[str, Any]) -> None:
    """Train the decision's steps, every measuring stage on its share, in `plan` (from the recipe's configs)."""
    plan.configs = shared(plan, timer, decision["steps"])[0].configs


def _decide_before_training(plan: Plan, timer: Stage, console: Console, budget: float, full: int,
                            key: str) -> dict[str, Any]:
    """The decision from the step time predicted before training (`Stage.probe_step_time`; where this run's training,
    `key`, trained here before after the same prediction, the step time its own steps measured then:
    `PROBE_VS_TRAINING`); refused in one line where even the floors are predicted over the budget."""
    mark = len(machine_cache.CONSULTED)
    step_s, how = timer.probe_step_time(plan)
    filled = sum(u.get("fill_s", 0.0) for u in machine_cache.CONSULTED[mark:])  # spent now, so known exactly
    seen, _ = machine_cache.machine_cached(PROBE_VS_TRAINING, f"{plan.run.pipeline.run_name}|{key}", None)
    probe = step_s
    if step_s and seen and seen.get("probe_s") == step_s:  # the prediction was cached: so was its error here
        step_s = seen["training_s"]
        how += (f"; {step_s:.3f} s in training's own steps the last time this run trained here after this same "
                f"prediction ({probe:.3f} s): that is used")
    if step_s is None or step_s <= 0:
        console.print(f"time budget {budget:g} min: not decided before training ({how}); training's own first steps "
                      f"decide it, all {full:,} steps until then", highlight=False)
        return {"how_chosen": f"not decided before training: {how}; re-fitted from training's own first steps",
                "share": 1.0}
    d = {**decide(plan, timer, step_s, budget, OUTSIDE_S + filled), "step_time_s": step_s, "step_time_how": how,
         "probe_step_time_s": probe, "how_chosen": HOW_SHARED}
    if not d["fits"]:
        over = (f"time budget {budget:g} min is too short for this run on this machine: even its floors "
                f"({d['steps']:,} of the recipe's {full:,} training steps, every measuring stage on {d['share']:.0%} "
                f"of its budgets) are predicted to take {_mins(d['predicted_s'])} (one training step {step_s:.3f} s, "
                f"{how}); --time-budget-min {math.ceil(d['predicted_s'] / 60 / (1 - BUDGET_MARGIN))} would fit them, "
                "or `effkit run --full` runs the recipe's whole schedule")
        if plan.budget_typed:
            raise EffkitError(over)
        console.print(f"warning: {over}; running at the floors (the recipe's budget is a target; a "
                      "--time-budget-min typed on the command line is refused instead)", highlight=False)
        return {**d, "over_budget": over}
    said = (f"time budget {budget:g} min: one training step {step_s:.3f} s ({how}); the recipe's {full:,} steps "
            f"predict {_mins(d['predicted_full_s'])} in all")
    if d["steps"] == full:
        said += f": within it, training all {full:,}"
    else:
        said += (f"; training {d['steps']:,} steps instead{_others(d)} (predicted {_mins(d['predicted_s'])}); "
                 f"`effkit run --full` trains all {full:,}")
    console.print(said, highlight=False)
    return d


def _others(d: dict[str, Any]) -> str:
    """What the decision `d` gives the measuring stages, for its line ("" where none runs)."""
    return f", every measuring stage on {d['share']:.0%} of its budgets" if len(d["shares"]) > 1 else ""


def _say_kept(console: Console, record: StageRecord, saved: dict[str, Any], full: int) -> None:
    why = (f"one training step {saved['step_time_s']:.3f} s, predicted then" if "step_time_s" in saved
           else saved.get("how_chosen", ""))
    if isinstance(saved.get("refit"), dict) and "training_step_time_s" in saved:
        why += f"; {saved['training_step_time_s']:.3f} s in training's own first steps"
    steps_now = (f"{saved['steps']:,} of the recipe's {full:,} steps" if saved["steps"] < full
                 else f"all {full:,} steps of the recipe")
    console.print(f"time budget {saved['budget_min']:g} min: training {steps_now}, as decided when this run started "
                  f"({why}; kept in {record.path})" + (f"; `effkit run --full` trains all {full:,}"
                                                       if saved["steps"] < full else ""), highlight=False)


def fit_time_budget(plan: Plan, record: StageRecord, console: Console) -> dict[str, Any] | None:
    """With [run] `time_budget_min`, the run shared among its stages, decided before training (`decide`, from the
    step time `Stage.probe_step_time` predicts) and re-fitted once from training's own first steps
    (`refit_time_budget`). The decision is kept in `pipeline.json` and reused while the recipe's training section and
    the budget stay the same (a resumed run does not measure again, so its fingerprints do not move); a training
    already complete with the recipe's own steps is kept. Sets `plan.schedule`, the training steps and the measuring
    stages' shares in `plan`, and prints one line; None where no budget applies. An `EffkitError` before anything is
    written where even the floors are predicted over the budget."""
    timer = step_timer(plan)
    if timer is None or (full := timer.training_steps(plan)) <= 0:
        return None
    plan.unshared = dict(plan.configs)
    mine = [s for s in timer.steps(plan) if s.records]
    key = fingerprint({s.key: record.now.get(s.key) for s in mine})  # the recipe's training, as resolved
    budget = plan.run.pipeline.time_budget_min
    saved = record.schedule
    if saved and saved.get("key") == key and saved.get("budget_min") == budget:
        apply_decision(plan, timer, saved)
        record.refresh()
        if budget > 0:
            plan.schedule = saved
            _say_kept(console, record, saved, full)
        return saved
    if timer.name not in plan.stages:
        return None  # nothing trains now; what an earlier run trained is judged by its fingerprint
    decision: dict[str, Any] = {"key": key, "budget_min": budget, "recipe_steps": full, "steps": full}
    if budget <= 0:  # recorded, so that a later run with the budget keeps a full training it finds complete
        record.keep_schedule({**decision, "how_chosen": "no time budget (--full or time_budget_min = 0)"})
        return None
    if mine and all(record.fresh(s.key) and s.complete(RunContext(plan, console, None)) for s in mine):
        decision.update(how_chosen="trained before with the recipe's full schedule: kept, nothing measured",
                        refit="not needed: the training is complete")
        console.print(f"time budget {budget:g} min: the training is already complete with all {full:,} steps of the "
                      "recipe: kept", highlight=False)
    else:
        decision.update(_decide_before_training(plan, timer, console, budget, full, key))
        apply_decision(plan, timer, decision)
    record.keep_schedule(decision)
    plan.schedule = decision
    return decision


def refit_time_budget(plan: Plan, record: StageRecord, console: Console, step: int, step_s: float | None,
                      how: str) -> int | None:
    """Once per decision, from training's own first steps (`Eta`, before the warm-up ends: `schedule_free_steps`):
    the decision made again (`decide`) with training's step time `step_s` in place of the one predicted before
    training, both recorded, with `probe_disagrees` where one is more than `PROBE_TOLERANCE` above the other; the
    training steps (never under the floor, never past the recipe's) and the measuring stages' shares follow it.
    Returns the training steps where they changed (the trainer rebuilds its schedule for them), else None. With
    `step_s` None, records `how` (why no re-fit was made)."""
    d, timer = plan.schedule, step_timer(plan)
    if not d or not d.get("budget_min") or "refit" in d or timer is None:
        return None
    if step_s is None or step_s <= 0:
        d["refit"] = f"not re-fitted: {how}"
        record.keep_schedule(d)
        return None
    new = decide(plan, timer, step_s, d["budget_min"], d.get("outside_s", OUTSIDE_S),
                 d.get("machine", {}).get("factor"))
    d.update(training_step_time_s=step_s, training_step_time_how=how, probe_tolerance=PROBE_TOLERANCE)
    if d.get("probe_step_time_s"):  # what the next run here predicts before training (`_decide_before_training`)
        machine_cache.keep(PROBE_VS_TRAINING, f"{plan.run.pipeline.run_name}|{d['key']}",
                           {"probe_s": d["probe_step_time_s"], "training_s": step_s})
    if d.get("step_time_s"):
        d["probe_over_training"] = d["step_time_s"] / step_s
        d["probe_disagrees"] = max(d["probe_over_training"], 1 / d["probe_over_training"]) > 1 + PROBE_TOLERANCE
    before = d["steps"]
    d["refit"] = {"at_step": step, "steps_before": before, "share_before": d.get("share", 1.0),
                  **{k: new[k] for k in ("steps", "predicted_full_s", "predicted_s", "fits")}}
    d.update(steps=new["steps"], share=new["share"], shares=new["shares"], stage_s=new["stage_s"],
             caches=new["caches"], seconds_per_unit=new["seconds_per_unit"])
    apply_decision(plan, timer, d)
    record.keep_schedule(d)
    for s in timer.steps(plan):  # the training under way now runs with the re-fitted steps: its fingerprint too
        if s.key in record.stages:
            record.stages[s.key]["fingerprint"] = record.now[s.key]
    record.save()
    flag = (f"; the step time predicted before training ({d['step_time_s']:.3f} s) was off by more than "
            f"{PROBE_TOLERANCE:.0%}" if d.get("probe_disagrees") else "")
    console.print(f"time budget {d['budget_min']:g} min re-fitted from training's own steps ({step_s:.3f} s a step, "
                  f"{how}){flag}: " + (f"training {new['steps']:,} steps instead of {before:,}{_others(new)}"
                                       if new["steps"] != before else f"{before:,} training steps kept")
                  + f" (predicted {_mins(new['predicted_s'])})",
                  highlight=False)
    return new["steps"] if new["steps"] != before else None


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
        self.schedule: dict[str, Any] | None = self.stages.pop(SCHEDULE, None)  # the time budget's decision

    def keep_schedule(self, decision: dict[str, Any]) -> None:
        """Record the time budget's decision; the fingerprints are taken again (the training steps may differ)."""
        self.schedule = decision
        self.refresh()
        self.save()

    def refresh(self) -> None:
        """Take the fingerprints again, from the plan as it is now (the time budget changed its training steps)."""
        self.now = fingerprints(self.plan)

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
            kept = {**self.stages, **({SCHEDULE: self.schedule} if self.schedule else {})}
            artifacts.atomic_write_text(self.path, json.dumps(kept, indent=2))


class Eta:
    """The expected time of every stage on this machine, printed once the training step time is measured and
    updated as stages finish; written to `eta.json` (predicted at the first estimate against actual)."""

    def __init__(self, plan: Plan, console: Console):
        self.plan, self.console = plan, console
        self.fills = cache_fills(plan, stage_work(plan))  # the cold caches each step fills: priced before it runs
        self.used: dict[str, list[dict[str, Any]]] = {}  # the caches each step consulted as it ran
        self.work = with_fills(stage_work(plan), self.fills)
        self.budgets = stage_budgets(plan)
        self.exact = {s.key for s in steps(plan) if not s.measures}  # work counted exactly: never rescaled
        self.timer = step_timer(plan)
        # this machine's speed for the measuring steps: the time budget's (decided with it), else measured now
        self.factor: float = (plan.schedule or {}).get("machine", {}).get("factor") or machine_factor()["factor"]
        self.units: dict[str, float] = {}  # seconds per unit of each step's work, once the step time is known
        self.step_s: float | None = None
        self.how: str | None = None  # how the step time was measured
        self.first: dict[str, float] = {}  # the first prediction, seconds per stage
        self.actual: dict[str, float] = {}
        self.skipped: list[str] = []
        self.start = time.time()
        self._steps: list[float] = []
        self.clock = time.perf_counter
        # the time budget's re-fit (`refit_time_budget`: (step, step time or None, how) -> the new training steps or
        # None), made once from these timings; None: nothing to re-fit
        self.refit: Callable[[int, float | None, str], int | None] | None = None

    def on_train_step(self, step: int, _loss: float) -> int | None:
        """Time the first training steps (after the warm-up ones): the estimate is printed once 20 are seen. The
        time budget is re-fitted from them once, by the last step whose learning rate does not depend on the steps
        trained (`schedule_free_steps`): at the estimate's 20 steps, or at that step from at least `REFIT_FEWEST`;
        returns the training steps it re-fitted, if they changed."""
        self._steps.append(self.clock())
        skip = self.timer.untimed_steps(self.plan) if self.timer else 0
        timed = len(self._steps) - skip - 1
        median = (lambda: self._median(skip)) if timed > 0 else (lambda: None)  # noqa: E731
        how = f"the median of training steps {skip + 2}-{step}"
        refitted = None
        if self.refit is not None:
            free = self.timer.schedule_free_steps(self.plan)
            if step <= free and (timed >= 20 or (step == free and timed >= REFIT_FEWEST)):
                refitted, self.refit = self.refit(step, median(), how), None
            elif step >= free:
                self.refit, _ = None, self.refit(step, None, f"the warm-up ({free} steps) ended before {REFIT_FEWEST} "
                                                            f"steady training steps were timed (at step {step})")
            if refitted:  # the steps and the measuring stages' shares changed: so did their work
                self.work, self.budgets = with_fills(stage_work(self.plan), self.fills), stage_budgets(self.plan)
        if self.step_s is None and timed >= 20:
            self.set_step_time(median(), how)
        return refitted

    def _median(self, skip: int) -> float:
        gaps = sorted(b - a for a, b in zip(self._steps[skip:-1], self._steps[skip + 1:], strict=True))
        return gaps[len(gaps) // 2]

    def set_step_time(self, seconds: float, how: str) -> None:
        if self.step_s is not None or seconds <= 0:
            return
        self.step_s, self.how = seconds, how
        self.units = unit_seconds(self.plan, seconds, self.factor)
        self.first = expected_seconds(self.work, self.budgets, self.units, self.skipped)
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

    def consulted(self, name: str, uses: list[dict[str, Any]]) -> None:
        """The caches step `name` consulted while it ran (`machine_cache.CONSULTED`): recorded for the next run's
        estimate (`remember_caches`) and in eta.json."""
        self.used[name] = remember_caches(self.plan, name, uses, self.units.get(name, self.step_s))

    def remaining(self, left: list[str]) -> dict[str, float]:
        """What is left, rescaled by how the finished measuring stages (all but those whose work is counted
        exactly: training) compared to their estimate."""
        done = [k for k in self.actual if k in self.first and k not in self.exact]
        scale = (sum(self.actual[k] for k in done) / sum(self.first[k] for k in done)) if done else 1.0
        return {k: self.first[k] * (1.0 if k in self.exact else scale) for k in left}

    def record(self) -> dict[str, Any]:
        return {"step_time_s": self.step_s, "step_time_how": self.how,
                "work_in_steps": self.work, "sequential_budgets_s": self.budgets, "predicted_s": self.first,
                "actual_s": self.actual, "wall_s": _process_s(),
                "skipped": self.skipped, "caches": priced(self.fills, self.units), "caches_used": self.used,
                "machine_factor": self.factor, "seconds_per_unit": self.units,
                **({"time_budget": {k: v for k, v in self.plan.schedule.items() if k != "key"}}
                   if self.plan.schedule else {}),
                "weights": costs(),
                "how": "each stage's work counted in training steps of the recipe (training and fine-tuning steps "
                       "exactly; evaluations, timed rounds, exports, each backend quantize auto writes and set-up by "
                       "the weights in `weights`, fitted from measured runs by benchmarks/stage_costs.py), times its "
                       "seconds per unit (`seconds_per_unit`: training's, the step time measured here; a measuring "
                       "stage's, the seconds fitted for it in `weights`' `measuring_s` x `machine_factor`, this "
                       "machine's speed against the one they were fitted on), plus "
                       f"{BUDGET_USED:.0%} of each measuring stage's time budget for the rounds after the first "
                       "look, plus what filling the caches it consults that are cold here cost (`caches`: by "
                       "step, each warm or cold and the seconds it adds; `caches_used`: what each consulted as it "
                       "ran, `fill_s` where it filled one); predicted = the first estimate, printed after the first "
                       "training steps; wall_s: since the process started"}

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


def _process_s() -> float:
    """Seconds since this process started (its imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


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
    record = StageRecord(plan, console)
    fit_time_budget(plan, record, console)  # before the steps, the estimate and the fingerprints are taken
    todo = steps(plan)
    ctx = RunContext(plan, console, Eta(plan, console))
    eta = ctx.eta
    if plan.schedule and plan.schedule.get("budget_min"):
        eta.refit = partial(refit_time_budget, plan, record, console)
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
        mark = len(machine_cache.CONSULTED)
        step.run(ctx)
        if step.key in eta.work:
            eta.consulted(step.key, machine_cache.CONSULTED[mark:])
        if step.records:
            record.done(step.key, step.recorded_outputs(ctx))
        done.append(step.label(ctx))
        if step.work(plan) is not None:
            eta.finished(step.key, time.perf_counter() - start)
        eta.write()
    return {"plan": rows, "done": done, "wall_s": time.perf_counter() - t0, "bench": ctx.results.get("bench"),
            "report": str(plan.report_dir / "summary.md"), "deliverable": ctx.results.get("deliverable"),
            "schedule": ctx.results.get("schedule"), "eta": eta.record()}
