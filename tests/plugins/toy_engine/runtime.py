"""The toy engine's runtime: how it loads an artifact and times its decoding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load(path: Path, device: Any):
    from effkit.model import load_model

    model = load_model(str(path)).to(device)
    model.toy_folder = Path(path)
    return model


def counted(timer, model: Any, batch: int):
    """`timer`, counting its calls in the artifact's folder (or $TOY_CALLS_DIR), so a test can see they ran."""
    folder = Path(os.environ.get("TOY_CALLS_DIR", model.toy_folder))

    def call():
        calls = folder / f"decode_b{batch}.calls"
        calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
        return timer()

    call.settle_s = timer.settle_s if hasattr(timer, "settle_s") else 0.0
    call.at_round = getattr(timer, "at_round", None)  # the round's prompts, as every other contender's
    return call
