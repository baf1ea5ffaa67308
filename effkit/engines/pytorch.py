"""PyTorch: effkit's own artifacts (dense, pruned: plain Hugging Face folders) and quantized ones, which their
backend (`effkit.registry.BACKENDS`, named in `quantization.json`) rebuilds as a PyTorch model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effkit.artifacts.quantized import description, is_quantized
from effkit.engines import Engine
from effkit.errors import EffkitError
from effkit.registry import BACKENDS


class PyTorchEngine(Engine):
    name = "pytorch"
    marker = ""  # owns every folder no other engine claims
    label = "PyTorch"
    noun = "a PyTorch"  # "is a PyTorch artifact"
    summary = "PyTorch (transformers' GPT-2; quantized artifacts through their backend)"
    # a prefill as decoding runs it: the forward builds the KV cache, as ONNX Runtime's with-past graph does (its
    # presents are outputs)
    prefill_kwargs = {"use_cache": True}
    trains = True

    def owns(self, path: str | Path) -> bool:
        return False

    def _backend(self, path: Path):
        return BACKENDS.get(description(path)["backend"])

    def available(self, device: Any = None, path: Path | None = None, **options: Any) -> str | None:
        if path is None or not is_quantized(path):
            return None
        try:
            backend = description(path)["backend"]
        except (EffkitError, OSError):
            return None  # loading it says what is wrong
        if backend not in BACKENDS:
            return f"unknown backend {backend}"
        return BACKENDS.get(backend).available(device)

    def load(self, path: Path, device: Any):
        if is_quantized(path):
            desc = description(path)
            if reason := self.available(device, path):
                raise EffkitError(f"{path} was quantized with {desc['backend']}, which cannot run here: {reason}")
            return self._backend(path).load(Path(path), desc, device)
        from effkit.model import load_model

        return load_model(str(path)).to(device)

    def quantized_layers(self, model: Any, path: Path | None = None) -> int:
        return self._backend(path).quantized_layers(model) if path is not None and is_quantized(path) else 0

    def load_command(self, path: Path) -> str:
        if is_quantized(path):
            return self._backend(path).load_command(path)
        return f"AutoModelForCausalLM.from_pretrained('{path}')"


ENGINE = PyTorchEngine()
