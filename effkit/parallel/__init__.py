"""Parallelism: process runtime (launch, process groups, meshes) and `apply_*` functions per mode."""

from effkit.parallel.runtime import Runtime, init_runtime

__all__ = ["Runtime", "init_runtime"]
