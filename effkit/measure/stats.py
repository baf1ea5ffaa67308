"""Confidence intervals and verdicts for every comparison effkit prints (stored in reports as the dicts of
`effkit.measure.results`' `PairedRatio` and `LossDelta`, read back through them).

- Timings and throughputs (`paired_ratio`): the contenders are measured in interleaved rounds (see
  `metrics.interleaved`); each round gives one median per contender, so drift of the machine hits every
  contender of that round alike. The ratio to the reference is the geometric mean of the per-round ratios, with
  a 95% Student-t interval on the mean of their logarithms (n = rounds, n - 1 degrees of freedom): a paired
  method that stays honest with few rounds. Verdict: `faster` / `slower` when the interval excludes 1, else
  `same`.
- Held-out loss (`mean_ci`, `paired_delta`): per-block mean losses over the same fixed blocks; the 95% t-interval
  over blocks for one model, and for two models the paired per-block difference, relative to the reference's
  mean loss. Verdict: `better` / `worse` when the interval excludes 0, else `same`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import fmean, median, stdev
from typing import Any

from effkit.measure.results import LossDelta, PairedRatio, comparison

CONFIDENCE = 0.95
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (tables); beyond, the Cornish-Fisher
# expansion of t around the normal quantile (Abramowitz & Stegun 26.7.5), within 1e-5 of the exact value there
_Z975 = 1.959963984540054
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

RATIO_METHOD = ("paired, interleaved rounds: per round the median of each contender's repeats; ratio = geometric "
                "mean of the per-round ratios to the reference; 95% Student-t interval on the mean log ratio "
                "(n = rounds); verdict faster/slower only when the interval excludes 1")
LOSS_METHOD = ("per-block mean cross-entropy over the same held-out blocks; 95% Student-t interval over blocks; "
               "a delta between two models is the paired per-block difference, relative to the reference's loss; "
               "verdict better/worse only when the interval excludes 0")


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        return math.inf
    if df <= len(_T95):
        return _T95[df - 1]
    z, v = _Z975, float(df)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean (zero width for a constant sample)."""
    m = fmean(values)
    if not all(math.isfinite(v) for v in values):
        return m, math.nan, math.nan
    if len(values) < 2:
        return m, -math.inf, math.inf
    half = t95(len(values) - 1) * stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def paired_ratio(reference: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
                 higher_is_better: bool = False) -> dict[str, Any]:
    """Ratio other / reference of interleaved measurements (one list of repeats per round, rounds aligned),
    with its 95% interval and a verdict (`faster` / `slower` / `same`). Times: lower is better; rates
    (tokens/s): `higher_is_better`."""
    if len(reference) != len(other) or not reference:
        raise ValueError("paired_ratio needs the same, non-zero number of rounds for both contenders")
    logs = [math.log(median(o) / median(r)) for r, o in zip(reference, other, strict=True)]
    m, lo, hi = mean_ci(logs)
    ratio, ci = math.exp(m), [math.exp(lo), math.exp(hi)] if math.isfinite(lo) else [0.0, math.inf]
    if ci[1] < 1:
        verdict = "slower" if higher_is_better else "faster"
    elif ci[0] > 1:
        verdict = "faster" if higher_is_better else "slower"
    else:
        verdict = "same"
    return PairedRatio(ratio, (ci[0], ci[1]), verdict, rounds=len(logs)).to_dict()


def paired_delta(reference: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """Relative change of the mean loss of `other` against `reference`, paired by block, with its 95% interval
    and a verdict (`better` / `worse` / `same`; lower loss is better)."""
    if len(reference) != len(other) or not reference:
        raise ValueError("paired_delta needs the same, non-zero number of blocks for both models")
    base = fmean(reference)
    m, lo, hi = mean_ci([o - r for r, o in zip(reference, other, strict=True)])
    delta, ci = m / base, [lo / base, hi / base]
    if m == 0 and lo == hi == 0:
        ci = [0.0, 0.0]
    verdict = "worse" if ci[0] > 0 else "better" if ci[1] < 0 else "same"
    return LossDelta(delta, (ci[0], ci[1]), verdict, blocks=len(reference)).to_dict()


def fmt_ratio(r: PairedRatio | dict[str, Any]) -> str:
    """`0.71x (0.66-0.76)`; `≈ 0.98x (0.91-1.05)` when the interval contains 1."""
    return PairedRatio.of(r).fmt()


def fmt_delta(d: LossDelta | dict[str, Any]) -> str:
    """`+0.4% (+0.1 to +0.7%)`; `≈ +0.1% (-0.2 to +0.4%)` when the interval contains 0."""
    return LossDelta.of(d).fmt()


def summary_of(r: PairedRatio | LossDelta | dict[str, Any], what: str) -> str:
    """`latency b12: faster, 0.71x (0.66-0.76)`."""
    return comparison(r).summary(what)


def median_of_rounds(samples: Sequence[Sequence[float]]) -> float:
    """The median of every sample of every round."""
    return median([x for rnd in samples for x in rnd])


UNPAIRED_METHOD = ("separate runs, not interleaved: ratio of geometric means of the per-step times, 95% Welch "
                   "t-interval on the difference of mean log times")


def unpaired_ratio(reference: Sequence[float], other: Sequence[float],
                   higher_is_better: bool = False) -> dict[str, Any]:
    """Ratio other / reference of two independent samples (e.g. step times of two separate runs), with a 95%
    Welch interval on the log scale and a verdict. Use `paired_ratio` whenever the runs can be interleaved."""
    if len(reference) < 2 or len(other) < 2:
        raise ValueError("unpaired_ratio needs at least two samples on each side")
    la, lb = [math.log(x) for x in reference], [math.log(x) for x in other]
    va, vb = stdev(la) ** 2 / len(la), stdev(lb) ** 2 / len(lb)
    diff = fmean(lb) - fmean(la)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va ** 2 / (len(la) - 1)) + (vb ** 2 / (len(lb) - 1))) if se > 0 else 1
    half = t95(max(1, int(df))) * se
    ci = [math.exp(diff - half), math.exp(diff + half)]
    better, worse = ("faster", "slower")
    if ci[1] < 1:
        verdict = worse if higher_is_better else better
    elif ci[0] > 1:
        verdict = better if higher_is_better else worse
    else:
        verdict = "same"
    return PairedRatio(math.exp(diff), (ci[0], ci[1]), verdict, method="unpaired").to_dict()
