"""Sequential stopping for paired, interleaved measurements: run rounds until every comparison is decided.

A fixed number of rounds decides a difference on a quiet machine and leaves it undecided on a noisy one. Here
the rounds are run in looks: the first look has `rounds` rounds, each later one twice as many as the one before,
up to `looks` looks. After each look every comparison asked for (a pair of contenders) gets its paired ratio;
measuring stops when each one's interval excludes 1 (decided) or lies inside [1 / (1 + `precision`), 1 +
`precision`] (a tie: equal within the precision asked for), when the last look is done, or when the next look
would not fit in what is left of the time budget. A contender whose comparisons have all settled is not
measured in later looks (each ratio is computed over the rounds both of its contenders ran, a prefix of the longer
one's), so later looks cost only what is still undecided. A ratio whose interval contains 1 and reaches outside
that band when measuring stops is marked `undecided` (printed `?`): no difference was shown, and none was shown
to be absent. Each sample lasts at least `min_sample_s`; the looks after the first may run longer ones
(`h2h_sample_s`, `lengthened`: a decision's head to head does, `effkit.measure.choice`).

Looking more than once inflates the chance that noise alone crosses the line somewhere. The correction is
Bonferroni over the looks planned: every look's interval is taken at 1 - 0.05 / looks, so that all of them cover
at once with at least 95%, and so does the one at whichever look stops: each reported ratio, alone, is wrongly
decided in at most 5% of measurements, as a fixed-rounds 95% interval is. A table of many ratios is corrected as a
whole (`Family`: Holm's step-down over its ratios within each look's 0.05 / looks), and its measures stop on
that same level: at each look each ratio is judged settled or not at its Holm level within its table (`Tables`),
so that no ratio is left as decided at a laxer level than it is reported at. So is a decision (`Contest`,
`effkit.measure.choice`): its leader's ratios are decided under Holm's step-down over every pair of its
contenders, within each look's 0.05 / looks, so that any false decided ratio in it has a chance of at most 5%.
`fixed` runs `rounds` rounds once, at 95%.

Also here, shared with `effkit.measure.choice`: how many calls one sample holds (`calls_per_sample`: at least
`MIN_SAMPLE_S` long), the paired point estimate's best (`leader_of`), a decision's contest (`Contest`: its leader,
its ratios under Holm) and the pairs it still needs measured (`contest_pairs`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean, median
from typing import Any

from effkit.measure import stats, timing
from effkit.measure.results import PairedRatio

ALPHA = 1.0 - stats.CONFIDENCE
MIN_SAMPLE_S = 0.2  # sequential: a round's sample of a contender lasts at least this long (calls repeated in it)
MAX_CALLS = 64  # at most this many calls in one sample
# a decision's head to head (`effkit.measure.choice`: after its screen, the contenders still open) runs samples this
# long: longer samples gave narrower intervals for the same seconds on a loaded machine (docs/benchmarks.md,
# "Longer samples"). The bench's reported ratios keep MIN_SAMPLE_S in every look by default
# (`Stopping.h2h_sample_s`): longer ones there cost its later looks more time and decided no more ratios
H2H_SAMPLE_S = 0.5
H2H_MAX_CALLS = 256  # at most this many calls in one sample after the screen

METHOD = ("sequential: samples of at least {min_sample_s:g} s (a contender's call repeated within its sample of a "
          "round, at least the repeats asked for; the sample's figure the median of its calls{later}); looks after "
          "{first}, then twice as many rounds each time, at "
          "most {looks} looks ({max_rounds} rounds); stops when every compared ratio's interval excludes 1 or lies "
          "inside [1/{band:g}, {band:g}] (a tie), or when the next look would exceed {budget_s:.0f} s; a contender "
          "whose ratios are settled is not measured in later looks (each ratio is over the rounds both of its "
          "contenders ran); each look's interval at "
          "{level:.2%} (Bonferroni: 95% over the {looks} looks planned, so the look that stops covers with at "
          "least 95%; each ratio alone, except a bench table's: decided together under Holm's step-down within it, "
          "each interval at its Holm level, and each ratio's stopping judged at that level within its table at "
          "that look)")


@dataclass(frozen=True)
class Stopping:
    """How many interleaved rounds a comparison runs (see the module's text)."""

    rounds: int = 6  # rounds of the first look (of the only one when fixed)
    fixed: bool = False  # exactly `rounds` rounds, intervals at stats.CONFIDENCE
    precision: float = 0.03  # a tie: undecided, the interval inside [1 / (1 + precision), 1 + precision]
    budget_s: float = 60.0  # seconds of measuring per comparison, beyond the first look
    looks: int = 3  # planned looks, each twice the rounds of the one before
    seed: int = 0  # the rounds' orders are shuffled from it (written in the record)
    min_sample_s: float = MIN_SAMPLE_S  # sequential only: fixed rounds run exactly `repeats` calls a round
    h2h_sample_s: float = MIN_SAMPLE_S  # sequential only: the samples of the looks after the first (longer: slower)

    @property
    def planned(self) -> int:
        return 1 if self.fixed else self.looks

    @property
    def level(self) -> float:
        """Every look's interval: 95% when fixed, else 1 - 0.05 / looks."""
        return stats.CONFIDENCE if self.fixed else 1.0 - ALPHA / self.looks

    def schedule(self) -> list[int]:
        """Total rounds after each look."""
        return [self.rounds * 2 ** k for k in range(self.planned)]

    def describe(self) -> str:
        if self.fixed:
            return f"fixed: {self.rounds} rounds, 95% intervals"
        later = (f"; after the first look, samples of at least {self.h2h_sample_s:g} s"
                 if self.h2h_sample_s > self.min_sample_s else "")
        return METHOD.format(min_sample_s=self.min_sample_s, later=later, first=self.rounds,
                             looks=self.looks, max_rounds=self.schedule()[-1], band=1 + self.precision,
                             budget_s=self.budget_s, level=self.level)

    @classmethod
    def of(cls, measure: Any, rounds_key: str = "rounds") -> Stopping:
        """From a stage config's measure section (its rounds field, `fixed_rounds`, `precision`, `budget_s`)."""
        return cls(rounds=getattr(measure, rounds_key), fixed=measure.fixed_rounds, precision=measure.precision,
                   budget_s=measure.budget_s)


def settled(r: PairedRatio, precision: float) -> bool:
    """Decided (the interval excludes 1), or a tie: equal within the precision, the whole interval inside
    [1 / (1 + precision), 1 + precision]."""
    return r.verdict != "same" or tie(r, precision)


def tie(r: PairedRatio, precision: float) -> bool:
    """Equal within the precision: not decided, and the interval inside [1 / (1 + precision), 1 + precision]."""
    lo, hi = r.ci
    return r.verdict == "same" and math.isfinite(hi) and lo >= 1 / (1 + precision) and hi <= 1 + precision


class Measured(dict):
    """{contender: per-round samples} of one sequential measurement, with `record` (rounds, looks, how it
    stopped: `fixed`, `decided`, `max-rounds` or `budget`; the level of its intervals; seconds; how many contenders
    each look measured) and `ratio`, the paired ratio of two contenders at that level over the rounds both ran."""

    def __init__(self, samples: dict[str, list[list[float]]], record: dict[str, Any]):
        super().__init__(samples)
        self.record = record

    def ratio(self, reference: str, other: str, higher_is_better: bool = False,
              level: float | None = None) -> dict[str, Any]:
        """The paired ratio (at the record's level, or `level`: a table's Holm level, `Family`); marked
        `undecided` when sequential and stopped before it settled (`settled`)."""
        r = _paired(self, reference, other, level or self.record["level"], higher_is_better)
        if "precision" in self.record and not settled(PairedRatio.of(r), self.record["precision"]):
            r["undecided"] = True
        return r


class Family:
    """The ratios of one table, decided together: `ratio` hands out each one at its measurement's level, and
    `close` re-decides them all under Holm's step-down at each look's error (1 - the level of a look, 0.05 / looks;
    0.05 for fixed rounds) over the table's ratios, so that any false decided ratio in the table has a chance of at
    most 5% (Bonferroni over the looks, Holm within them, as a decision's `Contest`). Each ratio's interval is
    then at its Holm level (`ci_level`), so it excludes 1 exactly where Holm decides, and it says the table's size
    (`family`)."""

    def __init__(self, name: str):
        self.name = name
        self.cells: list[tuple[dict[str, Any], Measured, str, str, bool]] = []

    def ratio(self, m: Measured, reference: str, other: str, higher_is_better: bool = False) -> dict[str, Any]:
        r = m.ratio(reference, other, higher_is_better)
        self.cells.append((r, m, reference, other, higher_is_better))
        return r

    def close(self) -> None:
        """Every ratio handed out, replaced in place by the same ratio at its Holm level."""
        if not self.cells:
            return
        ps = [paired_p(m, a, b) for _, m, a, b, _ in self.cells]
        alpha = 1.0 - self.cells[0][1].record["level"]
        for (r, m, a, b, higher), level in zip(self.cells, stats.holm_levels(ps, alpha), strict=True):
            new = m.ratio(a, b, higher, level)
            r.clear()
            r.update(new, family=len(self.cells), table=self.name)


def paired_p(samples: dict[str, list[list[float]]], a: str, b: str) -> float:
    """The p-value of the paired ratio of `b` to `a` over the rounds both ran (NaN: an invalid measurement)."""
    n = min(len(samples[a]), len(samples[b]))
    x, y = samples[a][:n], samples[b][:n]
    ok = all(math.isfinite(v) and v > 0 for s in (x, y) for rnd in s for v in rnd)
    return stats.p_of_logs([math.log(median(q) / median(p)) for p, q in zip(x, y, strict=True)] if ok else None)


class Tables:
    """The tables of a measurement made of several measures (the bench's), while it measures: every ratio each
    table will hold (`cells`: (table, measure, reference, other), as `Family` will be handed them), so that the
    stopping rule judges each ratio at the level it is reported at: its Holm level within its table at that look
    (`levels`). A measure still to come counts with the p-value of a ratio that decides nothing (its ratios are
    unknown; Holm is monotone, so a ratio settled under that is settled under the table's final p-values, and a
    later measure can only decide more); a measure done counts with its final samples (`done`)."""

    def __init__(self, cells: Iterable[tuple[str, str, str, str]]):
        self.cells = list(cells)
        self.p: dict[int, float] = {}  # the cells of the measures done: their final p-values

    def levels(self, measure: str, samples: dict[str, list[list[float]]],
               level: float) -> dict[tuple[str, str], float]:
        """The (reference, other) ratios of `measure` over `samples`, each at the strictest Holm level of its
        cells within its table at the look's error (1 - `level`)."""
        ps = {i: paired_p(samples, a, b) if m == measure else self.p.get(i, math.inf)
              for i, (_, m, a, b) in enumerate(self.cells)}
        out: dict[tuple[str, str], float] = {}
        for table in dict.fromkeys(t for t, *_ in self.cells):
            idx = [i for i, c in enumerate(self.cells) if c[0] == table]
            for i, lv in zip(idx, stats.holm_levels([ps[i] for i in idx], 1.0 - level), strict=True):
                if self.cells[i][1] == measure:
                    pair = self.cells[i][2:]
                    out[pair] = max(out.get(pair, 0.0), lv)
        return out

    def done(self, measure: str, samples: dict[str, list[list[float]]]) -> None:
        """`measure` measured: its ratios count with their final p-values in the measures after it."""
        self.p |= {i: paired_p(samples, a, b) for i, (_, m, a, b) in enumerate(self.cells) if m == measure}


def _paired(samples: dict[str, list[list[float]]], a: str, b: str, level: float,
            higher_is_better: bool = False) -> dict[str, Any]:
    """The paired ratio of `b` to `a` over the rounds both ran (one that settled early ran a prefix of them)."""
    n = min(len(samples[a]), len(samples[b]))
    return stats.paired_ratio(samples[a][:n], samples[b][:n], higher_is_better, level=level)


def _timed(fn: Callable[[], float], spent: dict[str, list[float]], name: str, clock: Callable[[], float],
           skip: int) -> Callable[[], float]:
    """`fn`, adding the seconds and count of each call after the first `skip` (the warm-up) to `spent[name]`
    (its `settle_s` and its `at_round` kept)."""
    calls = [0]

    def call() -> float:
        t = clock()
        try:
            return fn()
        finally:
            calls[0] += 1
            if calls[0] > skip:
                spent[name][0] += clock() - t
                spent[name][1] += 1
    call.settle_s = timing.settle_time(fn)  # type: ignore[attr-defined]
    call.at_round = getattr(fn, "at_round", None)  # type: ignore[attr-defined]
    return call


def calls_per_sample(timed: dict[str, Callable[[], float]], repeats: int, warmup: int, min_sample_s: float,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, int]:
    """Run each contender's warm-up (at least one call; the last one timed by the clock) and size its samples: the
    calls that last at least `min_sample_s`, never fewer than `repeats` nor more than MAX_CALLS. A short decode
    timed once is at the mercy of the scheduler on a busy small machine; the median of a dozen is not."""
    calls = {}
    for name, fn in timed.items():
        for _ in range(max(warmup, 1)):
            t = clock()
            fn()
            took = clock() - t
        if (pause := timing.settle_time(fn)) > 0:
            time.sleep(pause)
        calls[name] = max(repeats, min(MAX_CALLS, math.ceil(min_sample_s / took) if took > 0 else MAX_CALLS))
    return calls


def lengthened(calls: dict[str, int], per_call_s: dict[str, float], sample_s: float,
               max_calls: int = H2H_MAX_CALLS) -> dict[str, int]:
    """The calls of each contender's samples after the screen: as many as last `sample_s` at its measured seconds
    per call (`per_call_s`), never fewer than before nor more than `max_calls`."""
    return {n: max(c, min(max_calls, math.ceil(sample_s / per_call_s[n]) if per_call_s.get(n, 0) > 0 else c))
            for n, c in calls.items()}


def leader_of(samples: dict[str, list[list[float]]], names: Sequence[str], higher: bool,
              medians: dict[str, list[float] | None] | None = None) -> str:
    """The best of `names` by paired point estimate: the longest measured first, then each of the others, longest
    first, takes the lead when its paired ratio to the leader, over the rounds both ran, favours it (a contender
    that left early is judged over its own rounds, never by figures from rounds it did not run). Among contenders
    measured in the same rounds this is the best geometric mean of paired ratios; the first listed on an exact
    tie. `medians`: each contender's per-round medians where already computed."""
    order = sorted(names, key=lambda x: -len(samples[x]))  # stable: the order given among equals
    med = {n: (medians or {}).get(n) or [median(r) for r in samples[n]] for n in names}

    def gain(x: str, lead: str) -> float:
        n = min(len(med[x]), len(med[lead]))
        d = fmean(math.log(a) - math.log(b) for a, b in zip(med[x][:n], med[lead][:n], strict=True))
        return d if higher else -d
    lead = order[0]
    for x in order[1:]:
        if gain(x, lead) > 0:
            lead = x
    return lead


def family_of(contenders: int) -> int:
    """The hypotheses a contest's error is controlled over: the leader is the best of the contenders, read off the
    same data, so its ratios to the others are a choice among every pair of them."""
    return max(1, contenders * (contenders - 1) // 2)


class Contest:
    """A decision among `names` over the rounds measured so far (a contender that left early ran a prefix of
    them): each one's ratios to any other, over the rounds both ran, with Holm's step-down over them at the
    family-wise error of one look (1 - `level`) for `family_of(len(names))` hypotheses (`standing`: every ratio's
    interval at its Holm level, `stats.holm_levels`, so that it excludes 1 exactly where Holm decides); the
    contenders no other is decided faster than (`unbeaten`), and the leader (`leader`)."""

    def __init__(self, samples: dict[str, list[list[float]]], names: Sequence[str], higher: bool, level: float):
        self.samples, self.names, self.higher, self.level = samples, list(names), higher, level
        self.family = family_of(len(self.names))
        self._medians = {n: [median(r) for r in samples[n]] if all(math.isfinite(x) and x > 0 for r in samples[n]
                                                                     for x in r) else None for n in self.names}
        self._standing: dict[str, dict[str, dict[str, Any]]] = {}

    def _logs(self, ref: str, other: str) -> tuple[list[float] | None, int]:
        a, b = self._medians[ref], self._medians[other]
        n = min(len(self.samples[ref]), len(self.samples[other]))
        return (None if a is None or b is None else [math.log(y / x) for x, y in zip(a[:n], b[:n], strict=True)]), n

    def standing(self, ref: str) -> dict[str, dict[str, Any]]:
        """Every other contender's paired ratio to `ref`, at its Holm level."""
        if ref not in self._standing:
            logs = {n: self._logs(ref, n) for n in self.names if n != ref}
            levels = stats.holm_levels([stats.p_of_logs(x) for x, _ in logs.values()], 1.0 - self.level,
                                       self.family)
            self._standing[ref] = {n: stats.ratio_of_logs(x, k, self.higher, lv)
                                   for (n, (x, k)), lv in zip(logs.items(), levels, strict=True)}
        return self._standing[ref]

    def unbeaten(self, x: str) -> bool:
        """Whether no other contender is decided faster than `x`."""
        return all(r["verdict"] != "faster" for r in self.standing(x).values())

    def leader(self, among: Sequence[str] | None = None) -> str | None:
        """The best by paired point estimate (`leader_of`) among the contenders of `among` (default: those measured
        longest) that no contender is decided faster than; where each of `among` is, the best of those that are.
        None when every contender is decided slower than another (their rounds contradict each other:
        non-transitive over different prefixes of rounds)."""
        longest = max(len(self.samples[n]) for n in self.names)
        among = [n for n in (among or [n for n in self.names if len(self.samples[n]) == longest])
                 if n in self.names]
        for pool in (among, self.names):
            pool = list(pool)
            while pool:  # the best of the pool, unless beaten: then the best of the rest
                if self.unbeaten(best := leader_of(self.samples, pool, self.higher, self._medians)):
                    return best
                pool.remove(best)
        return None


def contest_pairs(samples: dict[str, list[list[float]]], members: list[str], higher_is_better: bool, level: float,
                  precision: float) -> list[tuple[str, str]]:
    """The open pairs of a contest among `members` (a decision read off these rounds, `effkit.measure.choice.
    decide`): its leader (`Contest.leader`) against each member still measured whose ratio to it is not settled, Holm's
    step-down over every member (one that left earlier keeps its ratio over its own rounds). None where the leader
    is a member no longer measured: no later round changes its ratios."""
    longest = max((len(s) for s in samples.values()), default=0)  # the rounds run so far
    members = [n for n in members if samples[n]]
    live = [n for n in members if len(samples[n]) == longest]
    contest = Contest(samples, members, higher_is_better, level)
    lead = contest.leader(among=live) if len(live) >= 2 else None
    if lead not in live:
        return []
    ratios = contest.standing(lead)
    return [(lead, n) for n in live if n != lead and not settled(PairedRatio.of(ratios[n]), precision)]


def measure(contenders: dict[str, Callable[[], float]], stopping: Stopping, repeats: int, warmup: int = 1,
            pairs: Iterable[tuple[str, str]] | None = None,
            clock: Callable[[], float] = time.perf_counter,
            tables: tuple[Tables, str] | None = None) -> Measured:
    """Interleaved rounds of `contenders` (see `timing.interleaved`) under `stopping`; `pairs`: the
    (reference, other) comparisons that must settle (default: every contender against the first). After the
    first look only the contenders of unsettled pairs are measured. `tables`: (the tables its
    ratios are reported in, this measure's name): each pair is judged at its Holm level within its table at that
    look (`Tables.levels`), the level it is reported at, never at the laxer look's level."""
    names = list(contenders)
    sized = not stopping.fixed and stopping.min_sample_s > 0
    pairs = [(a, b) for a, b in (pairs if pairs is not None else [(names[0], n) for n in names[1:]])
             if a in contenders and b in contenders and a != b]
    spent = {n: [0.0, 0] for n in names}  # seconds and calls of each contender
    timed = {n: _timed(fn, spent, n, clock, max(warmup, 1) if sized else warmup) for n, fn in contenders.items()}
    schedule = stopping.schedule()
    start = clock()
    if sized:  # sequential: the warm-up sizes each contender's samples
        calls = calls_per_sample(timed, repeats, warmup, stopping.min_sample_s, clock)
        samples = timing.interleaved(timed, schedule[0], calls, warmup=0, seed=stopping.seed)
    else:
        calls = dict.fromkeys(names, repeats)
        samples = timing.interleaved(timed, schedule[0], repeats, warmup=warmup, seed=stopping.seed)
    first = clock() - start
    looks, stopped, measured = 1, "fixed", [len(names)]
    screen_calls = dict(calls)
    if sized and stopping.h2h_sample_s > stopping.min_sample_s:  # the looks after the screen: longer samples
        calls = lengthened(calls, {n: spent[n][0] / spent[n][1] for n in names if spent[n][1]},
                           stopping.h2h_sample_s)
    while not stopping.fixed:
        at = tables[0].levels(tables[1], samples, stopping.level) if tables else {}
        open_pairs = [(a, b) for a, b in pairs if not settled(
            PairedRatio.of(_paired(samples, a, b, at.get((a, b), stopping.level))), stopping.precision)]
        if not open_pairs:
            stopped = "decided"
            break
        if looks == len(schedule):
            stopped = "max-rounds"
            break
        done, total = schedule[looks - 1], schedule[looks]
        # a contender that left is not measured again (its rounds stay a prefix of the others'), nor is a ratio of it
        active = [n for n in names if any(n in pair and len(samples[pair[0]]) == len(samples[pair[1]]) == done
                                          for pair in open_pairs)]
        if not active:  # every open ratio's contender left before its Holm level rose past it
            stopped = "contenders left"
            break
        per_round = sum(spent[n][0] / max(spent[n][1], 1) * calls[n] + timing.settle_time(contenders[n])
                        for n in active)  # each active contender's calls and its settling pause
        if clock() - start - first + per_round * (total - done) > stopping.budget_s:
            stopped = "budget"
            break
        more = timing.interleaved({n: timed[n] for n in active}, total - done, {n: calls[n] for n in active},
                                   warmup=0, offset=done,
                                   seed=stopping.seed)
        for name in active:
            samples[name] += more[name]
        looks += 1
        measured.append(len(active))
    return Measured(samples, {"rounds": schedule[looks - 1], "looks": looks, "stopped": stopped,
                              "level": stopping.level, "contenders_per_look": measured,
                              "order": f"shuffled each round from seed {stopping.seed}",
                              "calls_per_sample": screen_calls,
                              **({"calls_per_sample_after_screen": calls} if looks > 1 and calls != screen_calls
                                 else {}),
                              **({} if stopping.fixed else {"precision": stopping.precision,
                                                            "budget_s": stopping.budget_s}),
                              "seconds": round(clock() - start, 3)})
