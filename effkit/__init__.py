"""effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers."""

__version__ = "0.1.0"
