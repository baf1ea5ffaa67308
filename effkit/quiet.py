"""Library noise off: one place that silences the warnings and progress bars effkit's dependencies print."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enum registration notices
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
