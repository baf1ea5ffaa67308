"""`onnxruntime-int4`: weight-only 4-bit of the with-past ONNX export through ONNX Runtime's
`MatMulNBitsQuantizer` (round-to-nearest, symmetric, blocks of 32), the tied token embedding read from the 4-bit
LM head (`effkit.onnx_export.quantize_int4`). Batch-1 decoding reads every weight once per token, so halving the
bytes of int8 is what can speed it up; `auto` keeps it only within its loss budget."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from effkit.quantize.backends.onnxruntime import OnnxRuntime
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
onnx_export = lazy_module("effkit.engines.onnxruntime")


class OnnxRuntimeInt4(OnnxRuntime):
    name = "onnxruntime-int4"
    summary = "ONNX Runtime 4-bit weight-only (MatMulNBits)"

    def tag(self, cfg) -> str:
        return "quantize-onnxruntime-int4"

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        onnx = onnx_export.write_artifact(folder, copy.deepcopy(parent).cpu(), tokenizer, int8=False, fused=False,
                                          int4=True)
        return {"format": self.format, "include_head": True, "layers": sorted(onnx["int8"]), "onnx": onnx,
                "storage": f"ONNX graph with 4-bit block-quantized weights (model.onnx): MatMulNBits for every "
                           f"MatMul with a constant weight, the LM head included; token embedding: "
                           f"{onnx['token_embedding']}"}

    def available(self, device: torch.device | None = None) -> str | None:
        if reason := super().available(device):
            return reason
        try:
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an older ONNX Runtime
            return f"this ONNX Runtime has no MatMulNBitsQuantizer ({type(e).__name__}); pip install -U onnxruntime"
        return None


BACKEND = OnnxRuntimeInt4()
