"""Parallelism: the process runtime (device, rank, process group), the layout (`ParallelDims`), the `apply_*`
functions per mode (`parallelize_gpt2`), and the process launcher."""

from effkit.parallel.dims import ParallelDims
from effkit.parallel.runtime import Runtime, init_runtime, resolve_device

__all__ = ["ParallelDims", "Runtime", "init_runtime", "resolve_device"]
