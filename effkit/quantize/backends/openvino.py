"""`openvino`: OpenVINO's format as its engine package writes it (`effkit.engines.openvino`, through `ENGINE.write`,
the writer `effkit export --format openvino` calls too): the stateful IR `optimum-cli export openvino` writes, its
weights compressed by NNCF (`--weight-format`; data-aware int4 calibrated on the run's training split, never its
held-out blocks), run in the `--inference-precision` it names (`auto`: timed on this CPU under the decision rule, a
tie to f32), with LLMPipeline's attention backend chosen the same way. The loss of whatever is chosen is measured
like every artifact's; the folder loads in plain OpenVINO with the settings it was measured with."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
ov = lazy_module("effkit.engines.openvino")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend openvino`'s own options (flags, recipe keys and --help lines come from here)."""

    weight_format: str = field(default="int8", metadata={
        "help": "openvino: the stored weights (NNCF): int8; int4 (symmetric, groups of 128 or 64/32 where 128 does "
                "not divide, data-free); int4-data "
                "(asymmetric int4 in groups of 128, or 64/32 where 128 does not divide, AWQ + scale estimation "
                "calibrated on 64 training blocks of the run's data, never held-out ones) (fp32 weights: effkit "
                "export --format openvino)",
        "choices": ("int8", "int4", "int4-data")})
    inference_precision: str = field(default="auto", metadata={
        "help": "openvino: inference precision: auto (bf16 only where measured faster on this CPU), bf16 or f32",
        "choices": ("auto", "bf16", "f32")})


class OpenVINO:
    name = "openvino"
    options = Options
    summary = "OpenVINO (NNCF int8 weights by default; bf16 inference where measured faster)"
    format = "openvino"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return ov.ENGINE.portability

    def available(self, device: torch.device | None = None) -> str | None:
        return ov.ENGINE.available(device) or ov.compress.nncf_unavailable()

    def weights(self, cfg) -> str:
        """The stored weights these options ask for (`--weight-format`)."""
        return cfg.options.weight_format

    def refuses(self, cfg) -> str | None:
        o, weights = cfg.options, ov.compress.WEIGHTS[1:]
        if o.weight_format not in weights:
            return (f"unknown --weight-format {o.weight_format!r}; choose {', '.join(weights)} (fp32 weights: effkit "
                    "export --format openvino)")
        if o.inference_precision not in ov.settings.PRECISIONS:
            return (f"unknown --inference-precision {o.inference_precision!r}; choose one of "
                    f"{', '.join(ov.settings.PRECISIONS)}")
        if o.inference_precision == "bf16" and (reason := ov.settings.bf16_unavailable()):
            return f"--inference-precision bf16: {reason}; use f32 or auto"
        return None

    def tag(self, cfg) -> str:
        o, weights = cfg.options, self.weights(cfg)
        return ("quantize-openvino" + ("" if weights == "int8" else f"-{weights}")
                + ("" if o.inference_precision == "auto" else f"-{o.inference_precision}"))

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        from effkit.measure import choice

        weights = self.weights(cfg)
        # the stage's own rule (its precision, its budget), capped: this is one setting of one folder
        rule = replace(choice.Rule.of(cfg.measure), budget_s=min(cfg.measure.budget_s, ov.tune.SETTING_BUDGET_S))
        desc = ov.ENGINE.write(folder, parent, tokenizer, weights, cfg.options.inference_precision,
                               cfg.method.optimize_for, rule, calibrate_on=(source, cfg.inputs.data), bandwidth=True)
        return {"format": self.format, "include_head": True, "openvino": desc,
                "layers": [f"{k} matrices: {v}" for k, v in desc["weight_types"].items()],
                "storage": f"OpenVINO IR (openvino_model.xml/.bin), weights {weights} "
                           f"({desc.get('compression', 'uncompressed')}), inference in {desc['inference_precision']}"
                           f" ({desc['precision_how'] or 'as asked'}), LLMPipeline attention "
                           f"{desc.get('attention')}"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return ov.OpenVINOCausalLM(folder)

    def quantized_layers(self, model: nn.Module) -> int:
        return ov.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return ov.ENGINE.load_command(folder)

    def memory(self, cfg) -> Memory:  # the figures behind these lines: docs/benchmarks.md
        return Memory(write=(81, 3.57), loaded=(194, 1.34), beside=(156, 1.24), measured=MEASURED)


BACKEND = OpenVINO()
