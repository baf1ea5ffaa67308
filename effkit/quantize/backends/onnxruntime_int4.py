"""`onnxruntime-int4`: weight-only 4-bit (or 8-bit) of the with-past ONNX export through ONNX Runtime's
`MatMulNBitsQuantizer`, the tied token embedding read from the quantized LM head, written by the engine's
`write_int4` (`effkit.engines.onnxruntime`: `int4.py` writes, `choose.py` measures). Batch-1 decoding reads every
weight once per token, so halving the bytes of int8 is what can speed it up; `auto` keeps it only within its loss
budget.

Its options: how the weights are rounded (`--int4-algorithm` rtn, hqq, gptq or auto: all three measured), the bits
(`--int4-bits 8`: rtn only), the block size and the accuracy level (auto: measured on this CPU, loss then speed),
and the share of the weights in 4 bits in a mixed graph (`--int4-share`: rtn at 4 bits only). The decision and the
settings read back from the written graph are in `onnx.json` (`int4`), which `quantization.json` holds as `onnx`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.quantize.backends.onnxruntime import OnnxRuntime, engine
from effkit.registry import lazy_module

int4 = lazy_module("effkit.engines.onnxruntime.int4")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend onnxruntime-int4`'s own options (flags, recipe keys and --help lines come from
    here)."""

    int4_block_size: str = field(default="auto", metadata={
        "help": "onnxruntime-int4: weights per scale in MatMulNBits: auto (32, 128 or 256, measured: loss, then "
                "speed), 16, 32, 64, 128 or 256",
        "choices": ("auto", "16", "32", "64", "128", "256")})
    accuracy_level: str = field(default="auto", metadata={
        "help": "onnxruntime-int4: MatMulNBits compute: auto (measured: loss, then speed), 1 (fp32, what ONNX "
                "Runtime's default 0 runs on a CPU) or 4 (int8 activations)",
        "choices": ("auto", "1", "4")})
    int4_algorithm: str = field(default="rtn", metadata={
        "help": "onnxruntime-int4: how MatMulNBits' weights are rounded: rtn (round-to-nearest, symmetric), hqq "
                "(Half-Quadratic, float zero points, no data), gptq (calibrated on training blocks) or auto (all "
                "three measured: loss, then speed)",
        "choices": ("rtn", "hqq", "gptq", "auto")})
    int4_bits: str = field(default="4", metadata={
        "help": "onnxruntime-int4: bits per MatMulNBits weight: 4, or 8 (rtn only)",
        "choices": ("4", "8")})
    int4_share: str = field(default="auto", metadata={
        "help": "onnxruntime-int4 (rtn, 4 bits): the share of the matrices' weights in 4 bits, the rest in 8, the "
                "layers least sensitive per weight (measured on training blocks) in 4 bits first: auto (1, and "
                "0.75 then 0.5 where no all-4-bit setting is within +0.2% loss), 1, 0.75 or 0.5",
        "choices": ("auto", "1", "0.75", "0.5")})

    def __post_init__(self):
        from effkit.engines.onnxruntime.graph import INT4_ALGORITHMS, refused_combination
        from effkit.errors import EffkitError

        if self.int4_algorithm not in INT4_ALGORITHMS or self.int4_bits not in ("4", "8") or (
                self.accuracy_level not in ("auto", "1", "4")):
            return  # auto, or a value outside the choices (refused by name where the choices are checked)
        level = None if self.accuracy_level == "auto" else int(self.accuracy_level)
        if why := refused_combination(self.int4_algorithm, int(self.int4_bits), level):
            asked = f"--int4-bits {self.int4_bits}" if self.int4_bits != "4" else f"--accuracy-level {level}"
            raise EffkitError(f"--int4-algorithm {self.int4_algorithm} {asked}: {why}")
        if self.int4_share not in ("auto", "1") and (self.int4_algorithm != "rtn" or self.int4_bits != "4"):
            raise EffkitError(f"--int4-share {self.int4_share} mixes 4-bit and 8-bit round-to-nearest layers; use it "
                              "with --int4-algorithm rtn --int4-bits 4, or leave it at auto")


class OnnxRuntimeInt4(OnnxRuntime):
    name = "onnxruntime-int4"
    options = Options
    summary = ("ONNX Runtime 4-bit (or 8-bit) weight-only (MatMulNBits: rtn, hqq or gptq; block size and compute "
               "measured)")

    def tag(self, cfg) -> str:
        o = cfg.options.of(Options)
        # a setting asked for by hand is its own artifact beside the measured one
        return ("quantize-onnxruntime-int4"
                + {"rtn": "", "auto": "-auto-algorithm"}.get(o.int4_algorithm, f"-{o.int4_algorithm}")
                + ("" if o.int4_bits == "4" else f"-{o.int4_bits}bit")
                + ("" if o.int4_block_size == "auto" else f"-b{o.int4_block_size}")
                + ("" if o.accuracy_level == "auto" else f"-level{o.accuracy_level}")
                + ("" if o.int4_share in ("auto", "1") else f"-share{round(float(o.int4_share) * 100)}"))

    def refuses(self, cfg) -> str | None:
        if cfg.options.accuracy_level == "4" and (reason := int4.int8_compute_unavailable()):
            return f"--accuracy-level 4: {reason}; use 1 or auto"
        return None

    def write(self, folder: Path, parent: Any, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        onnx = engine.ENGINE.write_int4(folder, parent, source, tokenizer, cfg.options.of(Options), cfg)
        record = onnx["int4"]
        s = record["settings"]
        bits = (f"{s['bits']}-bit" if isinstance(s["bits"], int) else
                f"4-bit ({record['int4_share']:.0%} of the matrices' weights) and 8-bit")
        return {"format": self.format, "include_head": True, "layers": sorted(onnx["int8"]), "onnx": onnx,
                "storage": f"ONNX graph with {bits} block-quantized weights (model.onnx): MatMulNBits "
                           f"({record['algorithm']}, blocks of {s['block_size']}, accuracy_level "
                           f"{s['accuracy_level']}, zero points {s['zero_points']}; {record['chosen']}) for every "
                           f"MatMul with a constant weight, the LM head included; token embedding: "
                           f"{onnx['token_embedding']}"}

    def available(self, device: Any = None) -> str | None:
        return super().available(device) or int4.matmulnbits_unavailable()

    def memory(self, cfg) -> Memory:
        # its default settings (their candidates written and timed; the figures: docs/benchmarks.md)
        return Memory(write=(467, 2.70), loaded=(184, 0.67), beside=(100, 0.36), measured=MEASURED)


BACKEND = OnnxRuntimeInt4()
