"""Run one function in a fresh Python process and collect its JSON result.

Used where a measurement must not share a process with what ran before it: on CPU, peak memory is the
process' resident high-water mark, which memory freed by an earlier run (and kept by the allocator) would
hide. Multi-process training does not come through here: it goes through Accelerate's launcher.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError

ERROR_PREFIX = "effkit: error: "


def run_isolated(target: str, kwargs: dict[str, Any], what: str, env: dict[str, str] | None = None) -> Any:
    """Call `target` ("package.module:function") with `kwargs` (JSON-able) in a fresh process; return what it
    returned (JSON-able). An EffkitError there, or a crash, becomes one EffkitError here naming `what`."""
    with tempfile.TemporaryDirectory(prefix="effkit-isolated-") as d:
        (Path(d) / "spec.json").write_text(json.dumps({"target": target, "kwargs": kwargs}, default=list))
        proc = subprocess.run([sys.executable, "-m", "effkit.isolated", d], capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
        result = Path(d) / "result.json"
        if proc.returncode != 0 or not result.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1].removeprefix(ERROR_PREFIX)
            raise EffkitError(f"{what} failed: {last}")
        return json.loads(result.read_text())


def _main(folder: str) -> int:
    from effkit.quiet import quiet_libraries

    quiet_libraries()
    spec = json.loads((Path(folder) / "spec.json").read_text())
    module, _, name = spec["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(**spec["kwargs"])
    except EffkitError as e:
        print(f"{ERROR_PREFIX}{e}", file=sys.stderr)
        return 2
    (Path(folder) / "result.json").write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
