"""The pruning methods' own options, in a module that imports no torch: `Options` (`--width-multiple`, which row
and width pruning share), its default `WIDTH_MULTIPLE` and its check `check_multiple`.

`effkit.registry.PRUNERS` names this module for the built-in methods' options, so the CLI (`effkit prune --help`),
`config.PruneConfig.options` (the flag, the recipe's `[prune] width_multiple`) and recipe validation read the field
without importing a method module (row and width import torch); the methods read the value with
`methods.options_of(cfg, Options)`. `structure` re-exports all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from effkit.errors import EffkitError

WIDTH_MULTIPLE = 32  # llama.cpp's Q8_0 / Q4_0 block: the coarsest block among the engines effkit exports to by default


def check_multiple(multiple) -> None:
    # bool is an int to Python; a recipe's `width_multiple = true` is a mistake, not 1
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise EffkitError(f"--width-multiple must be a whole number of channels, 1 or more (got {multiple!r}); "
                          f"{WIDTH_MULTIPLE} fits llama.cpp's Q8_0/Q4_0 blocks, 1 keeps any width")


@dataclass(frozen=True)
class Options:
    """`effkit prune --mode row|width`'s own option (declared once: its flag, recipe key and --help line come from
    here; both methods name this dataclass as their `options`, and `registry.PRUNERS` names it for them)."""

    width_multiple: int = field(default=WIDTH_MULTIPLE, metadata={
        "help": "row, width: round the kept MLP (row) or residual (width) width to the nearest multiple of this, 1 or "
                "more (never to 0, never above the original; width also to a multiple of the heads): 32 fits "
                "llama.cpp's Q8_0/Q4_0 blocks and ONNX Runtime's MatMulNBits; 1 keeps any width"})

    def __post_init__(self) -> None:
        check_multiple(self.width_multiple)
