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


@dataclass(frozen=True)
class DraftOptions(Options):
    """`effkit prune --mode draft`'s own options: `--target` removes that fraction of the blocks (as depth), these
    narrow the MLP as well and say how the draft is judged (its acceptance of the target's greedy tokens on held-out
    prompts, and its cost per token against the target's)."""

    draft_narrow: float = field(default=0.0, metadata={
        "help": "draft: fraction of the MLP channels removed as well as the blocks (0: blocks only; the kept width "
                "rounded to --width-multiple)"})
    draft_k: int = field(default=4, metadata={
        "help": "draft: tokens the draft proposes per target forward (k) when its acceptance is measured"})
    draft_prompts: int = field(default=8, metadata={
        "help": "draft: held-out prompts its acceptance is measured on (one per held-out block, from the first)"})
    draft_new_tokens: int = field(default=32, metadata={
        "help": "draft: the target's greedy tokens per prompt that the draft is checked against"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.draft_narrow, bool) or not 0 <= self.draft_narrow < 1:
            raise EffkitError(f"--draft-narrow must be in [0, 1) (got {self.draft_narrow!r})")
        for name in ("draft_k", "draft_prompts", "draft_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EffkitError(f"--{name.replace('_', '-')} must be a whole number, 1 or more (got {value!r})")
