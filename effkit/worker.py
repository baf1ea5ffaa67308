"""Entry point of each launched training process: `python -m effkit.worker CONFIG.json` (started by
`effkit.parallel.launch`). A failure is recorded for the launcher with its rank, kind and time."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def _report_error(kind: str, message: str) -> None:
    errors = os.environ.get("EFFKIT_ERRORS_DIR")
    rank = os.environ.get("RANK", "0")
    if errors:
        Path(errors).mkdir(parents=True, exist_ok=True)
        (Path(errors) / f"rank{rank}.json").write_text(json.dumps({"rank": int(rank), "kind": kind, "message": message,
                                                                   "time": time.time()}))


def _fault_injection():
    """`EFFKIT_FAULT_INJECT=RANK:STEP` makes that rank raise after that step, `RANK:STEP:kill` makes it die by
    SIGKILL (no chance to report anything): to test failure handling."""
    spec = os.environ.get("EFFKIT_FAULT_INJECT")
    if not spec:
        return None
    rank, step, *how = spec.split(":")

    def on_step(s: int, loss: float) -> None:
        if s == int(step) and int(os.environ.get("RANK", "0")) == int(rank):
            if how == ["kill"]:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fault injected at step {s} (EFFKIT_FAULT_INJECT={spec})")

    return on_step


def main(argv: list[str]) -> int:
    from effkit.config import TrainConfig
    from effkit.errors import EffkitError
    from effkit.quiet import quiet_libraries

    quiet_libraries()
    try:
        from effkit.train import train

        cfg = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
        train(cfg, on_step=_fault_injection(), progress=not os.environ.get("EFFKIT_NO_PROGRESS"))
    except EffkitError as e:
        _report_error("user", str(e))
        print(f"effkit: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the parent with the failing rank
        _report_error("crash", f"{type(e).__name__}: {e}".splitlines()[0][:300])
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
