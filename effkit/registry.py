"""One registry helper for every seam, and the tables of what ships with effkit.

A registry maps a name to a plug-in object. Built-in plug-ins are listed here by the dotted path of the module
that holds them (`module:ATTRIBUTE`), so `names()` imports nothing (`effkit --help` lists them without torch) and
`get(name)` imports only the one asked for; a test or a user's package adds its own with `register(obj)`.
Nothing else in effkit switches on a plug-in's name: adding one is its module plus one line in a table below.

This module sits at the bottom of the house (it imports nothing of effkit but errors), so the config's
validation, the loader and the CLI can all read the tables without importing a stage, a backend or an engine.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from effkit.errors import EffkitError

T = TypeVar("T")
PLUGINS_ENV = "EFFKIT_PLUGINS"  # comma-separated modules imported before any registry is read
ENTRY_POINTS = "effkit.plugins"  # or a package's entry points in this group (each a module to import)
_plugins_loaded = False
_plugin_error: EffkitError | None = None  # a plug-in that failed to import: said again at every registry look-up


def load_plugins() -> list[str]:
    """Import the user's plug-in modules once per process (each registers its engines, backends, workloads or
    stages at import): those named in $EFFKIT_PLUGINS, then those of installed packages' `effkit.plugins` entry
    points. Child processes (the bench's, launched ranks) inherit the variable, so they see the same plug-ins."""
    global _plugins_loaded, _plugin_error
    if _plugin_error is not None:
        raise _plugin_error
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    names = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    try:
        from importlib.metadata import entry_points

        names += [ep.value.partition(":")[0] for ep in entry_points(group=ENTRY_POINTS)]
    except Exception:  # noqa: BLE001 - broken package metadata must not stop effkit
        pass
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever the plug-in raises, the user gets one line
            _plugin_error = EffkitError(f"plug-in module {name!r} (from ${PLUGINS_ENV} or an {ENTRY_POINTS} entry "
                                        f"point) does not import: {type(e).__name__}: {e}; fix it or remove it")
            raise _plugin_error from None
    return names


class lazy_module:  # noqa: N801 - used like a module
    """A module imported on first attribute access: plug-in modules stay light to import (their options and names
    are read by `--help` without torch) while their code reads `torch.zeros`, `onnx_export.write_artifact` as
    usual. The architecture test counts `lazy_module("effkit....")` as an import."""

    def __init__(self, name: str):
        self.__name = name
        self.__module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self.__module is None:
            self.__module = importlib.import_module(self.__name)
        return getattr(self.__module, attr)


class Registry(Generic[T]):
    """name -> plug-in. `kind` and `flag` word the one-line error for an unknown name. `options`, where given: the
    built-in plug-ins' options dataclasses (name -> "module:ATTRIBUTE", each the same class as the plug-in's own
    `options`), read by `options(name)` without importing the plug-in's module (a pruning method imports torch;
    its options, what `--help` and recipe validation read, live in a module that does not); a built-in plug-in the
    table leaves out declares none."""

    def __init__(self, kind: str, flag: str, builtin: dict[str, str], options: dict[str, str] | None = None):
        self.kind, self.flag = kind, flag
        self.builtin = dict(builtin)  # name -> "module:ATTRIBUTE"
        self.builtin_options = None if options is None else dict(options)  # name -> "module:ATTRIBUTE"
        unknown = set(self.builtin_options or ()) - set(self.builtin)
        if unknown:
            raise ValueError(f"options for {', '.join(sorted(unknown))}, which is no built-in {kind}")
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}

    def register(self, obj: T, name: str | None = None) -> T:
        """Add a plug-in (or replace one of the same name) at run time; returns it, so it works as a decorator."""
        key = name or obj.name  # type: ignore[attr-defined]
        self._registered[key] = obj
        return obj

    def unregister(self, name: str) -> None:
        self._registered.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Every name, built-in ones first in their table's order (no built-in module imported)."""
        load_plugins()
        return tuple(dict.fromkeys([*self.builtin, *self._registered]))

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self.builtin or name in self._registered

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        load_plugins()
        if name in self._registered:
            return self._registered[name]
        if name not in self.builtin:
            raise EffkitError(f"unknown {self.flag} {name!r}; choose one of {', '.join(self.names())}")
        if name not in self._loaded:
            module, _, attr = self.builtin[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def options(self, name: str) -> Any:
        """A plug-in's options dataclass (its `options`), or None where it declares none: a built-in one's from the
        `options` table where the registry has one (its module is not imported), else from the plug-in itself."""
        load_plugins()
        if name in self._registered or self.builtin_options is None or name not in self.builtin:
            return getattr(self.get(name), "options", None)  # (an unknown name: get's one line)
        if name not in self.builtin_options:
            return None
        module, _, attr = self.builtin_options[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    def items(self) -> list[tuple[str, T]]:
        """(name, plug-in) for every name: imports every built-in module."""
        return [(n, self.get(n)) for n in self.names()]


# ------------------------------------------------------------------------------ what ships with effkit
# The order of a table is the order plug-ins are offered and tried in (`quantize --backend auto` tries
# backends in this order; the bench measures peers in engine order).

BACKENDS: Registry[Any] = Registry("backend", "--backend", {
    "dynamic": "effkit.quantize.backends.dynamic:BACKEND",
    "torchao": "effkit.quantize.backends.torchao:BACKEND",
    "bnb": "effkit.quantize.backends.bnb:BACKEND",
    "onnxruntime": "effkit.quantize.backends.onnxruntime:BACKEND",
    "ctranslate2": "effkit.quantize.backends.ctranslate2:BACKEND",
    "onnxruntime-int4": "effkit.quantize.backends.onnxruntime_int4:BACKEND",
    "openvino": "effkit.quantize.backends.openvino:BACKEND",
    "openvino-int4": "effkit.quantize.backends.openvino_int4:BACKEND",
    "gguf": "effkit.quantize.backends.gguf:BACKEND",
})

# a pruning method's module imports torch: where the options of those that have any live (torch-free, read by
# `effkit prune --help` and recipe validation) is the second table; the method names the same class as `options`
PRUNERS: Registry[Any] = Registry("pruning method", "--mode", {
    "weight": "effkit.prune.weight:PRUNER",
    "row": "effkit.prune.row:PRUNER",
    "width": "effkit.prune.width:PRUNER",
    "depth": "effkit.prune.depth:PRUNER",
    "draft": "effkit.prune.draft:PRUNER",
}, options={
    "row": "effkit.prune.options:Options",
    "width": "effkit.prune.options:Options",
    "draft": "effkit.prune.options:DraftOptions",
})

ENGINES: Registry[Any] = Registry("engine", "engine", {
    "pytorch": "effkit.engines.pytorch:ENGINE",
    "ctranslate2": "effkit.engines.ctranslate2:ENGINE",
    "onnxruntime": "effkit.engines.onnxruntime:ENGINE",
    "openvino": "effkit.engines.openvino:ENGINE",
    "llamacpp": "effkit.engines.llamacpp:ENGINE",
})

OPTIMIZERS: Registry[Any] = Registry("optimizer", "--optim", {
    "adamw": "effkit.optim:ADAMW",
    "adamw-fused": "effkit.optim:ADAMW_FUSED",
    "adamw8bit": "effkit.optim:ADAMW8BIT",
})

# the stages `effkit run` runs, in the order it runs them (a recipe's [run] stages lists some of them)
STAGES: Registry[Any] = Registry("stage", "stage", {
    "train": "effkit.train:STAGE",
    "prune": "effkit.prune.stage:STAGE",
    "quantize": "effkit.quantize.stage:STAGE",
    "bench": "effkit.bench.stage:STAGE",
    "report": "effkit.report:STAGE",
})

# `effkit study NAME`: each study is one module under effkit/studies/ (its run and its plot: a `Study`), offered
# in this order (`effkit.studies.names()`)
STUDIES: Registry[Any] = Registry("study", "study", {
    "sync": "effkit.studies.sync:STUDY",
    "scaling": "effkit.studies.scaling:STUDY",
    "batch-size": "effkit.studies.batch_size:STUDY",
    "amp": "effkit.studies.amp:STUDY",
    "checkpointing": "effkit.studies.checkpointing:STUDY",
    "dataloader": "effkit.studies.dataloader:STUDY",
    "profile": "effkit.studies.profile:STUDY",
    "pipeline": "effkit.studies.pipeline:STUDY",
    "pp-memory": "effkit.studies.pp_memory:STUDY",
    "memory": "effkit.studies.memory:STUDY",
})
