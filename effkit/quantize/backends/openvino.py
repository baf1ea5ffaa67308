"""`openvino`: the model converted by OpenVINO's PyTorch front end into the stateful layout `optimum-cli export
openvino` writes, its weights compressed by NNCF (`--weight-format int8` by default, or `int4`), and run by
OpenVINO's CPU plug-in in the `--inference-precision` it names: `bf16` (the matrix units: AMX, or AVX-512 BF16),
`f32`, or `auto`, which times both on this CPU at the workload the run optimizes for and keeps bf16 only
where it is measurably faster (a CPU without native bf16 is "f32: bf16 not run: <reason>"). The loss of whatever is
chosen is measured like every artifact's. The folder loads in plain OpenVINO (`effkit.engines.openvino`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
ov_export = lazy_module("effkit.engines.openvino")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend openvino`'s own options (flags, recipe keys and --help lines come from here)."""

    weight_format: str = field(default="int8", metadata={
        "help": "openvino: the stored weights (NNCF): int8 or int4 (fp32 weights: effkit export --format openvino)",
        "choices": ("int8", "int4")})
    inference_precision: str = field(default="auto", metadata={
        "help": "openvino: inference precision: auto (bf16 only where measured faster on this CPU), bf16 or f32",
        "choices": ("auto", "bf16", "f32")})


def choose_precision(folder: Path, tokenizer, workload: str) -> tuple[str, dict[str, Any]]:
    """bf16 or f32 for the artifact in `folder`, by paired interleaved timing of both at `workload` on this CPU
    (the bench's sequential rule, `effkit.measure.stopping`, with a short budget); bf16 only where faster."""
    from effkit import workloads
    from effkit.engines.openvino import ENGINE, OpenVINOCausalLM, bf16_unavailable
    from effkit.measure import metrics, stopping
    from effkit.measure.results import PairedRatio

    if reason := bf16_unavailable():
        return "f32", {"choice": "f32", "how": f"bf16 not run: {reason}"}
    w = workloads.get(workload)
    models = {p: OpenVINOCausalLM(folder, precision=p) for p in ("f32", "bf16")}
    if w.kind == "decode":
        new = min(32, metrics.generation_budget(models["f32"], tokenizer, w.tokens or 32)[0])
        fns = {p: ENGINE.decode(m, tokenizer, w.batch, new) for p, m in models.items()}
    else:
        fns = {p: ENGINE.prefill(m, w.batch, w.tokens or min(128, models["f32"].config.n_positions))
               for p, m in models.items()}
    rule = stopping.Stopping(rounds=3, precision=0.03, budget_s=10.0)
    m = stopping.measure(fns, rule, 1, warmup=1)
    ratio = m.ratio("f32", "bf16", higher_is_better=w.higher_is_better)
    verdict = PairedRatio.of(ratio)
    choice = "bf16" if verdict.verdict == "faster" else "f32"
    return choice, {"choice": choice, "workload": w.name, "bf16_vs_f32": ratio, "rounds": m.record["rounds"],
                    "how": f"bf16 vs f32 inference at {w.name}: {verdict.fmt()} over {m.record['rounds']} paired "
                           f"rounds ({rule.describe()}); " + ("bf16: faster" if choice == "bf16" else
                                                              "f32: bf16 not measurably faster")}


class OpenVINO:
    name = "openvino"
    options = Options
    summary = "OpenVINO (NNCF int8 weights by default; bf16 inference where measured faster)"
    format = "openvino"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return ov_export.PORTABILITY

    def available(self, device: torch.device | None = None) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs OpenVINO artifacts on the CPU only; use --device cpu"
        if reason := ov_export.ov_unavailable():
            return reason
        try:
            import nncf  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"nncf does not import ({type(e).__name__}: {str(e)[:80]}); pip install 'effkit[quant]'"
        return None

    def refuses(self, cfg) -> str | None:
        o = cfg.options
        if o.weight_format not in ("int8", "int4"):
            return (f"unknown --weight-format {o.weight_format!r}; choose int8 or int4 (fp32 weights: effkit export "
                    "--format openvino)")
        if o.inference_precision not in ov_export.PRECISIONS:
            return (f"unknown --inference-precision {o.inference_precision!r}; choose one of "
                    f"{', '.join(ov_export.PRECISIONS)}")
        if o.inference_precision == "bf16" and (reason := ov_export.bf16_unavailable()):
            return f"--inference-precision bf16: {reason}; use f32 or auto"
        return None

    def tag(self, cfg) -> str:
        o = cfg.options
        return ("quantize-openvino" + ("" if o.weight_format == "int8" else f"-{o.weight_format}")
                + ("" if o.inference_precision == "auto" else f"-{o.inference_precision}"))

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        import json

        o = cfg.options
        asked = o.inference_precision
        desc = ov_export.write_artifact(folder, parent, tokenizer, o.weight_format, "f32" if asked == "auto" else asked)
        if asked == "auto":
            choice, how = choose_precision(folder, tokenizer, cfg.method.optimize_for)
            desc.update(inference_precision=choice, precision_how=how["how"], precision_choice=how)
            desc["runtime"] = desc["runtime"].replace("INFERENCE_PRECISION_HINT: f32",
                                                      f"INFERENCE_PRECISION_HINT: {choice}")
            (folder / ov_export.OV_DESC).write_text(json.dumps(desc, indent=2))
        counts = desc["weight_types"]
        return {"format": self.format, "include_head": True, "openvino": desc,
                "layers": [f"{k} matrices: {v}" for k, v in counts.items()],
                "storage": f"OpenVINO IR (openvino_model.xml/.bin), weights {o.weight_format} "
                           f"({desc.get('compression', 'uncompressed')}), inference in {desc['inference_precision']}"
                           f" ({desc['precision_how'] or 'as asked'})"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return ov_export.OpenVINOCausalLM(folder)

    def quantized_layers(self, model: nn.Module) -> int:
        return ov_export.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return ov_export.ENGINE.load_command(folder)


BACKEND = OpenVINO()
