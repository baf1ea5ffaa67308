"""`gguf`: llama.cpp's format as its engine package writes it (`effkit.engines.llamacpp`, through `ENGINE.write`, the
writer `effkit export --format gguf` calls too): one GGUF file in llama.cpp's block formats (`--gguf-type q8_0` by
default, or `q4_0`, its tied embedding / LM head in Q6_K), weights and tokenizer inside, run by llama.cpp
(`xllamacpp`). A model whose widths are not multiples of 32 cannot be stored in blocks of 32: refused in one line
(`quantize --backend auto` then says "not run" for it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
llamacpp = lazy_module("effkit.engines.llamacpp")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend gguf`'s own options (flags, recipe keys and --help lines come from here)."""

    gguf_type: str = field(default="q8_0", metadata={
        "help": "gguf: llama.cpp's block format, q8_0 or q4_0 (f16: effkit export --format gguf)",
        "choices": ("q8_0", "q4_0")})


class Gguf:
    name = "gguf"
    options = Options
    summary = "llama.cpp GGUF (effkit's writer; Q8_0 by default, or Q4_0)"
    format = "gguf"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return llamacpp.ENGINE.portability

    def available(self, device: torch.device | None = None) -> str | None:
        return llamacpp.ENGINE.available(device)

    def refuses(self, cfg) -> str | None:
        types = tuple(llamacpp.writer.QUANTIZED)
        if cfg.options.gguf_type not in types:
            return f"unknown --gguf-type {cfg.options.gguf_type!r}; choose one of {', '.join(types)}"
        if cfg.method.include_head:
            return ("--include-head with gguf: GGUF always stores the tied embedding / LM head quantized (Q8_0; Q6_K "
                    "with q4_0)")
        return None

    def tag(self, cfg) -> str:
        t = cfg.options.gguf_type
        return "quantize-gguf" + ("" if t == "q8_0" else f"-{t}")

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        desc = llamacpp.ENGINE.write(folder, parent, tokenizer, cfg.options.gguf_type)
        counts = llamacpp.writer.tensor_types(folder / llamacpp.GGUF_FILE)
        return {"format": self.format, "include_head": True, "gguf": desc,
                "layers": [f"{k} matrices: {v}" for k, v in counts.items()],
                "storage": f"one GGUF file (model.gguf, tokenizer inside): {desc['quantizer']}; norms, biases and the "
                           "position embedding f32"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return llamacpp.ENGINE.load(folder, device)

    def quantized_layers(self, model: nn.Module) -> int:
        return llamacpp.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return llamacpp.ENGINE.load_command(folder)

    def memory(self, cfg) -> Memory:  # the figures behind these lines: docs/benchmarks.md
        return Memory(write=(0, 8.17), loaded=(87, 3.68), beside=(91, 3.70), measured=MEASURED)


BACKEND = Gguf()
