"""The quantized artifact's marker: `quantization.json` names the backend that wrote the folder, its format and
the layers it holds. The loader reads it to hand the folder to that backend (through `effkit.registry`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError

QUANT_FILE = "quantization.json"  # in every quantized artifact: the backend, its format and the layers it holds


def description(folder: str | Path) -> dict[str, Any]:
    """The quantization.json of a quantized artifact (a one-line error if it is corrupt)."""
    path = Path(folder) / QUANT_FILE
    try:
        desc = json.loads(path.read_text())
        desc["backend"], desc["layers"]  # noqa: B018 - the keys every description has
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise EffkitError(f"{path} is corrupt ({type(e).__name__}); quantize the parent again") from None
    return desc


def is_quantized(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def write(folder: Path, backend: Any, parent: Any, source: Path, tokenizer, cfg: Any, device: Any) -> dict[str, Any]:
    """`backend` (a quantization backend, `effkit.quantize.backends.Backend`) writes its artifact of `parent`
    (loaded from the artifact `source`) into `folder` with the options of `cfg` (a `QuantizeConfig`); its
    description, every backend's options as resolved (each reads its own, so the folder says how it was made), is
    written to `quantization.json` and returned."""
    desc: dict[str, Any] = {"backend": backend.name, "include_head": cfg.method.include_head,
                            **cfg.options.to_dict(), "portability": backend.portability}
    written = backend.write(folder, parent, source, tokenizer, cfg, device)
    layers = written.pop("layers")
    desc.update(written)
    desc["layers"] = layers
    (Path(folder) / QUANT_FILE).write_text(json.dumps(desc, indent=2))
    return desc
