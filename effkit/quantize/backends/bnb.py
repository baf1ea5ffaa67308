"""`bnb`: bitsandbytes LLM.int8 (`Linear8bitLt`, with its outlier threshold), written in transformers' own
bitsandbytes serialization (`quantization_config` in `config.json`, int8 weights in `model.safetensors`): plain
`AutoModelForCausalLM.from_pretrained(path)` loads it. The tied LM head stays fp32 in that format."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError
from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")

HEAD_REFUSED = ("--include-head with bnb: transformers' bitsandbytes format keeps the tied LM head in fp32; drop "
                "--include-head, or use --backend dynamic or onnxruntime")


def _device_map(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else str(device)


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend bnb`'s own options (flags, recipe keys and --help lines come from here)."""

    threshold: float = field(default=6.0, metadata={"help": "bnb: LLM.int8 outlier threshold"})


class BitsAndBytes:
    name = "bnb"
    options = Options
    summary = "bitsandbytes LLM.int8"
    format = "transformers-bitsandbytes"
    devices = ("cpu", "cuda")
    portability = ("portable: plain transformers AutoModelForCausalLM.from_pretrained(path) loads it (bitsandbytes "
                   "installed): transformers' bitsandbytes serialization")

    def available(self, device: torch.device | None = None) -> str | None:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: not available
            return f"bitsandbytes does not import ({type(e).__name__}: {str(e)[:100]}); pip install bitsandbytes"
        return None

    def refuses(self, cfg) -> str | None:
        return HEAD_REFUSED if cfg.method.include_head else None

    def tag(self, cfg) -> str:
        return "quantize-bnb"

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        if cfg.method.include_head:
            raise EffkitError(HEAD_REFUSED)
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, use_safetensors=True, device_map=_device_map(device),
                quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=cfg.options.threshold))
        except Exception as e:  # noqa: BLE001
            raise EffkitError(f"bitsandbytes could not quantize {source}: {type(e).__name__}: {str(e)[:160]}") from None
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return {"format": self.format, "layers": [n for n, m in model.named_modules()
                                                  if type(m).__name__ == "Linear8bitLt"],
                "storage": "transformers' bitsandbytes 8-bit serialization: int8 weights and their scales in "
                           "model.safetensors, quantization_config in config.json"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, device_map=_device_map(device))
        except Exception as e:  # noqa: BLE001
            raise EffkitError(f"{folder} does not load through transformers ({type(e).__name__}: {str(e)[:120]}); "
                              "quantize the parent again") from None
        model.eval().config.use_cache = False
        return model

    def quantized_layers(self, model: nn.Module) -> int:
        return sum(type(m).__name__ == "Linear8bitLt" and m.weight.dtype == torch.int8 for m in model.modules())

    def load_command(self, folder: Path) -> str:
        return f"AutoModelForCausalLM.from_pretrained('{folder}')  (bitsandbytes installed)"

    def memory(self, cfg) -> Memory:
        # its write loads the source again through transformers (how measured: effkit.quantize.backends.MEASURED;
        # the figures: docs/benchmarks.md)
        return Memory(write=(0, 1.93), loaded=(216, 1.23), beside=(117, 0.14), measured=MEASURED)


BACKEND = BitsAndBytes()
