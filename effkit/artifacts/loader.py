"""One loader for every artifact kind: the engine that owns a folder (`effkit.engines`, found through
`effkit.registry.ENGINES` by its marker file) loads it; a folder no engine claims is a PyTorch artifact (dense,
pruned, or quantized by a backend named in its `quantization.json`). Stages load artifacts through here, never
through another stage, and this module imports no engine or backend: the registry does, on demand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit import artifacts
from effkit.artifacts.quantized import is_quantized
from effkit.errors import EffkitError
from effkit.registry import ENGINES

__all__ = ["cannot_run_on", "engine_of", "is_quantized", "kind", "load_any", "load_command", "newest_artifact",
           "trainable"]


def engine_of(path: str | Path) -> Any:
    """The engine of the artifact at `path` (its marker file), else PyTorch's."""
    for name in ENGINES.names():
        engine = ENGINES.get(name)
        if engine.owns(path):
            return engine
    return ENGINES.get("pytorch")


def kind(path: str | Path) -> str:
    """`quantized` (any backend's), or the name of the engine that owns it (`pytorch`, `onnxruntime`, ...)."""
    return "quantized" if is_quantized(path) else engine_of(path).name


def load_any(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Any effkit artifact on `device` (default the CPU), loaded by the engine that owns it."""
    return engine_of(path).load(Path(path), device or torch.device("cpu"))


def cannot_run_on(path: str | Path, device: torch.device) -> str | None:
    """Why an artifact cannot run on `device` (None if it can)."""
    return engine_of(path).available(device, path=Path(path))


def trainable(path: str | Path) -> bool:
    """Whether an artifact can be trained (and so timed training): dense and pruned ones, of an engine that trains."""
    return not is_quantized(path) and engine_of(path).trains


def quantized_layers(path: str | Path, model: nn.Module) -> int:
    """The quantized layers the reloaded `model` of the artifact at `path` really holds (0 for fp32 ones)."""
    return engine_of(path).quantized_layers(model, Path(path))


def load_command(path: Path) -> str:
    """How a user loads an artifact outside effkit (or with it, where nothing else can)."""
    return engine_of(path).load_command(Path(path))


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
