"""Training checkpoints without pickle: model and optimizer tensors in safetensors, the rest in JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from effkit.artifacts import atomic_dir
from effkit.errors import EffkitError


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for idx, pstate in state["state"].items():
        for k, v in pstate.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int | str, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, name = key.rsplit(".", 1)  # idx: a parameter index, or its name (distributed state dicts)
        state.setdefault(int(idx) if idx.isdigit() else idx, {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(path: Path, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                    sched_state: dict[str, Any], step: int, extra: dict[str, Any]) -> None:
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().cpu().clone() for k, v in model_state.items()}, tmp / "model.safetensors")
        tensors, meta = _flatten_optimizer(optim_state)
        tensors["__rng_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["__rng_cuda"] = torch.cuda.get_rng_state()
        save_file(tensors, tmp / "optimizer.safetensors")
        state = {"step": step, "optimizer": meta, "scheduler": sched_state, **extra}
        (tmp / "state.json").write_text(json.dumps(state, default=str))


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    files = [path / "model.safetensors", path / "optimizer.safetensors", path / "state.json"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise EffkitError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}); "
                          "start again without --resume")
    try:
        model_state = load_file(path / "model.safetensors")
        tensors = load_file(path / "optimizer.safetensors")
        state = json.loads((path / "state.json").read_text())
    except (SafetensorError, json.JSONDecodeError, OSError, ValueError) as e:
        raise EffkitError(f"checkpoint {path} is unreadable or truncated ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}); start again without --resume") from None
    rng = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("__rng_")]}
    state["optimizer"] = _unflatten_optimizer(tensors, state["optimizer"])
    state["model"] = model_state
    state["rng"] = rng
    return state
