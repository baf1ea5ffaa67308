"""`ctranslate2`: the model converted by CTranslate2's own `TransformersConverter` and run by
`ctranslate2.Generator` (its int8 kernels, KV cache and batched decoding), `--compute-type` int8 by default
(`int8_float32`, `int16`, `float32`, and `int8_bfloat16` / `float16` where the device has them). The folder is a
plain CTranslate2 model (`effkit.engines.ctranslate2`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
ct2_export = lazy_module("effkit.engines.ctranslate2")


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
        return ct2_export.PORTABILITY

    def available(self, device: torch.device | None = None) -> str | None:
        return ct2_export.ct2_unavailable(device)

    def refuses(self, cfg) -> str | None:
        if cfg.options.compute_type not in ct2_export.WEIGHT_TYPES:
            return (f"unknown --compute-type {cfg.options.compute_type!r}; choose one of "
                    f"{', '.join(ct2_export.WEIGHT_TYPES)}")
        if cfg.method.include_head:
            return "--include-head with ctranslate2: its converter always quantizes the tied head with the blocks"
        return ct2_export.ct2_unavailable(None, cfg.options.compute_type)

    def tag(self, cfg) -> str:
        ct = cfg.options.compute_type
        return "quantize-ctranslate2" + ("" if ct == "int8" else f"-{ct}")

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        desc = ct2_export.write_artifact(folder, source, parent.config, tokenizer, cfg.options.compute_type,
                                         sum(p.numel() for p in parent.parameters()))
        return {**desc, "include_head": True, "layers": [f"{k} matrices: {v}" for k, v in
                                                         ct2_export.weight_dtypes(folder).items()],
                "storage": f"CTranslate2 model.bin, weights in {desc['weights']} (the tied embedding / LM head "
                           "included), computed as " + cfg.options.compute_type}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return ct2_export.Ct2CausalLM(folder, device)

    def quantized_layers(self, model: nn.Module) -> int:
        return ct2_export.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return f"ctranslate2.Generator('{folder}')"

    def memory(self, cfg) -> Memory:
        # write 710 and reload 432 MiB on gpt2, 88 and 243 on gpt2-mini (int8): its converter loads the source
        # again through transformers; kept beside the others in auto's order 150 and 75 (how:
        # effkit.quantize.backends.MEASURED)
        return Memory(write=(0, 2.02), loaded=(209, 0.63), beside=(62, 0.25), measured=MEASURED)


BACKEND = CTranslate2()
