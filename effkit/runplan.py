"""`effkit run --plan`: the whole recipe planned before anything runs (#47): each stage's memory plan (its largest
process, as the stage makes its own before loading) and the run's time (the model `effkit run` prints and fits its
time budget with: one training step timed now, each step's work in training steps, the measuring steps' budgets).

The stages after training plan from their input artifacts' shapes (config.json, safetensors headers, file sizes),
which do not exist before the run: each stage (`Stage.memory_plans`, in the registry's order) plans from the
shape-only artifacts the stages before it would leave (`artifacts.shape_only`: a safetensors header over a hole, in
a temporary folder) and adds its own: training the dense model, each prune mode its first round at the shape its cut
leaves (the largest round). What is not known before the run is planned at an upper bound where there is one
(quantize from the dense model), and what is left out is said in the notes (the bench's int8 artifacts).
Like `pipeline.py`, this module never names a stage."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from effkit.config import Folders
from effkit.registry import STAGES
from effkit.stage import Plan, ShapeRun


def _row(label: str, what: str, p: Any) -> dict[str, Any]:
    """A stage's line of the run's plan, from its `StagePlan`."""
    return {"stage": label, "what": what, "total_bytes": p.total_bytes, "required_bytes": p.required_bytes,
            "fits": p.fits, "verdict": p.verdict(), "device": p.device, "usable_bytes": p.usable_bytes}


def memory_rows(plan: Plan) -> tuple[list[dict[str, Any]], list[str]]:
    """Each stage's memory plans for the recipe (see the module's text), and the notes on what is bounded."""
    with tempfile.TemporaryDirectory(prefix="effkit-run-plan-") as tmp:
        folders = Folders(runs_dir=str(Path(tmp) / "runs"), reports_dir=str(Path(tmp) / "reports"))
        shapes = ShapeRun(folders, Path(folders.runs_dir) / plan.run.pipeline.run_name)
        rows = [_row(label, what, p) for name in STAGES.names()
                for label, what, p in STAGES.get(name).memory_plans(plan, shapes)]
    return rows, shapes.notes


def time_rows(plan: Plan) -> dict[str, Any]:
    """The run's time as `effkit run` predicts it before training (`effkit.pipeline`): one training step predicted
    now, the time budget's choice of steps and of every measuring stage's share, each step's seconds; `fits`: False
    where the run would refuse the budget before training."""
    from effkit import pipeline

    timer = pipeline.step_timer(plan)
    if timer is None:
        return {"how": "no stage times a training step: nothing to price the stages with"}
    full = timer.training_steps(plan)
    if full <= 0:
        return {"how": "not predicted: the recipe's training is bounded by tokens or time, not steps"}
    step_s, how = timer.probe_step_time(plan)
    if step_s is None or step_s <= 0:
        return {"how": f"not predicted: {how}"}
    budget = plan.run.pipeline.time_budget_min if timer.name in plan.stages else 0.0  # as `fit_time_budget`
    d = pipeline.decide(plan, timer, step_s, budget if budget > 0 else math.inf)  # no budget: the recipe's all
    under_way = (plan.run_dir / pipeline.RECORD).is_file()
    return {"step_s": step_s, "how": how, "recipe_steps": full, "steps": d["steps"], "budget_min": budget,
            "share": d["share"], "shares": d["shares"], "fits": d["fits"],
            "seconds": d["stage_s"], "total_s": d["predicted_s"], "under_way": under_way,
            "model": f"each step's work in training steps (effkit/stage_costs.json's weights, for what it runs at "
                     f"its share) x {step_s:.3f} s for training, x the seconds fitted for each measuring step x this "
                     f"machine's speed against the fitting one's ({d['machine']['factor']:.2f}) for the others + "
                     f"{pipeline.BUDGET_USED:.0%} of each "
                     f"measuring step's time budget + {pipeline.OUTSIDE_S:.0f} s outside the steps (the estimate "
                     "`effkit run` prints)" + (f"; {pipeline.HOW_SHARED}" if budget > 0 else "")}


def run_plan(recipe: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`effkit run --plan`: {"memory": rows, "notes": [...], "time": {...}}. The run's folders are not touched
    (the shapes lie in a temporary folder); the effkit cache keeps the probes and simulations, as each stage's
    `--plan` does; nothing is trained but the timed steps (the runtime probe's and the run's step probe)."""
    from effkit.pipeline import make_plan

    plan = make_plan(recipe, overrides)
    rows, notes = memory_rows(plan)
    return {"recipe": recipe, "run": plan.run.pipeline.run_name, "memory": rows, "notes": notes,
            "time": time_rows(plan)}
