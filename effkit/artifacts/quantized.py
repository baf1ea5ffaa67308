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
