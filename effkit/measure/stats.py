"""Confidence intervals and verdicts for every comparison effkit prints (stored in reports as the dicts of
`effkit.measure.results`' `PairedRatio` and `LossDelta`, read back through them).

- Timings and throughputs (`paired_ratio`): the contenders are measured in interleaved rounds (see
  `timing.interleaved`); each round gives one median per contender, so drift of the machine hits every
  contender of that round alike. The ratio to the reference is the geometric mean of the per-round ratios, with
  a 95% Student-t interval on the mean of their logarithms (n = rounds, n - 1 degrees of freedom): a paired
  method that stays honest with few rounds. Verdict: `faster` / `slower` when the interval excludes 1, else
  `same`.
  Run sequentially (`effkit.measure.stopping`), the interval of each look is taken at 1 - 0.05 / looks planned
  (Bonferroni), so that the one at whichever look stops still covers with at least 95%.
- Held-out loss (`mean_ci`, `paired_delta`): per-block mean losses over the same fixed blocks, spread over every
  held-out document. Blocks of one document are not independent (same speaker, topic, words), so the 95%
  interval is by document: the cluster-robust (CR1) standard error of the mean over blocks, with documents as
  clusters and a Student-t quantile with documents - 1 degrees of freedom; for two models, the same on the
  paired per-block difference, relative to the reference's mean loss. With one document (or no document ids)
  the interval is over blocks. Verdict: `better` / `worse` when the interval excludes 0, else `same`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from statistics import fmean, median, stdev
from typing import Any

from effkit.measure.results import INVALID, LossDelta, PairedRatio, comparison

CONFIDENCE = 0.95
# two-sided quantiles of Student's t at CONFIDENCE, from tables up to _T95's length; beyond, the Cornish-Fisher
# expansion of t around the normal quantile (Abramowitz & Stegun 26.7.5; tests/test_stats.py checks it there)
_Z975 = 1.959963984540054
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

RATIO_METHOD = ("paired, interleaved rounds: per round the median of each contender's repeats; ratio = geometric "
                "mean of the per-round ratios to the reference; 95% Student-t interval on the mean log ratio "
                "(n = rounds); verdict faster/slower only when the interval excludes 1")
LOSS_METHOD = ("per-block mean cross-entropy over the same held-out blocks, spread evenly over every held-out "
               "document; 95% interval by document (cluster-robust CR1 standard error of the mean over blocks, "
               "documents as clusters, Student-t with documents - 1 degrees of freedom; over blocks when there is "
               "one document); a delta between two models is the paired per-block difference, relative to the "
               "reference's loss; verdict better/worse only when the interval excludes 0")


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


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _t_tail(t: float, df: float) -> float:
    """P(|T| > t) for Student's t with `df` degrees of freedom (t >= 0): the incomplete beta I_x(df/2, 1/2)."""
    x, a, b = df / (df + t * t), df / 2.0, 0.5
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


