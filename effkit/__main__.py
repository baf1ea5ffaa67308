"""`python -m effkit` and the `effkit` command. The libraries load inside the guard, so Ctrl-C in the first
second ends in one line like everywhere else."""


def main() -> None:
    import sys

    from effkit.errors import EffkitError, exit_interrupted, interrupt_received, watch_interrupts

    watch_interrupts()
    try:
        from effkit.cli import main as cli_main
    except KeyboardInterrupt:
        exit_interrupted()
    except EffkitError as e:  # e.g. a plug-in named in $EFFKIT_PLUGINS that does not import: one line, exit 2
        print(f"effkit: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception:
        if interrupt_received():  # Ctrl-C inside a C extension's import surfaces as its own error
            exit_interrupted()
        raise
    try:
        cli_main()
    except SystemExit as e:
        leave(e.code)
    leave(0)


def leave(code: int | str | None) -> None:
    """End the command as CPython would, less the finalization of every module it loaded (torch's and
    transformers' take over a second after the work is done and said): non-daemon threads joined, the atexit
    handlers run (multiprocessing's among them), the streams flushed, then `os._exit` with `code`."""
    import atexit
    import os
    import sys
    import threading

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    threading._shutdown()  # what interpreter shutdown does first (and concurrent.futures' exit hooks)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader gone, or a stream closed: nothing left to say
            pass
    os._exit(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    main()
