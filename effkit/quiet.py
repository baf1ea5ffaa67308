"""Library noise off: one place that silences the warnings and progress bars effkit's dependencies print."""

from __future__ import annotations

import logging
import os
import warnings

# Notices that libraries print when they are imported, about things effkit never uses; each is matched exactly, so
# anything else those loggers say (a real error) still shows.
IMPORT_NOISE = {
    # torchao on a CPU-only or other-CUDA build: its optional CUDA kernels (mxfp8, cutlass) do not load
    "torchao": lambda msg: msg.startswith("Failed to load ") and ".so" in msg,
    # torchao registering its enums with torch.compile (a deprecation notice for torchao's authors)
    "torch.utils._pytree": lambda msg: "is an Enum subclass and is now natively supported" in msg,
}


class _Drop(logging.Filter):
    def __init__(self, match):
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True  # errors always show
        try:
            return not self.match(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is shown as it is
            return True


def silence_import_noise() -> None:
    """Filters for the notices above, attached to the loggers themselves (levels may be reset by torch's own
    logging setup; filters are not): called when effkit is imported, before any of those libraries is."""
    for name, match in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(match))


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enum registration notices
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
