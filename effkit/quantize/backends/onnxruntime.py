"""`onnxruntime`: the model exported to ONNX and quantized by ONNX Runtime (`effkit.engines.onnxruntime`): `model.onnx`
with int8 operators, loadable by any ONNX Runtime."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
onnx_export = lazy_module("effkit.engines.onnxruntime")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend onnxruntime`'s own options (flags, recipe keys and --help lines come from here)."""

    fuse: bool = field(default=False, metadata={
        "help": "onnxruntime: ONNX Runtime's transformer fusions before quantizing"})


class OnnxRuntime:
    name = "onnxruntime"
    options = Options
    summary = "ONNX Runtime int8 of the ONNX export"
    format = "onnx"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return onnx_export.PORTABILITY

    def available(self, device: torch.device | None = None) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs ONNX artifacts on the CPU only (CPUExecutionProvider); use --device cpu"
        return onnx_export.onnx_unavailable()

    def refuses(self, cfg) -> str | None:
        return None

    def tag(self, cfg) -> str:
        return "quantize-onnxruntime"  # the head is always quantized: no -head suffix

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        onnx = onnx_export.write_artifact(folder, copy.deepcopy(parent).cpu(), tokenizer, int8=True,
                                          fused=cfg.options.fuse)
        # the granularity is read from what the quantizer was told (onnx["weights"]), never typed beside it
        return {"format": self.format, "include_head": True, "layers": sorted(onnx["int8"]), "onnx": onnx,
                "storage": "ONNX graph with int8 operators (model.onnx); ONNX Runtime quantizes every MatMul and the "
                           f"embedding lookups, the LM head included: {onnx['weights']}"}

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return onnx_export.OnnxCausalLM(folder)

    def quantized_layers(self, model: nn.Module) -> int:
        return onnx_export.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return f"onnxruntime.InferenceSession('{folder / onnx_export.ONNX_FILE}')"


BACKEND = OnnxRuntime()
