"""The pruning methods: one module each, one registry that the stage, the config's validation and `--help` read.

A method (`Pruner`) names itself, says whether it removes whole structures (then fine-tuning distils by default and
the pipeline treats it as structured), which `--importance` values it accepts (the first is its default), and how it
ranks what it removes; `plan` checks the shape the last round would leave (refused in one line before anything is
written) and `start` returns the cut that one round applies. A method with options of its own names their dataclass
as `options` (field default, type, and `help` in the field's metadata, as a quantization backend's `Options`) and
reads them with `options_of(cfg, Options)`; row and width share `options.Options` (`--width-multiple`), in a
module without torch that `registry.PRUNERS` names for them, so `--help` and recipe validation read it unimported.

Adding a method: write `effkit/prune/<name>.py` with a module-level `PRUNER` and add one line to
`effkit.registry.PRUNERS` (and, where it has options, one to its `options` table: where the dataclass lives, in a
module without torch); a test or a plug-in can also `register()` one at run time (its `options` is then read from
it). `names()` and `PRUNERS.options()` import no method module (`--help` reads them without torch); `get()` imports
the one asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from effkit.registry import PRUNERS

# one round's cut: (model, fraction removed in all after this round, calibration batches) ->
# (the pruned model, what this round measured, a hook re-applied after each fine-tuning step or None)
Cut = Callable[[Any, float, Any], tuple[Any, dict, Any]]


class Pruner(Protocol):
    name: str
    structured: bool
    importances: tuple[str, ...]
    counts_block_params: bool  # its sparsity is the fraction of block parameters removed (else: of weights)

    def ranks_by(self, cfg) -> str: ...

    def needs_calibration(self, cfg) -> bool: ...

    def plan(self, cfg, model) -> dict: ...

    def start(self, cfg, model) -> Cut: ...

    # optional: the model's configuration (a GPT2Config) after a cut of `fraction`, from shapes alone, for the memory
    # plan's student (a method without it is planned at the parent's size, an upper bound)
    # def cut_config(self, cfg, config, fraction: float): ...

    # optional: what each round's metrics add, from the round's model, the dense parent, the data's blocks and the
    # parent's folder (a draft's acceptance and cost, `effkit.prune.draft`)
    # def round_metrics(self, cfg, model, dense_model, blocks, source): ...


def options_of(cfg, options: type) -> Any:
    """A method's own options from a prune config, as its dataclass: from the config's plug-in section where it has
    one (`cfg.options`, a `config.PluginOptions`: the values its flags and recipe keys set), an instance of the
    dataclass given as is (a test, a caller applying the method directly), else the dataclass's defaults (a config
    without such a section has nothing that could set them)."""
    given = getattr(cfg, "options", None)
    if given is None:
        return options()
    return given if isinstance(given, options) else given.of(options)


register = PRUNERS.register
unregister = PRUNERS.unregister
names = PRUNERS.names
get = PRUNERS.get
