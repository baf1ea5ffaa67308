"""One protocol for every child process effkit starts: launched training ranks and fresh-process measurements.

A job is a folder. `spec.json` names the function (`"package.module:function"`) and its JSON-able keyword
arguments; every process of the job runs `main(JOB)` (alone, or once per rank; `start` below, or `python -m
effkit.child JOB` by hand or under another launcher), which calls the function and then:

- on success, rank 0 writes what it returned (JSON-able) to `result.json`;
- on an `EffkitError` (bad input), records `errors/rank<R>.json` {rank, kind "user", message, time}, prints one
  line and exits 2;
- on any other exception, records the same with kind "crash" (the first line of the exception), prints the
  traceback to stderr and exits 1.

The parent reads the result, or the earliest recorded failure (`Job.failures`); a rank killed by a signal cannot
record anything, and the launcher names it (`effkit.parallel.launch`). Nothing is passed through environment
variables (only tests set one, `EFFKIT_FAULT_INJECT`): the job folder is the whole interface.

Where effkit starts them itself (`start`), the processes are forked from a server process that imported torch,
transformers and effkit once (multiprocessing's forkserver, started on first use and kept for the life of this
process): a fresh interpreter pays those imports again per process, seconds of CPU each, and a launch starts one per
rank. The server only imports, so no fork copies a running thread pool; each process then takes the environment
and the standard streams its caller has at that moment, as a fresh process would (`_enter`). As with any
multiprocessing start method but fork, a script that calls effkit's API keeps its own work under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
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


# what the server imports once: what every job imports first (a module that fails to import is skipped there and
# imported, or refused, by the job itself)
PRELOAD = ["torch", "transformers", "transformers.models.gpt2.modeling_gpt2", "accelerate", "effkit.train"]


def context():
    """The multiprocessing context effkit's processes start from: the forkserver with `PRELOAD` (spawn where the
    platform has no forkserver: every process then imports for itself)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first process of this one
    _socket_folder()
    return ctx


def _socket_folder() -> None:
    """The server listens on a socket in multiprocessing's temporary folder, made under $TMPDIR on first use; a
    socket's path is capped (107 bytes on Linux), so under a deep $TMPDIR that folder goes in /tmp instead."""
    from multiprocessing import process, util

    if "tempdir" in process.current_process()._config or len(tempfile.gettempdir()) <= 60 \
            or not os.access("/tmp", os.W_OK):
        return
    was, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()  # made now, removed by multiprocessing at exit
    finally:
        tempfile.tempdir = was


class InheritedFd:
    """A file descriptor of this process handed to a started process (multiprocessing passes it over its socket,
    as it does a connection's), where it becomes that process' stdout or stderr."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _detach, (DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _enter(env: dict[str, str], stdout: int | None, stderr: int | None) -> None:
    """Make a process forked from the server what a fresh one started now would be: its caller's environment, its
    caller's streams, the thread count asked for; and one that ends with its caller (the server, which ends with
    the effkit process that started it) rather than run on alone."""
    import signal
    import tempfile

    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    for fd, target in ((stdout, 1), (stderr, 2)):
        if fd is not None:
            os.dup2(fd, target)
    if env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))


def process_main(folder: str, env: dict[str, str], stdout: int | None = None, stderr: int | None = None) -> None:
    """What a started process runs: `_enter`, then the job (`main`); exits with main's code."""
    _enter(env, stdout, stderr)
    code = main(folder)
    if code:
        sys.exit(code)


def start(job: Job, env: dict[str, str], stdout: int | None = None, stderr: int | None = None):
    """One process of `job`, started (forked from the server) with `env` as its whole environment and, where
    given, these file descriptors as its stdout and stderr (else the server's, which are this process' as they were
    when the server started); the caller joins it (`.join()`, `.exitcode`)."""
    proc = context().Process(target=process_main, name=f"effkit-{job.folder.name}",
                             args=(str(job.folder), env, *(None if fd is None else InheritedFd(fd)
                                                           for fd in (stdout, stderr))))
    proc.start()
    return proc


def run_isolated(target: str, kwargs: dict[str, Any], what: str, env: dict[str, str] | None = None) -> Any:
    """Call `target` with `kwargs` in one fresh process (`start`) and return what it returned. Used where a
    measurement must not share a process with what ran before it (on CPU, peak memory is the process' resident
    high-water mark, which memory freed by an earlier run would hide). A failure there becomes one
    `EffkitError` here naming `what`."""
    job = Job.create(target, kwargs, prefix="effkit-isolated-")
    try:
        with (job.folder / "stdout").open("w") as out, (job.folder / "stderr").open("w") as err:
            proc = start(job, {**os.environ, **(env or {})}, out.fileno(), err.fileno())
            proc.join()
        if proc.exitcode == 0 and job.result_path.is_file():
            return job.result()
        failures = job.failures()
        said = (job.folder / "stderr").read_text(errors="replace").strip().splitlines()
        last = failures[0]["message"] if failures else (said or [f"exit code {proc.exitcode}, no output"])[-1]
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
