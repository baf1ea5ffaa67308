"""One protocol for every child process effkit starts: launched training ranks and fresh-process measurements.

A job is a folder. `spec.json` names the function (`"package.module:function"`) and its JSON-able keyword
arguments; every process of the job runs `python -m effkit.child JOB` (alone, or once per rank under Accelerate's
launcher), which calls the function and then:

- on success, rank 0 writes what it returned (JSON-able) to `result.json`;
- on an `EffkitError` (bad input), records `errors/rank<R>.json` {rank, kind "user", message, time}, prints one
  line and exits 2;
- on any other exception, records the same with kind "crash" (the first line of the exception), prints the
  traceback to stderr and exits 1.

The parent reads the result, or the earliest recorded failure (`Job.failures`); a rank killed by a signal cannot
record anything, and the launcher's own log names it (`effkit.parallel.launch`). Nothing is passed through
environment variables (only tests set one, `EFFKIT_FAULT_INJECT`): the job folder is the whole interface.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError

MODULE = "effkit.child"
ERROR_PREFIX = "effkit: error: "


@dataclass(frozen=True)
class Job:
    folder: Path

    @classmethod
    def create(cls, target: str, kwargs: dict[str, Any], prefix: str = "effkit-job-") -> Job:
        """A new job folder (a temporary directory) holding the call's spec."""
        job = cls(Path(tempfile.mkdtemp(prefix=prefix)))
        job.spec_path.write_text(json.dumps({"target": target, "kwargs": kwargs}, indent=1, default=list))
        return job

    @property
    def spec_path(self) -> Path:
        return self.folder / "spec.json"

    @property
    def result_path(self) -> Path:
        return self.folder / "result.json"

    @property
    def errors(self) -> Path:
        return self.folder / "errors"

    def module_args(self) -> list[str]:
        """What follows the interpreter (or a launcher's `-m`) to run one process of this job."""
        return ["-m", MODULE, str(self.folder)]

    def result(self) -> Any:
        return json.loads(self.result_path.read_text())

    def failures(self) -> list[dict[str, Any]]:
        """The failures the processes recorded themselves, earliest first."""
        reports = sorted(self.errors.glob("rank*.json")) if self.errors.is_dir() else []
        return sorted((json.loads(p.read_text()) for p in reports), key=lambda r: r["time"])

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def record_failure(self, kind: str, message: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        self.errors.mkdir(parents=True, exist_ok=True)
        (self.errors / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "kind": kind, "message": message,
                                                                  "time": time.time()}))


def run_isolated(target: str, kwargs: dict[str, Any], what: str, env: dict[str, str] | None = None) -> Any:
    """Call `target` with `kwargs` in one fresh Python process and return what it returned. Used where a
    measurement must not share a process with what ran before it (on CPU, peak memory is the process' resident
    high-water mark, which memory freed by an earlier run would hide). A failure there becomes one
    `EffkitError` here naming `what`."""
    job = Job.create(target, kwargs, prefix="effkit-isolated-")
    try:
        proc = subprocess.run([sys.executable, *job.module_args()], capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
        if proc.returncode == 0 and job.result_path.is_file():
            return job.result()
        failures = job.failures()
        last = failures[0]["message"] if failures else \
            (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}, no output"])[-1]
        raise EffkitError(f"{what} failed: {last}")
    finally:
        job.remove()


def main(folder: str) -> int:
    from effkit.quiet import quiet_libraries

    quiet_libraries()
    job = Job(Path(folder))
    try:
        spec = json.loads(job.spec_path.read_text())
        module, _, name = spec["target"].partition(":")
        result = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    except EffkitError as e:
        job.record_failure("user", str(e))
        print(f"{ERROR_PREFIX}{e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the parent with the failing rank
        job.record_failure("crash", f"{type(e).__name__}: {e}".splitlines()[0][:300])
        traceback.print_exc()
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        job.result_path.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
