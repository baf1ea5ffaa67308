"""One loader for every artifact kind: effkit PyTorch artifacts (dense, pruned), quantized ones (through the
backend registry, `effkit.quantize.backends`), and ONNX exports. Stages load artifacts through here, never
through another stage."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from effkit import artifacts, ct2_export, onnx_export
from effkit.errors import EffkitError
from effkit.model import load_model
from effkit.quantize import backends
from effkit.quantize.backends import is_quantized

__all__ = ["cannot_run_on", "is_quantized", "kind", "load_any", "load_command", "newest_artifact", "trainable"]


def kind(path: str | Path) -> str:
    """`quantized` (any backend's), `onnx` or `ctranslate2` (exports), or `pytorch`."""
    if is_quantized(path):
        return "quantized"
    if onnx_export.is_onnx(path):
        return "onnx"
    return "ctranslate2" if ct2_export.is_ct2(path) else "pytorch"


def load_quantized(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """A quantized artifact rebuilt on `device` (default the CPU) from its folder alone, by its backend."""
    path, device = Path(path), device or torch.device("cpu")
    desc = backends.description(path)
    if reason := backends.unavailable(desc["backend"], device):
        raise EffkitError(f"{path} was quantized with {desc['backend']}, which cannot run here: {reason}")
    return backends.get(desc["backend"]).load(path, desc, device)


def load_any(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Any effkit artifact on `device` (default the CPU): quantized ones through their backend, ONNX ones
    through ONNX Runtime, others through transformers."""
    device = device or torch.device("cpu")
    k = kind(path)
    if k == "quantized":
        return load_quantized(path, device)
    if k == "onnx":
        if device.type != "cpu":
            raise EffkitError(f"{path} is an ONNX artifact, which effkit runs on the CPU only; use --device cpu")
        return onnx_export.OnnxCausalLM(path)
    if k == "ctranslate2":
        return ct2_export.Ct2CausalLM(path, device)
    return load_model(str(path)).to(device)


def cannot_run_on(path: str | Path, device: torch.device) -> str | None:
    """Why an artifact cannot run on `device` (None if it can): ONNX artifacts run on the CPU only, and a
    quantized artifact needs its backend on that device."""
    k = kind(path)
    if k == "quantized":
        try:
            backend = backends.description(path)["backend"]
        except (EffkitError, OSError):
            return None  # loading it says what is wrong
        return backends.unavailable(backend, device)
    if k == "onnx" and device.type != "cpu":
        return "effkit runs ONNX artifacts on the CPU only; bench them with --device cpu"
    if k == "ctranslate2":
        return ct2_export.ct2_unavailable(device)
    return None


def trainable(path: str | Path) -> bool:
    """Whether an artifact can be trained (and so timed training): dense and pruned PyTorch ones."""
    return kind(path) == "pytorch"


def quantized_layers(path: str | Path, model: nn.Module) -> int:
    """The quantized layers the reloaded `model` of the artifact at `path` really holds (0 for fp32 ones)."""
    if is_quantized(path):
        return backends.get(backends.description(path)["backend"]).quantized_layers(model)
    if isinstance(model, onnx_export.OnnxCausalLM):
        return onnx_export.quantized_layers(model)
    if isinstance(model, ct2_export.Ct2CausalLM):
        return ct2_export.quantized_layers(model)
    return 0


def load_command(path: Path) -> str:
    """How a user loads an artifact outside effkit (or with it, where nothing else can)."""
    k = kind(path)
    if k == "quantized":
        return backends.get(backends.description(path)["backend"]).load_command(path)
    if k == "onnx":
        return f"onnxruntime.InferenceSession('{path / onnx_export.ONNX_FILE}')"
    if k == "ctranslate2":
        return f"ctranslate2.Generator('{path}')"
    return f"AutoModelForCausalLM.from_pretrained('{path}')"


def newest_artifact(runs_dir: str, quantized: bool = False) -> Path:
    """The newest artifact of the latest run (quantized ones only if `quantized`)."""
    run = artifacts.latest_run(Path(runs_dir))
    found = []
    for d in run.iterdir():
        if (d / artifacts.META).is_file() and (quantized or not is_quantized(d)):
            found.append((artifacts.read_meta(d).get("time", ""), d))
    if not found:
        raise EffkitError(f"no artifact in {run}; run `effkit train` first or pass --from PATH")
    return max(found)[1]
