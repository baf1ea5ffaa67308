"""Pruning: the registry of methods (`effkit.prune.methods`: weight, row, width, depth, one module each), their own
options (`options`, without torch), what they share (`structure`), distillation, and the `effkit prune` stage
(`effkit.prune.stage`)."""
