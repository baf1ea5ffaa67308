"""The errors effkit raises and how a run ends on them: `EffkitError` (bad input: one line, exit 2), `WorkerFailed`
(a launched process crashed: exit 1), `Interrupted` (Ctrl-C during training, after a checkpoint), and the Ctrl-C
handling every command shares (`watch_interrupts`, `interrupt_received`, `exit_interrupted`: one line, exit 130)."""


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


_interrupt_received = False


def watch_interrupts() -> None:
    """Remember that Ctrl-C arrived, then raise KeyboardInterrupt as Python's own handler does. A Ctrl-C that lands
    inside a C extension's import becomes some other error there (numpy raises "numpy._core.umath failed to
    import"); the CLI asks `interrupt_received()` and still ends in one line with exit code 130. A SIGINT the
    process was told to ignore stays ignored."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def handler(signum, frame):
        global _interrupt_received
        _interrupt_received = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def interrupt_received() -> bool:
    return _interrupt_received
