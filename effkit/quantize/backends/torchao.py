"""`torchao`: int8 dynamic-activation + int8-weight (`--torchao-scheme da8w8`) or int8 weight-only (`w8`) through
torchao's `quantize_`, stored in effkit's row-wise int8 format: transformers 5's torchao integration quantizes
only `nn.Linear`, and GPT-2's saved layers are `Conv1D`, so a plain `from_pretrained` would quantize nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
rowwise = lazy_module("effkit.quantize.backends.rowwise")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend torchao`'s own options (flags, recipe keys and --help lines come from here)."""

    torchao_scheme: str = field(default="da8w8", metadata={
        "help": "torchao: da8w8 (int8 activations + weights) or w8 (weight-only)", "choices": ("da8w8", "w8")})


class TorchAO:
    name = "torchao"
    options = Options
    summary = "torchao int8 (da8w8 or w8)"
    format = "effkit"
    devices = ("cpu", "cuda")
    portability = ("effkit only (effkit.artifacts.loader.load_any): transformers 5's torchao integration quantizes "
                   "only nn.Linear, and GPT-2's saved layers are Conv1D, so a plain from_pretrained would quantize "
                   "nothing")

    def available(self, device: torch.device | None = None) -> str | None:
        try:
            import torchao.quantization  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: not available
            return f"torchao does not import ({type(e).__name__}: {str(e)[:100]}); pip install torchao"
        return None

    def refuses(self, cfg) -> str | None:
        return None

    def tag(self, cfg) -> str:
        return f"quantize-torchao-{cfg.options.torchao_scheme}" + ("-head" if cfg.method.include_head else "")

    def apply(self, model: nn.Module, names: list[str], scheme: str) -> nn.Module:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        config = Int8DynamicActivationInt8WeightConfig() if scheme == "da8w8" else Int8WeightOnlyConfig()
        targets = set(names)
        if "lm_head" in targets:  # a quantized head cannot stay tied to the embedding
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        quantize_(model, config, filter_fn=lambda m, fqn: fqn in targets)
        return model

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        return rowwise.write(folder, parent, tokenizer, cfg.method.include_head)

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return self.apply(rowwise.load(folder, device), desc["layers"], desc.get("torchao_scheme", "da8w8"))

    def quantized_layers(self, model: nn.Module) -> int:
        return sum(isinstance(m, nn.Linear) and type(m.weight).__module__.startswith("torchao")
                   for m in model.modules())

    def load_command(self, folder: Path) -> str:
        return rowwise.load_command(folder)

    def memory(self, cfg) -> Memory:
        # da8w8 (how measured: effkit.quantize.backends.MEASURED; the figures: docs/benchmarks.md)
        return Memory(write=(0, 1.27), loaded=(49, 2.28), beside=(0, 0.53), measured=MEASURED)


BACKEND = TorchAO()
