"""The quantization backends: one module each, one registry that everything else reads.

A backend turns a dense or pruned PyTorch model into an artifact folder and loads it back from that folder alone.
`effkit quantize --backend` (its choices and `--help`), `--backend auto` (its candidates, in registry order), the
loader (`effkit.artifacts.loader.load_any`), `effkit doctor` and the delivered artifact's "load it" line all read this
registry; nothing else switches on a backend's name.

Adding a backend: write `effkit/quantize/backends/<name>.py` with a module-level `BACKEND` (an object with the
`Backend` attributes below) and add one line to `effkit.registry.BACKENDS`. A test or a plug-in can also `register()`
an object at run time. The registry itself imports nothing heavy: `names()` is what `effkit --help` shows without
torch; a backend's module is imported the first time `get()` asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

from effkit.artifacts.quantized import QUANT_FILE, description, is_quantized  # noqa: F401 - the format's helpers
from effkit.registry import BACKENDS


class Backend(Protocol):
    """What a quantization backend provides.

    name: its registry name (the `--backend` value, part of the artifact tag `quantize-<name>`).
    summary: a few words for `--help`.
    format: the format written to quantization.json (`effkit`, `onnx`, `transformers-bitsandbytes`, ...).
    portability: who can load its artifacts, in words (reported).
    devices: the device types it runs on (`cpu`, `cuda`).
    """

    name: str
    summary: str
    format: str
    portability: str
    devices: tuple[str, ...]

    def available(self, device: torch.device | None = None) -> str | None:
        """None if it can run on `device` (default the CPU), else the reason it cannot."""

    def refuses(self, cfg: Any) -> str | None:
        """None if it can quantize with these options (a `QuantizeConfig`), else why not (one line)."""

    def tag(self, cfg: Any) -> str:
        """The artifact tag for these options (`quantize-dynamic-head`)."""

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg: Any,
              device: torch.device) -> dict[str, Any]:
        """Write the artifact of `parent` (loaded from the artifact folder `source`) into `folder`; return its
        description (format, storage, layers) for quantization.json."""

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        """The artifact in `folder` (with its quantization.json `desc`) as a model on `device`."""

    def quantized_layers(self, model: nn.Module) -> int:
        """The quantized layers the reloaded `model` really holds (int8 modules, or int8 operators of a graph)."""

    def load_command(self, folder: Path) -> str:
        """How a user loads the artifact outside effkit (or with it, where nothing else can)."""

    def memory(self, cfg: Any) -> Memory:
        """What its write and its reloaded artifact add to `effkit quantize`'s resident set with these options
        (`effkit quantize --plan`); optional: a backend without it is planned at the largest built-in's figures."""


MIB = 2**20


@dataclass(frozen=True)
class Memory:
    """What a backend adds to the resident set of one `effkit quantize` process on a CPU, each as (MiB, x): MiB
    fixed (its libraries, their buffers) plus x times the parent's fp32 weights (4 bytes a parameter). `write`: the
    high-water mark of its write (`write_quantized`) over the parent already loaded and evaluated; `loaded`: that of
    its artifact reloaded from the folder (`load_any`) and run as the stage runs it (evaluated, a (12, block)
    forward, greedy decoding) over the parent; `beside`: what that reload leaves resident beside the other backends'
    (`--backend auto` times its candidates side by side: each reloaded in auto's order, run, kept). `measured`: on
    what, with what, on which machine. `lighter`: where other options of the same backend need less (what to type,
    the flat keys it changes), else None."""

    write: tuple[float, float]
    loaded: tuple[float, float]
    beside: tuple[float, float]
    measured: str
    lighter: tuple[str, dict[str, Any]] | None = None

    def write_bytes(self, fp32_bytes: int) -> int:
        return int(self.write[0] * MIB + self.write[1] * fp32_bytes)

    def loaded_bytes(self, fp32_bytes: int) -> int:
        return int(self.loaded[0] * MIB + self.loaded[1] * fp32_bytes)

    def beside_bytes(self, fp32_bytes: int) -> int:
        return int(self.beside[0] * MIB + self.beside[1] * fp32_bytes)


# how every built-in backend's `Memory` was measured (two model sizes, the write and the reload each in a fresh
# process, every backend's reload kept in auto's order in a third): MEASURED; the figures are in docs/benchmarks.md.
# The fixed part is the intercept of the line through the two models' figures (0 where it came out negative: the
# line then goes through the larger model's figure and the origin)
MEASURED = ("gpt2-mini (13.9M) and gpt2 (92.1M), vocabulary 8,192, block 128: the write and the reload each in a "
            "fresh process over the loaded parent, and every backend's reload kept in auto's order in a third; RSS "
            "sampled every 5 ms; 2-core AMD EPYC, 24 GiB (#47)")


register = BACKENDS.register
unregister = BACKENDS.unregister
names = BACKENDS.names  # every backend's name, in auto's order (no backend module is imported)
get = BACKENDS.get


def unavailable(name: str, device: torch.device | None = None) -> str | None:
    """Why backend `name` cannot run on `device` (None if it can); an unknown name is a reason too."""
    if name not in BACKENDS:
        return f"unknown backend {name}"
    return get(name).available(device)
