"""`dynamic`: PyTorch's dynamic int8 (`torch.ao.quantization.quantize_dynamic`, per-channel weights, fbgemm /
onednn kernels), stored in effkit's row-wise int8 format. Deprecated upstream and still the fastest PyTorch CPU
int8 path here: kept as one measured backend among several."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
rowwise = lazy_module("effkit.quantize.backends.rowwise")




class Dynamic:
    name = "dynamic"
    summary = "PyTorch dynamic int8 (CPU)"
    format = "effkit"
    devices = ("cpu",)
    portability = ("effkit only (effkit.artifacts.loader.load_any): PyTorch dynamic int8 modules have no "
                   "transformers serialization")

    def available(self, device: torch.device | None = None) -> str | None:
        if device is not None and device.type != "cpu":
            return "PyTorch dynamic int8 runs on the CPU only; use --device cpu, or bnb / torchao on the GPU"
        engines = torch.backends.quantized.supported_engines
        return None if any(e in engines for e in ("fbgemm", "x86", "onednn", "qnnpack")) else \
            f"no quantized engine in this torch build ({engines})"

    def refuses(self, cfg) -> str | None:
        return None

    def tag(self, cfg) -> str:
        return "quantize-dynamic" + ("-head" if cfg.method.include_head else "")

    def apply(self, model: nn.Module, names: list[str]) -> nn.Module:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantize_dynamic is deprecated, and still the fastest CPU int8 path
            return quantize_dynamic(model, {n: per_channel_dynamic_qconfig for n in names}, dtype=torch.qint8,
                                    inplace=True)

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        return rowwise.write(folder, parent, tokenizer, cfg.method.include_head)

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return self.apply(rowwise.load(folder, device), desc["layers"])

    def quantized_layers(self, model: nn.Module) -> int:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        return sum(isinstance(m, DynamicLinear) for m in model.modules())

    def load_command(self, folder: Path) -> str:
        return rowwise.load_command(folder)

    def memory(self, cfg) -> Memory:
        # the reload rebuilds the fp32 model before quantize_dynamic packs it; kept beside the others, the first
        # reloaded in auto's order keeps its fp32 rebuild's pages (how measured: effkit.quantize.backends.MEASURED;
        # the figures: docs/benchmarks.md)
        return Memory(write=(0, 1.21), loaded=(46, 2.45), beside=(77, 1.77), measured=MEASURED)


BACKEND = Dynamic()
