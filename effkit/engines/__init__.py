"""Inference engines: one module or package each (`onnxruntime/`, `ctranslate2/`, `openvino.py`, ...), one interface
(`Engine`), and the engines that offer a peer row (`peers`). What two engines share lives in `decoder_step.py` (the
with-past decoder step they export, the parity rule, token picking) and `shared.py` (the context and CPU checks, the
parity gate, the numpy decode loop, the files saved beside an export): one engine never imports another.

An engine turns a dense or pruned PyTorch artifact into its own format (`convert`), loads such a folder back
behind effkit's model interface (`load`: logits from a forward, greedy decoding with the engine's own cache),
times the two workload kinds on it (`prefill`, `decode`: the bench asks the engine that owns each artifact) and
says what it did (`describe`). Optional: a peer, the dense reference converted the way a user of that engine
would do it without effkit (`effkit bench --peers`), and the line that loads an artifact outside effkit.

Only `name`, `marker`, `available` and `load` are required; everything else defaults to "not supported" or to
effkit's PyTorch timers (optimum-benchmark's backends work the same way). Adding an engine is its module with a
module-level `ENGINE` plus one line in `effkit.registry.ENGINES`; a test or a user's package can `register()` one.
The loader (`effkit.artifacts.loader`), the bench's peers, `effkit export` and `effkit generate` read only this.
What an engine's artifacts weigh in memory, as measured, is data (`memory_calibration.json`, keyed by engine name,
read through `Engine.memory_line`), beside the stages' own measured figures (`memory_figure`, `stage_line`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError
from effkit.registry import ENGINES

_KEEP: list[tuple[Path, dict[str, Any]]] = []  # the open `exports_kept` scopes: (folder, {key: what was kept})


@contextmanager
def exports_kept(folder: Path) -> Iterator[None]:
    """Within this block an engine may keep what it exported (in `folder`, the caller's scratch, removed with it)
    and give the same model's later export a copy (`kept_export`): quantize's auto exports one parent for several
    candidates of one engine. Inside an open scope, a nested one is that scope (what it keeps lives as long)."""
    if _KEEP:
        yield
        return
    _KEEP.append((folder, {}))
    try:
        yield
    finally:
        _KEEP.pop()


def kept_export() -> tuple[Path, dict[str, Any]] | None:
    """The open `exports_kept` scope (its folder, its {key: kept} table), or None outside one."""
    return _KEEP[-1] if _KEEP else None


@contextmanager
def as_exported(model) -> Iterator[Any]:
    """The model an exporter reads: `model` itself where every tensor is already on the CPU in fp32 (in eval mode
    inside the block; its mode and its config's `use_cache` are given back after), otherwise a copy moved there.
    Exporters read the weights and never write them, and a second fp32 copy is what made the large exports not
    fit: gpt2-xl's weights are 5.6 GiB."""
    import copy

    import torch

    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type != "cpu" or (t.is_floating_point() and t.dtype != torch.float32) for t in tensors):
        yield copy.deepcopy(model).cpu().float().eval()
        return
    training, use_cache = model.training, getattr(model.config, "use_cache", None)
    model.eval()
    try:
        yield model
    finally:
        model.train(training)
        if use_cache is not None:
            model.config.use_cache = use_cache


CALIBRATION = Path(__file__).with_name("memory_calibration.json")


@functools.cache
def memory_calibration() -> dict[str, Any]:
    """The measured memory figures (`memory_calibration.json`): each engine's lines by part, each stage's own
    figures, and what each came from (the command, the machine)."""
    return json.loads(CALIBRATION.read_text())


def _line(entry: dict[str, Any]) -> tuple[float, float]:
    return entry["mib"] * 2**20, entry["per_byte"]


def memory_figure(stage: str, name: str) -> float:
    """A stage's own measured figure: bytes where it is in MiB, else its value (a count, a share)."""
    entry = memory_calibration()["stages"][stage][name]
    return entry["value"] * 2**20 if entry["unit"] == "MiB" else entry["value"]


def stage_line(stage: str, name: str) -> tuple[float, float]:
    """A stage's own measured line: (bytes, bytes per byte of the weights)."""
    return _line(memory_calibration()["stages"][stage][name])


register = ENGINES.register
unregister = ENGINES.unregister
names = ENGINES.names
get = ENGINES.get


class Engine:
    """The base every engine extends. `marker` is the file its artifact folders hold (`onnx.json`)."""

    name: str = ""
    marker: str = ""
    label: str = ""  # how tables name it: "ONNX Runtime"
    noun: str = ""  # "an ONNX": how messages name its artifacts ("... is an ONNX artifact")
    summary: str = ""
    format: str = ""  # `effkit export --format` value ("" = not exported by effkit export)
    portability: str = ""  # who can load its artifacts, in words (reported)
    # the peer row: the dense reference through this engine as its users convert it; None: no peer
    peer_tag: str | None = None
    peer_how: str = ""
    settle_s: float = 0.0  # idle seconds after timing one of its models (engines whose threads spin-wait)
    prefill_kwargs: dict[str, Any] = {}  # what a prefill passes to its models' forward (PyTorch: build the cache)
    trains: bool = False  # its (not quantized) artifacts can be trained, pruned and exported: the dense models
    fuses: bool = False  # `effkit export --fuse` applies its runtime's graph fusions to its exports

    def memory_line(self, part: str) -> tuple[float, float] | None:
        """`part` of what this engine's work holds in memory, as measured (`memory_calibration.json`, under this
        engine's name): (bytes, bytes per byte of the weights), a line through two measured models; None where
        this engine was not calibrated for it."""
        entry = memory_calibration()["engines"].get(self.name, {}).get(part)
        return None if entry is None else _line(entry)

    def owns(self, path: str | Path) -> bool:
        """Whether the artifact folder `path` is this engine's."""
        return bool(self.marker) and (Path(path) / self.marker).is_file()

    def available(self, device: Any = None, path: Path | None = None, **options: Any) -> str | None:
        """None if it runs here (on `device`; the artifact at `path`, when given; with these options), else the
        reason, in one line."""
        raise NotImplementedError

    def load(self, path: Path, device: Any) -> Any:
        """The artifact at `path` as a model with effkit's interface (forward -> logits, generate)."""
        raise NotImplementedError

    def convert(self, folder: Path, source: Path, model: Any, tokenizer: Any, **options: Any) -> dict[str, Any]:
        """Write the PyTorch artifact `source` (loaded as `model`) into `folder`; return its description."""
        raise EffkitError(f"engine {self.name} does not convert artifacts")

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """What `effkit export` reports of an artifact it converted: (what_ran keys, extra metrics)."""
        return {}, {}

    def write_peer(self, folder: Path, reference: Path, model: Any, tokenizer: Any) -> dict[str, Any]:
        """The dense `reference` converted as this engine's users would do it (the bench's peer row)."""
        raise EffkitError(f"engine {self.name} has no peer")

    def prefill(self, model: Any, batch: int, tokens: int):
        """A no-argument timer of one forward of (batch, tokens) fixed random tokens."""
        from effkit.measure import timing

        return timing.forward_timer(model, batch, tokens, **self.prefill_kwargs)

    def decode(self, model: Any, tokenizer: Any, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None, prompts: list[Any] | None = None):
        """A no-argument timer of greedy decoding of `new_tokens` from `batch` prompts (returns tokens/s), those of
        its round (`generation.by_round`): `prompts`, one (batch, n) int64 array of token ids per round
        (`generation.prompt_batches`), handed to the engine as those very ids; None: `batch` copies of the fixed
        prompt."""
        from effkit.measure import generation

        return generation.generation_timer(model, tokenizer, new_tokens, generate_kwargs, batch=batch,
                                           prompts=prompts)

    def quantized_layers(self, model: Any, path: Path | None = None) -> int:
        """The quantized layers a loaded model (of the artifact at `path`) really holds."""
        return 0

    def speculative_target(self, path: Path) -> bool:
        """Whether the artifact at `path` can be the target of speculative decoding in this engine: its logits for a
        token do not depend on the other tokens verified in the same step (the bench still checks its greedy tokens
        against its plain decoding). No engine's by default."""
        return False

    def computation(self, path: Path) -> str | None:
        """A digest of what this engine computes for the artifact at `path` (its operators, their order and
        attributes, and its weights' bytes; the run settings are this engine's own, the same for every artifact it
        loads in one bench): two artifacts with the same digest run the same computation, so their speed differs
        only by the machine's noise. None: the engine cannot say."""
        return None

    def load_command(self, path: Path) -> str:
        """How a user loads the artifact outside effkit."""
        return f"effkit generate --from {path}"

    def describe(self, path: Path) -> dict[str, Any]:
        """What the engine says of an artifact (its description file)."""
        import json

        try:
            return json.loads((Path(path) / self.marker).read_text())
        except (OSError, ValueError):
            return {}


def peers(only: list[str] | None = None) -> list[Engine]:
    """The engines that offer a peer row, in registry order (`only`: these names; empty or None: all)."""
    return [e for n, e in ENGINES.items() if e.peer_tag and (not only or n in only)]
