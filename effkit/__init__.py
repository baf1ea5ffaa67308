"""effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers."""

__version__ = "0.1.0"

from effkit.quiet import silence_import_noise as _silence

_silence()  # third-party import notices (torchao's CUDA kernels on a CPU build, ...), matched exactly
