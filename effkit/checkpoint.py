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

SUBCLASS = "#"  # `<state>#<part>`: a tensor subclass (torchao's 8-bit moments) stored as its plain parts
NESTED = "/"  # `<outer>/<inner>`: a dict inside one parameter's state (bitsandbytes' quantization state)


def _to_json(v: Any) -> Any:
    """Scalar tensors (a tensor learning rate, a step counter) as {"__tensor__": value}; the rest as is."""
    if torch.is_tensor(v) and v.numel() == 1:
        return {"__tensor__": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, dict):
        return {k: _to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_json(x) for x in v]
    return v


def _from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=getattr(torch, v.get("dtype", "float32")))
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of an optimizer state dict under `<param>.<name>` (safetensors), the rest in JSON: nested
    dicts as `<outer>/<inner>`, tensor subclasses (`__tensor_flatten__`) as `<name>#<part>` with their
    constructor's other arguments and class in JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    subclasses: dict[str, Any] = {}
    seen: set[int] = set()

    def own(t: torch.Tensor) -> torch.Tensor:  # safetensors refuses shared storage (bitsandbytes shares its qmaps)
        t = t.detach().cpu().contiguous()
        try:
            ptr = t.untyped_storage().data_ptr()
        except RuntimeError:  # a view without its own storage (e.g. gathered from shards): a plain copy
            return t.clone()
        if t.numel() and ptr in seen:
            return t.clone()
        seen.add(ptr)
        return t

    def put(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                put(f"{key}{NESTED}{k}", x)
        elif torch.is_tensor(v) and type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__") \
                and type(v).__name__ != "DTensor":
            names, ctx = v.__tensor_flatten__()
            for n in names:
                tensors[f"{key}{SUBCLASS}{n}"] = own(getattr(v, n))
            subclasses[key] = {"class": f"{type(v).__module__}:{type(v).__qualname__}", "parts": list(names),
                               "ctx": [str(c).removeprefix("torch.") if isinstance(c, torch.dtype) else c
                                       for c in ctx]}
        elif torch.is_tensor(v):
            tensors[key] = own(v)
        else:
            scalars[key] = v

    for idx, pstate in state["state"].items():
        for k, v in pstate.items():
            put(f"{idx}.{k}", v)
    return tensors, {"param_groups": _to_json(state["param_groups"]), "scalars": scalars, "subclasses": subclasses}


def _rebuild_subclass(key: str, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    import importlib

    module, _, qualname = spec["class"].partition(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    ctx = [getattr(torch, c) if isinstance(c, str) and isinstance(getattr(torch, c, None), torch.dtype) else c
           for c in spec["ctx"]]
    return cls.__tensor_unflatten__({n: tensors.pop(f"{key}{SUBCLASS}{n}") for n in spec["parts"]}, ctx, None, None)


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    tensors = dict(tensors)
    items = [(k, _rebuild_subclass(k, spec, tensors)) for k, spec in meta.get("subclasses", {}).items()]
    items += list(tensors.items()) + list(meta["scalars"].items())
    state: dict[int | str, dict[str, Any]] = {}
    for key, v in items:
        head, *inner = key.split(NESTED)
        idx, name = head.rsplit(".", 1)  # idx: a parameter index, or its name (distributed state dicts)
        d = state.setdefault(int(idx) if idx.isdigit() else idx, {})
        for k in [name, *inner][:-1]:
            d = d.setdefault(k, {})
        d[[name, *inner][-1]] = v
    return {"state": state, "param_groups": _from_json(meta["param_groups"])}


def save_checkpoint(path: Path, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                    sched_state: dict[str, Any], step: int, extra: dict[str, Any]) -> None:
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().cpu().clone() for k, v in model_state.items()}, tmp / "model.safetensors")
        tensors, meta = _flatten_optimizer(optim_state)
        tensors["__rng_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["__rng_cuda"] = torch.cuda.get_rng_state()
        save_file(tensors, tmp / "optimizer.safetensors")
        state = {"step": step, "optimizer": meta, "scheduler": _to_json(sched_state), **extra}
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
    state["scheduler"] = _from_json(state["scheduler"])
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
    scaler: dict[str, Any] | None = None  # fp16's GradScaler (its scale and growth tracker); None without it


class Checkpointer:
    """Save and restore a training run's state in `folder` (written by rank 0, atomically)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def exists(self) -> bool:
        return (self.folder / "state.json").is_file()

    def save(self, step: int, par, optimizer, scheduler, config: dict[str, Any], rows: list[dict[str, Any]],
             scaler=None) -> None:
        """Collective: every rank takes part in gathering the full state; rank 0 writes it. An enabled
        `scaler` (fp16) is saved too: its scale decides which steps are skipped after a resume."""
        state = par.full_state_dict()
        optim_state = par.optimizer_state(optimizer)
        extra: dict[str, Any] = {"config": config, "rows": rows}
        if scaler is not None and scaler.is_enabled():
            extra["scaler"] = _to_json(scaler.state_dict())
        if par.rt.is_main:
            save_checkpoint(self.folder, state, optim_state, scheduler.state_dict(), step, extra)
        par.rt.barrier()

    def load(self) -> Checkpoint:
        if not self.folder.is_dir():
            raise EffkitError(f"nothing to resume: {self.folder} does not exist; start without --resume")
        state = load_checkpoint(self.folder)
        return Checkpoint(step=state["step"], model=state["model"], optimizer=state["optimizer"],
                          scheduler=state["scheduler"], rng=state["rng"], config=state["config"],
                          rows=state.get("rows", []), scaler=_from_json(state.get("scaler")))

    @staticmethod
    def restore_rng(ckpt: Checkpoint, device: torch.device) -> None:
        torch.set_rng_state(ckpt.rng["__rng_cpu"])
        if "__rng_cuda" in ckpt.rng and device.type == "cuda":
            torch.cuda.set_rng_state(ckpt.rng["__rng_cuda"], device)
