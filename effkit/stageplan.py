"""The planner's one plan type (`StagePlan`): the peak of one process (training's: of one rank), predicted from its
parts before anything large is allocated, whether it fits, and what would make it fit; `check` stops a stage whose
plan does not fit in one line (exit 2) unless forced, and `what_fits` is the one search over a stage's memory tricks.
Each stage builds its own plan from the model's shapes alone (`config.json`, no weights read): training's is
`effkit.memplan.predict` (`effkit train --plan`), prune's `effkit.prune.stage.prune_plan`, and so on. A stage
measures its own peak (the resident set's increase over the stage, `PeakMemory`) and reports it beside the plan, so
every prediction is checked by the run it was made for; `effkit.console.show_plan` prints any of them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from effkit.errors import EffkitError

HEADROOM = 0.10  # of the device's memory kept for what the plan does not predict (the allocator's free lists)
METHOD = ("the parts alive at the stage's largest moment, from the model's shapes alone (no weights read): fp32 "
          "copies of the model, and one fine-tuning as `effkit train --plan` predicts it (FakeTensorMode and "
          "MemTracker; the runtime of the libraries measured once per machine and shape)")


@dataclass
class StagePlan:
    """One stage's predicted peak for one process: its parts (bytes), the device's memory, notes, the changes that
    would make it fit (`tricks`) when it does not, and how it was predicted (`method`). Training's plan also
    carries the configuration planned (`config`), the increase over its steps (`steps_bytes`) and one step's
    predicted seconds (`step_s`: None where no probe ran)."""

    stage: str
    parts: dict[str, int]
    device: str
    device_bytes: int | None
    notes: list[str] = field(default_factory=list)
    tricks: list[str] = field(default_factory=list)
    method: str = METHOD  # how the parts were predicted (each stage says its own)
    # parts the resident set counts but the kernel can drop under pressure (clean pages of a mapped file): in the
    # predicted peak, not in what must fit
    reclaimable: set[str] = field(default_factory=set)
    scope: str = "one process"  # what the parts are of, in the table's title
    config: dict[str, Any] | None = None
    steps_bytes: int | None = None
    step_s: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def required_bytes(self) -> int:
        """What must fit: the total less the reclaimable parts."""
        return self.total_bytes - sum(v for k, v in self.parts.items() if k in self.reclaimable)

    @property
    def usable_bytes(self) -> int | None:
        return None if self.device_bytes is None else int(self.device_bytes * (1 - HEADROOM))

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.required_bytes <= self.usable_bytes

    def verdict(self) -> str:
        """`fits` or `does not fit: <what would make it fit>`, in one line."""
        if self.fits is None:
            return "fit unknown (the device's memory is unknown)"
        if self.fits:
            return "fits"
        return "does not fit: " + ("; or ".join(self.tricks) if self.tricks else "use a machine with more memory")

    def to_dict(self) -> dict[str, Any]:
        out = {"stage": self.stage, "parts_bytes": self.parts, "total_bytes": self.total_bytes,
               "required_bytes": self.required_bytes, "reclaimable_parts": sorted(self.reclaimable),
               "device": self.device, "device_bytes": self.device_bytes, "usable_bytes": self.usable_bytes,
               "fits": self.fits, "verdict": self.verdict(), "notes": self.notes, "method": self.method}
        if self.config is not None:  # training's (`per_rank_bytes`: its parts, the name its report reads)
            out |= {"config": self.config, "per_rank_bytes": self.parts, "steps_bytes": self.steps_bytes,
                    "step_s": self.step_s}
        return out


def check(plan: StagePlan, force: bool) -> None:
    """Stop before anything large is allocated when the plan does not fit, unless forced."""
    if plan.fits is False and not force:
        dropped = plan.total_bytes - plan.required_bytes
        cache = f" ({dropped / 2**30:.1f} GiB of mapped file pages the kernel can drop not counted)" if dropped else ""
        raise EffkitError(f"{plan.stage}: predicted peak {plan.required_bytes / 2**30:.1f} GiB{cache} > "
                          f"{plan.usable_bytes / 2**30:.1f} GiB usable ({plan.device}); {plan.verdict()}; "
                          "--plan shows the parts, --force runs it anyway")


def weights_of(folder: Path) -> tuple[int, int]:
    """(the model's fp32 bytes, its weight files' bytes) of a dense or pruned PyTorch artifact, from its safetensors
    headers alone (each tensor's shape; no weight read). A tied LM head is stored once and held once."""
    fp32 = files = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        files += f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        fp32 += 4 * sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return fp32, files


def on_line(line: tuple[float, float], size: int) -> int:
    """The bytes a measured line (bytes, bytes per byte) gives for `size` bytes of weights."""
    return int(line[0] + line[1] * size)


class Tried(NamedTuple):
    """A candidate change `what_fits` planned: its flags in words, what the stage planned it from, the plan."""

    flags: str
    option: Any
    plan: StagePlan
    fits: bool


def what_fits(candidates: Iterable[tuple[str, Any]], plan_of: Callable[[Any], StagePlan], *, first: bool = True,
              limit: int | None = None) -> list[Tried]:
    """The one "what would fit" search: each candidate change of a stage (its flags in words, and what `plan_of`
    plans from: a config, a backend, a format) planned in turn, in the order the stage gives them (cheapest
    first). A plan fits within `limit` bytes where given, else within its device's usable memory (unknown: fits).
    Returns every candidate tried; with `first`, the search stops at the first that fits (the last one tried is
    then the answer, or how far the last candidate is when none fits)."""
    tried = []
    for flags, option in candidates:
        plan = plan_of(option)
        bound = plan.usable_bytes if limit is None else limit
        tried.append(Tried(flags, option, plan, bound is None or plan.required_bytes <= bound))
        if first and tried[-1].fits:
            break
    return tried
