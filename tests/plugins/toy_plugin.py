"""A plug-in written outside effkit's package, as a user's package would be: a toy engine, a toy workload, a toy
stage and a toy quantization backend option, registered when this module is imported. The tests name it in
$EFFKIT_PLUGINS (so the bench's fresh processes see it too); nothing in effkit names any of them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit import engines, workloads
from effkit.registry import BACKENDS, STAGES
from effkit.stage import Plan, RunContext, Stage, Step, fingerprint

# --------------------------------------------------------------------------------------------- an engine
TOY_MARKER = "toy.json"


class ToyEngine(engines.Engine):
    """Runs the reference's own weights in PyTorch, with a marker file of its own: enough for the bench to load,
    time and compare it as a peer. Its timers count their calls in the marker, so a test can see they ran."""

    name = "toy"
    label = "Toy"
    noun = "a toy"
    marker = TOY_MARKER
    summary = "a toy engine (PyTorch underneath)"
    peer_tag = "peer-toy"
    peer_how = "the reference's weights saved again, run by the toy engine"

    def available(self, device: Any = None, **options: Any) -> str | None:
        return None

    def write_peer(self, folder: Path, reference: Path, model: Any, tokenizer: Any) -> dict[str, Any]:
        import shutil

        for f in Path(reference).iterdir():  # the reference's Hugging Face files (not its effkit.json)
            if f.is_file() and f.name != "effkit.json":
                shutil.copy(f, folder / f.name)
        desc = {"format": "toy", "params": sum(p.numel() for p in model.parameters())}
        (folder / TOY_MARKER).write_text(json.dumps(desc))
        return desc

    def load(self, path: Path, device: Any):
        from effkit.model import load_model

        model = load_model(str(path)).to(device)
        model.toy_folder = Path(path)
        return model

    def decode(self, model: Any, tokenizer: Any, batch: int, new_tokens: int, generate_kwargs=None):
        timer = super().decode(model, tokenizer, batch, new_tokens, generate_kwargs)
        folder = Path(os.environ.get("TOY_CALLS_DIR", model.toy_folder))

        def counted():
            calls = folder / f"decode_b{batch}.calls"
            calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
            return timer()

        counted.settle_s = getattr(timer, "settle_s", 0.0)
        return counted


engines.register(ToyEngine())

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
