"""What measurement reads of a model an engine loads beyond what every PyTorch causal LM has (`model(ids).logits`,
`generate(...)`, `config`, `eval()`), declared once with its defaults. An engine's model wrapper extends
`EngineModel` and overrides what differs; a PyTorch model (transformers' GPT-2, a quantized backend's) has the
defaults, which `model_attr` reads for any model. Engines sit above this layer: they import it, not the reverse."""

from __future__ import annotations

from typing import Any

from torch import nn


class EngineModel(nn.Module):
    """The base of an engine's model wrapper (one that runs its own kernels or graph behind effkit's model
    interface)."""

    compilable: bool = True  # torch.compile applies to it (False: the engine compiles or runs its own graph)
    # seconds of idle machine to leave after timing it, before the next contender: engines whose threads spin-wait
    # after a run (`effkit.measure.timing.settle_time`)
    settle_s: float = 0.0
    generation_note: str | None = None  # what a reader of its generation figures must know (reports carry it)
    n_params: int | None = None  # the parent's parameter count, for a wrapper that holds no PyTorch parameters


def model_attr(model: Any, name: str) -> Any:
    """`model`'s `name` of the interface (`EngineModel`'s attributes), or its declared default where `model` does
    not extend `EngineModel`; also read off a timer function, which an engine may give its model's `settle_s`."""
    return getattr(model, name, getattr(EngineModel, name))
