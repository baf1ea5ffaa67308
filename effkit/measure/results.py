"""Typed results: the paired comparisons every report carries, and the names of the metrics one stage hands to
another (prune -> pipeline, bench -> pipeline and plots, quantize/export -> CLI).

Reports stay plain JSON; the format does not change. A comparison is made by `effkit.measure.stats` and stored
as its `to_dict()` (exactly the keys reports have always had); every reader reads it back through `of(...)`,
which checks its fields, so a renamed key fails at the reader, naming what is missing, instead of silently. The
metric names below are spelled once: writers and readers both use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from effkit import workloads

# `invalid`: a NaN or an infinity among the measurements (a diverged loss, a timing that failed): no interval,
# no verdict of difference, and never shown as "no difference" (≈)
RATIO_VERDICTS = ("faster", "slower", "same", "invalid")
DELTA_VERDICTS = ("better", "worse", "same", "invalid")
INVALID = "invalid"


def _parse(d: Any, kind: str, value: str, verdicts: tuple[str, ...],
           interval: str = "ci95") -> tuple[float, tuple[float, float], str]:
    """(value, (lo, hi), verdict) of a stored comparison, every field checked; the message names what is wrong."""
    required = (value, interval, "verdict")
    if not isinstance(d, Mapping):
        raise TypeError(f"a {kind} is a mapping with {', '.join(required)}; got {type(d).__name__}")
    missing = [k for k in required if k not in d]
    if missing:
        raise KeyError(f"not a {kind}: no {', '.join(missing)} (has {', '.join(sorted(d)) or 'nothing'})")
    if d["verdict"] not in verdicts:
        raise ValueError(f"a {kind}'s verdict is one of {verdicts}, not {d['verdict']!r}")
    lo, hi = d[interval]
    return float(d[value]), (float(lo), float(hi)), d["verdict"]


@dataclass(frozen=True)
class PairedRatio:
    """other / reference of timings or rates, with its interval (`ci`) at its confidence (`ci_level`) and a verdict
    (faster / slower / same). Stored as `ci` and `ci_level`, never as `ci95`: one look of a sequential measurement
    is taken at 1 - alpha / looks planned, and a ratio of a contest or a bench table at its Holm level."""

    ratio: float
    ci: tuple[float, float]
    verdict: str
    rounds: int | None = None  # paired, interleaved rounds
    method: str | None = None  # "unpaired" for separate runs
    ci_level: float = 0.95  # the interval's confidence
    # a sequential measurement whose interval contains 1 but is wider than the precision asked for: it ran out of
    # rounds or time before deciding (`same` says no difference was shown, not that there is none)
    undecided: bool = False

    @classmethod
    def of(cls, d: PairedRatio | Mapping[str, Any]) -> PairedRatio:
        if isinstance(d, cls):
            return d
        return cls(*_parse(d, "paired ratio", "ratio", RATIO_VERDICTS, "ci"), d.get("rounds"), d.get("method"),
                   d["ci_level"] if "ci_level" in d else 0.95, bool(d.get("undecided", False)))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ratio": self.ratio, "ci": list(self.ci), "ci_level": self.ci_level,
                               "verdict": self.verdict}
        for key in ("rounds", "method"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.undecided:
            out["undecided"] = True
        return out

    def fmt(self) -> str:
        """`0.71x (0.66-0.76)`; `≈ 0.98x (0.91-1.05)` when the interval contains 1; `? 1.06x (0.99-1.13)` when it
        does and a sequential measurement stopped before it was within its precision; `invalid (non-finite
        measurements)` when a NaN or an infinity was measured."""
        if self.verdict == INVALID:
            return "invalid (non-finite measurements)"
        lo, hi = self.ci
        mark = "? " if self.undecided else "≈ " if self.verdict == "same" else ""
        return f"{mark}{self.ratio:.2f}x ({lo:.2f}-{hi:.2f})"

    def summary(self, what: str) -> str:
        """`latency b12: faster, 0.71x (0.66-0.76)`."""
        return f"{what}: {'undecided' if self.undecided else self.verdict}, {self.fmt()}"


@dataclass(frozen=True)
class LossDelta:
    """The relative change of a mean held-out loss against a reference, paired by block, with its 95% interval
    and a verdict (better / worse / same; lower loss is better)."""

    delta: float
    ci95: tuple[float, float]
    verdict: str
    blocks: int | None = None
    documents: int | None = None  # the held-out documents the blocks come from: the interval is by document

    @classmethod
    def of(cls, d: LossDelta | Mapping[str, Any]) -> LossDelta:
        if isinstance(d, cls):
            return d
        return cls(*_parse(d, "loss delta", "delta", DELTA_VERDICTS), d.get("blocks"), d.get("documents"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"delta": self.delta, "ci95": list(self.ci95), "verdict": self.verdict}
        for key in ("blocks", "documents"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def fmt(self) -> str:
        """`+0.4% (+0.1 to +0.7%)`; `≈ +0.1% (-0.2 to +0.4%)` when the interval contains 0; two decimals when
        every figure is below 0.1%, so that a small delta does not print as 0.0; `invalid (non-finite loss)` when a
        NaN or an infinity was measured."""
        if self.verdict == INVALID:
            return "invalid (non-finite loss)"
        lo, hi = self.ci95
        places = 2 if max(abs(self.delta), abs(lo), abs(hi)) < 0.001 else 1
        return (f"{'≈ ' if self.verdict == 'same' else ''}{self.delta * 100:+.{places}f}% "
                f"({lo * 100:+.{places}f} to {hi * 100:+.{places}f}%)")

    def summary(self, what: str) -> str:
        return f"{what}: {self.verdict}, {self.fmt()}"


def comparison(d: PairedRatio | LossDelta | Mapping[str, Any]) -> PairedRatio | LossDelta:
    """Either kind, told apart by its fields (a ratio has `ratio`, a delta `delta`)."""
    if isinstance(d, PairedRatio | LossDelta):
        return d
    return PairedRatio.of(d) if isinstance(d, Mapping) and "ratio" in d else LossDelta.of(d)


# ------------------------------------------------------------------- metric names stages hand to each other

# the headline latency of reports and verdicts: prefill at the larger built-in batch (`effkit.workloads`), its
# statistics (p50_s, ...) and its ratio
LATENCY_B12, LATENCY_RATIO_B12 = workloads.PREFILL_B12.measure, workloads.PREFILL_B12.ratio
BF16_LATENCY_RATIO_B12 = "bf16_" + LATENCY_RATIO_B12  # the parent under bf16 autocast vs fp32
GENERATION_RATIO = "generation_ratio"
EVAL_LOSS_DELTA = "eval_loss_delta"  # against the parent (quantize, export) or the bench's reference (LossDelta)
EVAL_LOSS_DELTA_VS_DENSE = "eval_loss_delta_vs_dense"  # a pruning round against the dense model
EVAL_LOSS_DELTA_VS_CONTROL = "eval_loss_delta_vs_control"  # a pruning round against its dense control
CONTROL_DELTA_VS_DENSE = "control_eval_loss_delta_vs_dense"  # the control against the dense model