@functools.lru_cache(maxsize=4096)  # a contest asks for the same few Holm levels and round counts again and again
def t_quantile(confidence: float, df: float) -> float:
    """The two-sided quantile q of Student's t with `df` degrees of freedom: P(|T| <= q) = `confidence` (by
    bisection on the exact tail; t95's table values to their 3 decimals)."""
    if df <= 0:
        return math.inf
    if confidence == CONFIDENCE and float(df).is_integer():
        return t95(int(df))
    alpha, lo, hi = 1.0 - confidence, 0.0, 1.0
    while _t_tail(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if _t_tail(mid, df) > alpha else (lo, mid)
        if hi - lo < 1e-12 * hi:
            break
    return (lo + hi) / 2.0


def _sd(values: Sequence[float]) -> float:
    """The sample standard deviation in floats (statistics.stdev's exact arithmetic costs a contest's many
    ratios more than their medians)."""
    m = fmean(values)
    return math.sqrt(max(sum((v - m) ** 2 for v in values) / (len(values) - 1), 0.0))


def _cluster_se(values: Sequence[float], clusters: Sequence[int]) -> tuple[float, int]:
    """(standard error of the mean, clusters): CR1, the sum over clusters of the squared summed residuals, with
    the small-sample factor G / (G - 1)."""
    m = fmean(values)
    sums: dict[int, float] = {}
    for v, g in zip(values, clusters, strict=True):
        sums[g] = sums.get(g, 0.0) + (v - m)
    n, g = len(values), len(sums)
    return math.sqrt(g / (g - 1) * sum(s * s for s in sums.values())) / n, g


def mean_ci(values: Sequence[float], clusters: Sequence[int] | None = None,
            confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the t-interval of the mean (95% unless told; zero width for a constant sample). With
    `clusters` (a group id per value, e.g. the document of each held-out block) and at least two groups, the
    interval is cluster-robust with groups - 1 degrees of freedom; else over values."""
    m = fmean(values)
    if not all(math.isfinite(v) for v in values):
        return m, math.nan, math.nan
    if len(values) < 2:
        return m, -math.inf, math.inf
    if clusters is not None and len(set(clusters)) >= 2:
        se, g = _cluster_se(values, clusters)
        half = t_quantile(confidence, g - 1) * se
    else:
        half = t_quantile(confidence, len(values) - 1) * _sd(values) / math.sqrt(len(values))
    return m, m - half, m + half


def interval_by(clusters: Sequence[int] | None, n: int) -> str:
    """What a loss interval was computed over: `by document (13 documents)` or `over blocks (64 blocks)`."""
    if clusters is not None and (g := len(set(clusters))) >= 2:
        return f"by document ({g} documents, {n} blocks)"
    return f"over blocks ({n} blocks{', one document' if clusters is not None else ''})"


def paired_ratio(reference: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
                 higher_is_better: bool = False, level: float = CONFIDENCE) -> dict[str, Any]:
    """Ratio other / reference of interleaved measurements (one list of repeats per round, rounds aligned),
    with its interval and a verdict (`faster` / `slower` / `same`). Times: lower is better; rates (tokens/s):
    `higher_is_better`. `level`: the interval's confidence (95%; higher for one look of a sequential
    measurement, see `effkit.measure.stopping`, recorded in the result)."""
    if len(reference) != len(other) or not reference:
        raise ValueError("paired_ratio needs the same, non-zero number of rounds for both contenders")
    samples = [x for rnd in (*reference, *other) for x in rnd]
    logs = (_log_ratios([median(r) for r in reference], [median(o) for o in other])
            if all(math.isfinite(x) and x > 0 for x in samples) else None)
    return ratio_of_logs(logs, len(reference), higher_is_better, level)


def _log_ratios(reference: Sequence[float], other: Sequence[float]) -> list[float]:
    return [math.log(o / r) for r, o in zip(reference, other, strict=True)]


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else math.inf


def ratio_of_logs(logs: Sequence[float] | None, rounds: int, higher_is_better: bool = False,
                  level: float = CONFIDENCE) -> dict[str, Any]:
    """`paired_ratio` from the per-round log ratios of medians (None: a non-finite or non-positive measurement,
    `invalid`)."""
    if logs is None:
        return PairedRatio(math.nan, (math.nan, math.nan), INVALID, rounds=rounds, ci_level=level).to_dict()
    m, lo, hi = mean_ci(logs, confidence=level)
    # a strict level with two rounds gives t bounds beyond a float's exponent: the interval is then unbounded
    ratio, ci = _exp(m), [_exp(lo), _exp(hi)] if math.isfinite(lo) else [0.0, math.inf]
    if ci[1] < 1:
        verdict = "slower" if higher_is_better else "faster"
    elif ci[0] > 1:
        verdict = "faster" if higher_is_better else "slower"
    else:
        verdict = "same"
    return PairedRatio(ratio, (ci[0], ci[1]), verdict, rounds=len(logs), ci_level=level).to_dict()


def p_of_logs(logs: Sequence[float] | None) -> float:
    """The two-sided p-value of `paired_ratio`'s test from its log ratios (the mean is 0; Student's t, rounds - 1
    degrees of freedom): its interval at level 1 - p just touches 1. NaN for an invalid comparison."""
    if logs is None:
        return math.nan
    if len(logs) < 2:
        return 1.0
    m, sd = fmean(logs), _sd(logs)
    if sd == 0:
        return 1.0 if m == 0 else 0.0
    return _t_tail(abs(m) / (sd / math.sqrt(len(logs))), len(logs) - 1)


def holm_levels(pvalues: Sequence[float], alpha: float, family: int | None = None) -> list[float]:
    """The confidence level of each of a family's intervals under Holm's step-down at family-wise error `alpha`:
    the k-th smallest p-value (k from 0) is tested at alpha / (family - k) while every smaller one was rejected;
    from the first that is not, every later one keeps that step's level. So an interval excludes 1 exactly where
    Holm rejects. `family`: the number of hypotheses the error is controlled over (default: these)."""
    m = max(family or len(pvalues), len(pvalues))
    order = sorted(range(len(pvalues)), key=lambda i: (math.isnan(pvalues[i]), pvalues[i]))
    levels, step = [0.0] * len(pvalues), None
    for k, i in enumerate(order):
        if step is None and not pvalues[i] <= alpha / (m - k):
            step = k
        levels[i] = 1.0 - alpha / (m - (k if step is None else step))
    return levels


def paired_delta(reference: Sequence[float], other: Sequence[float],
                 docs: Sequence[int] | None = None) -> dict[str, Any]:
    """Relative change of the mean loss of `other` against `reference`, paired by block, with its 95% interval
    (by document when `docs` gives each block's document) and a verdict (`better` / `worse` / `same`; lower
    loss is better)."""
    if len(reference) != len(other) or not reference:
        raise ValueError("paired_delta needs the same, non-zero number of blocks for both models")
    if docs is not None and len(docs) != len(reference):
        raise ValueError(f"paired_delta: {len(docs)} document ids for {len(reference)} blocks")
    if not all(math.isfinite(x) for x in (*reference, *other)):
        return LossDelta(math.nan, (math.nan, math.nan), INVALID, blocks=len(reference),
                         documents=len(set(docs)) if docs is not None else None).to_dict()
    base = fmean(reference)
    m, lo, hi = mean_ci([o - r for r, o in zip(reference, other, strict=True)], clusters=docs)
    delta, ci = m / base, [lo / base, hi / base]
    if m == 0 and lo == hi == 0:
        ci = [0.0, 0.0]
    verdict = "worse" if ci[0] > 0 else "better" if ci[1] < 0 else "same"
    return LossDelta(delta, (ci[0], ci[1]), verdict, blocks=len(reference),
                     documents=len(set(docs)) if docs is not None else None).to_dict()


def interval_words(levels: Sequence[float | None]) -> str:
    """`98.3% intervals (Bonferroni over 3 looks: together at least 95%)`: the level the printed intervals were
    computed at, as the ratios carry it (none: 95%), so the caption cannot claim 95% of a sequential bench's
    wider intervals; a look count is recovered from the level, since each look is at 1 - 0.05 / looks."""
    found = sorted({CONFIDENCE if x is None else round(x, 4) for x in levels}) or [CONFIDENCE]
    pct = lambda x: f"{x:.1%}".replace(".0%", "%")  # noqa: E731
    looks = {x: round((1 - CONFIDENCE) / (1 - x)) for x in found if x > CONFIDENCE}
    words = " or ".join(map(pct, found)) + " intervals"
    if len(found) == 1 and looks:
        return f"{words} (Bonferroni over {looks[found[0]]} looks: together at least {pct(CONFIDENCE)})"
    notes = [f"{pct(x)}: Bonferroni over {n} looks, together at least {pct(CONFIDENCE)}"
             for x, n in looks.items()]
    return words + (f" ({'; '.join(notes)})" if notes else "")


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
