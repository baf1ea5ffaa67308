class EffkitError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with `exit_code` (2: bad input)."""

    exit_code = 2


class WorkerFailed(EffkitError):
    """A launched process crashed (not bad input): one line naming the rank, exit code 1."""

    exit_code = 1


class Interrupted(Exception):
    """Training was interrupted (Ctrl-C); a checkpoint was written and `--resume` continues (exit code 130)."""


def exit_interrupted(message: str = "interrupted") -> None:
    """Ctrl-C: say it in one line and end with exit code 130. `os._exit` after flushing, because CPython ends a
    process by SIGINT (exit -2) whenever a KeyboardInterrupt once escaped code run through `exec` of a string (as
    dataclasses and lazy imports do), even when effkit caught it afterwards."""
    import os
    import sys

    print(f"effkit: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
