"""A plug-in written outside effkit's package, as a user's package would be: a toy engine, a toy workload, a toy
stage and a toy quantization backend option, registered when this module is imported. The tests name it in
$EFFKIT_PLUGINS (so the bench's fresh processes see it too); nothing in effkit names any of them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import toy_engine  # noqa: F401 - an engine: one package, registered at its import as effkit's engine packages are

from effkit import workloads
from effkit.registry import BACKENDS, STAGES
from effkit.stage import Plan, RunContext, Stage, Step, fingerprint

# --------------------------------------------------------------------------------------------- a workload
TOY_WORKLOAD = workloads.register(workloads.Workload("decode-b2", "decode", 2, tokens=4))


# --------------------------------------------------------------------------------------------- a stage
@dataclass(frozen=True)
class ToyOptions:
    greeting: str = "hello"


class ToyStep(Step):
    key = "toy"

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str:
        return fingerprint("toy", plan.configs["toy"].greeting, before.get("bench"))

    def outputs(self, ctx: RunContext) -> list[Path]:
        return [ctx.plan.report_dir / "toy.json"]

    def complete(self, ctx: RunContext) -> bool:
        return (ctx.plan.report_dir / "toy.json").is_file()

    def run(self, ctx: RunContext) -> None:
        bench = ctx.results.get("bench") or {}
        out = {"greeting": ctx.plan.configs["toy"].greeting,
               "benched": [r["tag"] for r in bench.get("artifacts", [])],
               "deliverable": (ctx.results.get("deliverable") or {}).get("tag")}
        (ctx.plan.report_dir / "toy.json").write_text(json.dumps(out))

    def work(self, plan: Plan) -> float:
        return 1.0

    def describe(self, plan: Plan) -> dict[str, Any]:
        return {"stage": "toy", "what": "greets the bench", "leaves": str(plan.report_dir / "toy.json")}


class ToyStage(Stage):
    name = "toy"
    options = ToyOptions  # its recipe table, [toy]

    def configure(self, plan: Plan) -> None:
        from effkit.config import build_section

        plan.configs["toy"] = build_section(ToyOptions, plan.recipe, "toy")

    def steps(self, plan: Plan) -> list[Step]:
        return [ToyStep()]


STAGES.register(ToyStage())


# --------------------------------------------------------------------------------------------- a backend's options
@dataclass(frozen=True)
class ToyQuantOptions:
    toy_bits: int = field(default=3, metadata={"help": "toyq: bits per toy weight"})


class ToyBackend:
    """Only its options matter here: they must reach --help and recipe validation, declared nowhere else."""

    name = "toyq"
    summary = "a toy backend"
    options = ToyQuantOptions

    def available(self, device=None) -> str | None:
        return "a toy: never runs"


BACKENDS.register(ToyBackend())
