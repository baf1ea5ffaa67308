"""`ctranslate2`: the model converted by CTranslate2's own `TransformersConverter` and run by
`ctranslate2.Generator` (its int8 kernels, KV cache and batched decoding), `--compute-type` int8 by default
(`int8_float32`, `int16`, `float32`, and `int8_bfloat16` / `float16` where the device has them). The folder is a
plain CTranslate2 model, written by the engine's `convert` (`effkit.engines.ctranslate2`), as `effkit export --format
ctranslate2` writes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
engine = lazy_module("effkit.engines.ctranslate2")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend ctranslate2`'s own options (flags, recipe keys and --help lines come from here)."""

    compute_type: str = field(default="int8", metadata={
        "help": "ctranslate2: int8, int8_float32, int16, float32 (or int8_bfloat16 / float16 where the device has "
                "them)"})


class CTranslate2:
    name = "ctranslate2"
    options = Options
    summary = "CTranslate2 (its converter, int8 by default)"
    format = "ctranslate2"
    devices = ("cpu", "cuda")

    @property
    def portability(self) -> str:
        return engine.PORTABILITY

    def available(self, device: torch.device | None = None) -> str | None:
        return engine.ct2_unavailable(device)

    def refuses(self, cfg) -> str | None:
        if cfg.options.compute_type not in engine.converter.WEIGHT_TYPES:
            return (f"unknown --compute-type {cfg.options.compute_type!r}; choose one of "
                    f"{', '.join(engine.converter.WEIGHT_TYPES)}")
        if cfg.method.include_head:
            return "--include-head with ctranslate2: its converter always quantizes the tied head with the blocks"
        return engine.ct2_unavailable(None, cfg.options.compute_type)

    def tag(self, cfg) -> str:
        ct = cfg.options.compute_type
        return "quantize-ctranslate2" + ("" if ct == "int8" else f"-{ct}")

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        desc = engine.ENGINE.convert(folder, source, parent, tokenizer, compute_type=cfg.options.compute_type)
        return {**desc, "include_head": True, "layers": [f"{k} matrices: {v}" for k, v in
                                                         engine.weight_dtypes(folder).items()],
                "storage": f"CTranslate2 model.bin, weights in {desc['weights']} (the tied embedding / LM head "
                           "included), computed as " + cfg.options.compute_type}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return engine.ENGINE.load(folder, device)

    def quantized_layers(self, model: nn.Module) -> int:
        return engine.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return f"ctranslate2.Generator('{folder}')"

    def memory(self, cfg) -> Memory:
        # its converter loads the source again through transformers (the figures: docs/benchmarks.md)
        return Memory(write=(0, 2.02), loaded=(209, 0.63), beside=(62, 0.25), measured=MEASURED)


BACKEND = CTranslate2()
