"""Pruning: the registry of methods (`effkit.prune.methods`: weight, row, width, depth, one module each), what
they share (`structure`), distillation, and the `effkit prune` stage (`effkit.prune.stage`)."""
