"""The errors effkit raises and how a run ends on them: `EffkitError` (bad input: one line, exit 2), `WorkerFailed`
(a launched process crashed: exit 1), `Interrupted` (Ctrl-C during training, after a checkpoint), and the Ctrl-C
handling every command shares (`watch_interrupts`, `interrupt_received`, `exit_interrupted`: one line, exit 130)."""

import os


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
    """Remember that Ctrl-C arrived, then raise KeyboardInterrupt as Python's own handler does, but never while torch
    is being imported: raised there, it can land in Python code that torch's C++ called, which cannot pass it on and
    aborts the process (SIGABRT and a stack dump; seen once in CI). Such a Ctrl-C waits until that import is over
    (asked again every 50 ms; torch loads in 1-2 s). A C extension that still turns a Ctrl-C into its own error
    (numpy: "numpy._core.umath failed to import") is caught by the CLI through `interrupt_received()`: one line and
    exit code 130 all the same. A SIGINT the process was told to ignore stays ignored."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def handler(signum, frame):
        global _interrupt_received
        _interrupt_received = True
        if _inside_torch_import(frame):
            _ask_again(0.05)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _inside_torch_import(frame) -> bool:
    """Whether the main thread is importing torch (any module of it): the import that aborts on a KeyboardInterrupt."""
    importing = in_torch = False
    while frame is not None:
        name = frame.f_code.co_filename
        importing = importing or name.startswith("<frozen importlib")
        in_torch = in_torch or f"{os.sep}torch{os.sep}" in name
        frame = frame.f_back
    return importing and in_torch


def _ask_again(delay_s: float) -> None:
    """SIGINT to the main thread again after `delay_s` (a daemon timer; one pending at a time). Sent to that thread
    itself, so that a blocking call it has gone on to (a sleep, a wait) is interrupted as by the first Ctrl-C."""
    import _thread
    import signal
    import threading

    global _retry
    if _retry is not None and _retry.is_alive():
        return
    main = threading.main_thread().ident
    if hasattr(signal, "pthread_kill"):
        def again() -> None:
            signal.pthread_kill(main, signal.SIGINT)
    else:  # no POSIX threads' kill (Windows): the handler runs at the main thread's next bytecode
        again = _thread.interrupt_main
    _retry = threading.Timer(delay_s, again)
    _retry.daemon = True
    _retry.start()


_retry = None


def interrupt_received() -> bool:
    return _interrupt_received
