"""A toy engine as one package, as a user's engine (or one of effkit's, under effkit/engines/<name>/) is: the
`Engine` object here, its runtime beside it; registered when the package is imported. It runs the reference's own
weights in PyTorch, with a marker file of its own: enough for the bench to load, time and compare it as a peer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from effkit import engines
from toy_engine import runtime

TOY_MARKER = "toy.json"


class ToyEngine(engines.Engine):
    name = "toy"
    label = "Toy"
    noun = "a toy"
    marker = TOY_MARKER
    summary = "a toy engine (PyTorch underneath)"
    peer_tag = "peer-toy"
    peer_how = "the reference's weights saved again, run by the toy engine"

    def available(self, device: Any = None, **options: Any) -> str | None:
        return None

    def write_peer(self, folder: Path, reference: Path, model: Any, tokenizer: Any) -> dict[str, Any]:
        import shutil

        for f in Path(reference).iterdir():  # the reference's Hugging Face files (not its effkit.json)
            if f.is_file() and f.name != "effkit.json":
                shutil.copy(f, folder / f.name)
        desc = {"format": "toy", "params": sum(p.numel() for p in model.parameters())}
        (folder / TOY_MARKER).write_text(json.dumps(desc))
        return desc

    def load(self, path: Path, device: Any):
        return runtime.load(path, device)

    def decode(self, model: Any, tokenizer: Any, batch: int, new_tokens: int, generate_kwargs=None, prompts=None):
        return runtime.counted(super().decode(model, tokenizer, batch, new_tokens, generate_kwargs, prompts), model,
                               batch)


ENGINE = engines.register(ToyEngine())
