class EffkitError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with `exit_code` (2: bad input)."""

    exit_code = 2


class WorkerFailed(EffkitError):
    """A launched process crashed (not bad input): one line naming the rank, exit code 1."""

    exit_code = 1


class Interrupted(Exception):
    """Training was interrupted (Ctrl-C); a checkpoint was written and `--resume` continues (exit code 130)."""
