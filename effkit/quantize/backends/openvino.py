"""`openvino`: the model converted by OpenVINO's PyTorch front end into the stateful layout `optimum-cli export
openvino` writes, its weights compressed by NNCF (`--weight-format int8` by default; `int4`, data-free; or
`int4-data`, NNCF's data-aware int4: asymmetric, in groups of 128 (64 or 32 where 128 does not divide a matrix's
rows; none dividing is refused in one line), AWQ and scale estimation calibrated on `CALIBRATION_BLOCKS` blocks of the
run's own training split, never its held-out blocks, all of it recorded in `openvino.json`), and run by
OpenVINO's CPU plug-in in the `--inference-precision` it names: `bf16` (the matrix units: AMX, or AVX-512 BF16),
`f32`, or `auto`, which times both on this CPU at the workload the run optimizes for under the decision rule
(`effkit.measure.choice`) and keeps f32 on a tie (a CPU without native bf16 is "f32: bf16 not run: <reason>"); then
LLMPipeline's attention backend is chosen the same way (`engines.openvino.choose_attention`). The loss of whatever is
chosen is measured like every artifact's. The folder loads in plain OpenVINO (`effkit.engines.openvino`) with the
settings it was measured with: what the model file cannot carry is in its load command."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
ov_export = lazy_module("effkit.engines.openvino")


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


def choose_precision(folder: Path, tokenizer, workload: str, rule=None) -> tuple[str, dict[str, Any]]:
    """bf16 or f32 for the artifact in `folder`, timed at `workload` on this CPU as its users run it (decode:
    LLMPipeline; prefill: a forward) under the decision rule (`effkit.measure.choice.choose`; `rule`: at most
    `SETTING_BUDGET_S` of head-to-head looks per open contender by default). A tie within the precision goes to f32,
    the precision whose loss the export gate checked. Returns (the pick, {"choice", "workload", "how", and
    "decision": the choice's `to_dict()`, every call of every sample}). A CPU without native bf16: f32, bf16 not
    run, nothing timed."""
    from effkit import workloads
    from effkit.engines.openvino import DECODE_TOKENS, ENGINE, SETTING_BUDGET_S, OpenVINOCausalLM, bf16_unavailable
    from effkit.measure import choice, generation

    if reason := bf16_unavailable():
        return "f32", {"choice": "f32", "how": f"bf16 not run: {reason}"}
    w = workloads.get(workload)
    rule = rule or choice.Rule(budget_s=SETTING_BUDGET_S)
    models = {p: OpenVINOCausalLM(folder, precision=p) for p in ("f32", "bf16")}
    if w.kind == "decode":
        new = min(DECODE_TOKENS, generation.generation_budget(models["f32"], tokenizer, w.tokens or DECODE_TOKENS)[0])
        fns = {p: ENGINE.decode(m, tokenizer, w.batch, new) for p, m in models.items()}
        what = f"greedy decoding of {new} new tokens from {w.batch} prompt(s), new tokens/s"
    else:
        tokens = w.tokens or min(128, models["f32"].config.n_positions)
        fns = {p: ENGINE.prefill(m, w.batch, tokens) for p, m in models.items()}
        what = f"forward of ({w.batch}, {tokens}) tokens, seconds"
    picked = choice.choose(fns, w.higher_is_better, rule, prefer=lambda p: p != "f32")
    return picked.picked, {"choice": picked.picked, "workload": w.name, "decision": picked.to_dict(),
                           "how": f"{picked.line('inference precision ')} at {w.name} ({what}); a tie goes to f32, "
                                  f"whose loss the export gate checked; the rule: {rule.describe()}"}


def training_calibration(source: Path, cfg) -> tuple[Any, dict[str, Any]]:
    """The data-aware formats' calibration set: `CALIBRATION_BLOCKS` blocks of the TRAINING split of the data the
    stage reads (the artifact's data section, through its tokenizer: the split whose other part, the held-out
    blocks, measures the artifact), evenly spaced over it (`engines.openvino.calibration_blocks`). Returns (the
    blocks, what `openvino.json` records of them)."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare

    section = artifacts.data_section(source, cfg.inputs.data)
    prepared = prepare(DataConfig.from_dict(section), tokenizer_from=str(source))
    train = prepared.blocks.train
    blocks, idx = ov_export.calibration_blocks(train)
    return blocks, {"split": "train", "sequences": len(idx), "tokens_each": int(train.shape[1]),
                    "of_train_blocks": int(train.shape[0]), "indices": idx, "data": section.get("source"),
                    "how": f"{len(idx)} blocks of {int(train.shape[1])} tokens evenly spaced over the "
                           f"{int(train.shape[0])} training blocks of the run's data (its held-out blocks, which "
                           f"measure the artifact, never used), each a fresh sequence from position 0"}


def bandwidth_bound(folder: Path) -> dict[str, Any]:
    """The weight bytes a decoded token reads (`engines.openvino.weight_bytes_per_token`) and the batch-1 decoding
    rate the memory bandwidth, measured now, would allow them."""
    from effkit.measure import roofline

    per_token = ov_export.weight_bytes_per_token(folder)
    bandwidth, how = roofline.memory_bandwidth()
    return {**per_token, "memory_bandwidth_bytes_per_s": bandwidth, "memory_bandwidth_how": how,
            "bandwidth_bound_tokens_per_s": bandwidth / per_token["bytes_per_token"]}


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

    def weights(self, cfg) -> str:
        """The stored weights these options ask for (`--weight-format`)."""
        return cfg.options.weight_format

    def refuses(self, cfg) -> str | None:
        o = cfg.options
        if o.weight_format not in ov_export.WEIGHTS[1:]:
            return (f"unknown --weight-format {o.weight_format!r}; choose {', '.join(ov_export.WEIGHTS[1:])} (fp32 "
                    "weights: effkit export --format openvino)")
        if o.inference_precision not in ov_export.PRECISIONS:
            return (f"unknown --inference-precision {o.inference_precision!r}; choose one of "
                    f"{', '.join(ov_export.PRECISIONS)}")
        if o.inference_precision == "bf16" and (reason := ov_export.bf16_unavailable()):
            return f"--inference-precision bf16: {reason}; use f32 or auto"
        return None

    def tag(self, cfg) -> str:
        o, weights = cfg.options, self.weights(cfg)
        return ("quantize-openvino" + ("" if weights == "int8" else f"-{weights}")
                + ("" if o.inference_precision == "auto" else f"-{o.inference_precision}"))

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        from dataclasses import replace

        from effkit.measure import choice

        o, weights = cfg.options, self.weights(cfg)
        asked = o.inference_precision
        # the stage's own rule (its precision, its budget), capped: this is one setting of one folder
        rule = replace(choice.Rule.of(cfg.measure), budget_s=min(cfg.measure.budget_s, ov_export.SETTING_BUDGET_S))
        calibration = None
        if weights in ov_export.DATA_AWARE:
            ov_export.int4_group_size(parent, weights)  # a width NNCF cannot group: one line, before the data
            calibration = training_calibration(source, cfg)
        desc = ov_export.write_artifact(folder, parent, tokenizer, weights, "f32" if asked == "auto" else asked,
                                        calibration=calibration)
        if asked == "auto":
            picked, how = choose_precision(folder, tokenizer, cfg.method.optimize_for, rule)
            desc.update(inference_precision=picked, precision_how=how["how"], precision_choice=how)
            ov_export.record(folder, desc)  # the pick travels in the model and the load command
        desc = ov_export.record_attention(folder, tokenizer, cfg.method.optimize_for, rule)
        desc["weight_bytes_per_token"] = bandwidth_bound(folder)
        ov_export.record(folder, desc)
        counts = desc["weight_types"]
        return {"format": self.format, "include_head": True, "openvino": desc,
                "layers": [f"{k} matrices: {v}" for k, v in counts.items()],
                "storage": f"OpenVINO IR (openvino_model.xml/.bin), weights {weights} "
                           f"({desc.get('compression', 'uncompressed')}), inference in {desc['inference_precision']}"
                           f" ({desc['precision_how'] or 'as asked'}), LLMPipeline attention "
                           f"{desc.get('attention')}"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return ov_export.OpenVINOCausalLM(folder)

    def quantized_layers(self, model: nn.Module) -> int:
        return ov_export.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return ov_export.ENGINE.load_command(folder)

    def memory(self, cfg) -> Memory:
        # write 1,337 and reload 665 MiB on gpt2, 270 and 265 on gpt2-mini; kept beside the others in auto's
        # order 592 and 222 (how: effkit.quantize.backends.MEASURED)
        return Memory(write=(81, 3.57), loaded=(194, 1.34), beside=(156, 1.24), measured=MEASURED)


BACKEND = OpenVINO()
