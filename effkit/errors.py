class EffkitError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with code 2."""
