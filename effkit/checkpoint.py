"""Training checkpoints without pickle: model and optimizer tensors in safetensors, the rest in JSON.

`Checkpointer` owns one checkpoint folder and every key in it: the model and optimizer tensors, the RNG
states, the step, the scheduler, and the config and loss rows the run needs to continue exactly."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise EffkitError(f"checkpoint {path} is incomplete (state.json has no {', '.join(missing)}); start again "
                          "without --resume, or remove the checkpoint folder")
    rng = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("__rng_")]}
    try:
        state["optimizer"] = _unflatten_optimizer(tensors, state["optimizer"])
    except (KeyError, TypeError, AttributeError) as e:
        raise EffkitError(f"checkpoint {path} has an unreadable optimizer state ({type(e).__name__}: {e}); start "
                          "again without --resume") from None
    state["model"] = model_state
    state["rng"] = rng
    return state


STATE_KEYS = ("step", "optimizer", "scheduler", "config")  # what state.json must hold to resume


@dataclass(frozen=True)
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, torch.Tensor]
    config: dict[str, Any]
    rows: list[dict[str, Any]]


class Checkpointer:
    """Save and restore a training run's state in `folder` (written by rank 0, atomically)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def exists(self) -> bool:
        return (self.folder / "state.json").is_file()

    def save(self, step: int, par, optimizer, scheduler, config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Collective: every rank takes part in gathering the full state; rank 0 writes it."""
        state = par.full_state_dict()
        optim_state = par.optimizer_state(optimizer)
        if par.rt.is_main:
            save_checkpoint(self.folder, state, optim_state, scheduler.state_dict(), step,
                            {"config": config, "rows": rows})
        par.rt.barrier()

    def load(self) -> Checkpoint:
        if not self.folder.is_dir():
            raise EffkitError(f"nothing to resume: {self.folder} does not exist; start without --resume")
        state = load_checkpoint(self.folder)
        return Checkpoint(step=state["step"], model=state["model"], optimizer=state["optimizer"],
                          scheduler=state["scheduler"], rng=state["rng"], config=state["config"],
                          rows=state.get("rows", []))

    @staticmethod
    def restore_rng(ckpt: Checkpoint, device: torch.device) -> None:
        torch.set_rng_state(ckpt.rng["__rng_cpu"])
        if "__rng_cuda" in ckpt.rng and device.type == "cuda":
            torch.cuda.set_rng_state(ckpt.rng["__rng_cuda"], device)
