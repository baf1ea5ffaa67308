"""Decisions by measurement: which backend, precision, thread count or attention backend effkit takes on this
machine. Every automatic choice goes through `choose`, one rule (DESIGN.md, "Decisions"):

1. **Samples long enough to measure.** After its warm-up, each contender's call is timed (the median of three)
   and repeated within a sample until the sample lasts at least `min_sample_s`; a sample's figure is the median
   of its calls. A short decode timed once is at the mercy of the scheduler and the timer on a busy small
   machine; a median of a dozen is not.
2. **Screen.** A contender whose sizing calls (the median of three, after its warm-up) measured more than `far`
   times the fastest contender's cost (seconds, or 1 / a rate) leaves at once, "far slower" (PyTorch's dynamic
   int8, torchao and bitsandbytes decode at 0.02-0.05x of ONNX Runtime on the quickstart: their screens cost more
   than the rest of the choice; two equal contenders part by 4x only where both medians of three err by 2x, in
   opposite directions); never the reference nor the default. Every other contender runs the first look
   (`rounds` interleaved rounds, order shuffled from a seed).
   The leader is the best paired point estimate among the contenders measured longest that no contender (one that
   left earlier included) is decided faster than, over the rounds both ran. Whatever is decided slower than the
   leader is dropped, and so is whatever is already tied with it: equal within the precision, the whole interval
   inside [1 / (1 + `precision`), 1 + `precision`].
3. **Head to head.** The leader and the contenders still open against it run further looks (twice the rounds
   each time, at most `looks` looks, samples of at least `h2h_sample_s`) until every one of them is decided
   against the leader or tied with it. The budget scales with what is at stake: `budget_s` seconds for
   each contender still open against the leader; the second look always runs, however small the budget, and a
   later look the budget cannot hold in full runs the rounds that fit.
4. **The pick.** Decided: the leader. Ties: the preferred one among the leader and its ties that every other
   contender is decided slower than or tied with (smaller folder, the default, fewer threads: the caller says); a
   preference never breaks anything but a tie. A leader still undecided against someone when the
   looks or the budget end: the leader, by its paired point estimate, labelled "undecided: chosen by point
   estimate", unless the caller names a `default` (what the user has without the choice, e.g. ONNX Runtime's own
   int8) and the leader is still undecided against it: then the default stays, labelled "undecided: kept the
   default". A default is displaced only by a contender decided faster than it, or tied with it and preferred.
   Where every contender is decided slower than another (over different prefixes of rounds a circle can form when
   speeds drift), the pick is undecided and the record names the circle (`contradictory`). A contender with a
   non-finite, zero or infinite timing or rate is never picked.

Family-wise error: 5% per contest. Each look is allowed 0.05 / looks (Bonferroni over the looks planned, as
`stopping`), and within a look the ratios to the leader are decided by Holm's step-down over the K(K-1)/2 pairs of
the K contenders: the leader is itself chosen from the data, so its K - 1 ratios are a choice among all the pairs,
and Holm over all of them holds whichever leader the data chose (`stopping.Contest`). Each ratio's interval is at
its Holm level (recorded in it), so it excludes 1 exactly where the ratio is decided. Every call of every sample is
kept (`Choice.samples`), so each ratio and the pick can be recomputed from the report alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from effkit.errors import EffkitError
from effkit.measure import stats, timing
from effkit.measure.results import PairedRatio
from effkit.measure.stopping import (
    ALPHA,
    H2H_MAX_CALLS,
    H2H_SAMPLE_S,
    MAX_CALLS,
    MIN_SAMPLE_S,
    Contest,
    contest_pairs,
    leader_of,
    lengthened,
    settled,
    tie,
)


@dataclass(frozen=True)
class Rule:
    """How a choice is measured (see the module's text)."""

    rounds: int = 6  # rounds of the screen, every contender
    looks: int = 4  # planned looks, each twice the rounds of the one before (the leaders only after the first)
    precision: float = 0.03  # a tie: undecided, the interval inside [1 / (1 + precision), 1 + precision]
    budget_s: float = 20.0  # seconds of head-to-head looks per contender still open against the leader
    min_sample_s: float = MIN_SAMPLE_S  # each sample lasts at least this long (calls repeated within it)
    max_calls: int = MAX_CALLS  # at most this many calls in one sample
    h2h_sample_s: float = H2H_SAMPLE_S  # the samples of the head-to-head looks (after the screen)
    far: float = 4.0  # a contender whose sizing calls cost this many times the fastest's leaves before the screen
    seed: int = 0  # the rounds' orders are shuffled from it

    @property
    def level(self) -> float:
        return 1.0 - ALPHA / self.looks

    def schedule(self) -> list[int]:
        return [self.rounds * 2 ** k for k in range(self.looks)]

    def describe(self) -> str:
        return (f"samples of at least {self.min_sample_s:g} s in the screen, {self.h2h_sample_s:g} s head to head "
                f"(each the median of its calls); "
                + (f"a contender whose three sizing calls measured over {self.far:g}x the fastest's cost (medians) "
                   "leaves before the screen; " if math.isfinite(self.far) else "")
                + "a screen of "
                f"{self.rounds} interleaved rounds of every contender, shuffled from seed {self.seed}; the leader "
                "is the best paired point estimate among those measured longest that no contender is decided "
                "faster than over the rounds both ran; those decided slower than it, or tied with it (the interval "
                f"inside [1/{1 + self.precision:g}, {1 + self.precision:g}]), leave; the leader and the "
                f"rest run on, twice the rounds each look, at most {self.looks} looks ({self.schedule()[-1]} rounds), "
                f"{self.budget_s:g} s for each contender still open after the screen; "
                f"family-wise error {ALPHA:.0%} per contest: each look's {ALPHA / self.looks:.2%} (Bonferroni over "
                f"the {self.looks} looks) under Holm's step-down over the K(K-1)/2 pairs of its K contenders (the "
                "leader is chosen from the same data), each ratio's interval at its Holm level; preference breaks "
                "only ties; a leader still undecided at the end is taken by its paired point estimate")

    @classmethod
    def of(cls, measure: Any) -> Rule:
        """From a stage config's measure section (`precision`, `budget_s`; `fixed_rounds` is ignored: a choice
        always runs the rule)."""
        return cls(precision=getattr(measure, "precision", cls.precision),
                   budget_s=getattr(measure, "budget_s", cls.budget_s))


DECIDED, TIE, UNDECIDED = "decided", "tie", "undecided"
RULE_VERSION = "choice rule 5"  # in the keys of cached choices: one made under an older rule is made again


@dataclass
class Choice:
    """The outcome of `choose`: the pick, how firm it is (`verdict`: decided, tie or undecided), every other
    contender's paired ratio to the pick, and every call of every sample."""

    picked: str
    verdict: str
    leader: str  # the best paired point estimate (the pick unless a preferred tie won)
    higher_is_better: bool
    ratios: dict[str, dict[str, Any]]  # other -> its paired ratio to the pick (the pick as reference)
    screened: list[str]  # decided slower than the leader
    ties: list[str]  # within the precision of the leader
    undecided: list[str]  # neither, when the looks or the budget ended
    invalid: dict[str, str]  # never picked: why
    samples: dict[str, list[list[float]]]  # every call of every sample, by contender and round
    record: dict[str, Any] = field(default_factory=dict)  # rule, calls per sample, rounds, looks, stop, seconds
    reference: dict[str, Any] = field(default_factory=dict)  # each contender vs the reference, over the screen
    far: dict[str, str] = field(default_factory=dict)  # left before the screen, far slower: by how much

    @property
    def label(self) -> str:
        """`decided`, `tie within +-3%: <preference>` or `undecided: chosen by point estimate`."""
        if circle := self.record.get("contradictory"):
            return (f"undecided: the rounds contradict each other ({', '.join(circle)}: each decided faster than the "
                    "one before, over the rounds both ran); chosen by point estimate")
        if self.verdict == UNDECIDED:
            return ("undecided: kept the default" if self.record.get("kept_default")
                    else "undecided: chosen by point estimate")
        if self.verdict == TIE:
            return f"tie within +-{self.record.get('precision', 0):.0%}, broken by preference"
        return DECIDED

    def line(self, noun: str = "") -> str:
        """`onnxruntime (decided; vs ctranslate2 0.71x (0.66-0.76), ...)`."""
        vs = ", ".join(f"{n} {PairedRatio.of(r).fmt()}" for n, r in self.ratios.items())
        return f"{noun}{self.picked} ({self.label}" + (f"; others vs it: {vs}" if vs else "") + ")"

    def to_dict(self) -> dict[str, Any]:
        return {"picked": self.picked, "verdict": self.verdict, "label": self.label, "leader": self.leader,
                "higher_is_better": self.higher_is_better, "ratios": self.ratios, "screened": self.screened,
                "ties": self.ties, "undecided": self.undecided, "invalid": self.invalid, "far": self.far,
                "record": self.record,
                "reference": self.reference, "samples": self.samples}


def _valid(rounds: Sequence[Sequence[float]]) -> bool:
    return all(math.isfinite(x) and x > 0 for rnd in rounds for x in rnd)


def _ratio(samples: dict[str, list[list[float]]], ref: str, other: str, level: float,
           higher: bool) -> dict[str, Any]:
    n = min(len(samples[ref]), len(samples[other]))
    return stats.paired_ratio(samples[ref][:n], samples[other][:n], higher, level=level)


class _Samples:
    """The contenders' calls timed in samples (each sample: `calls[n]` calls), round by round: what `choose` runs
    its screen and its looks with. `wall`: seconds spent in each contender's samples, for the budget."""

    def __init__(self, contenders: dict[str, Callable[[], float]], rule: Rule, clock: Callable[[], float],
                 sleep: Callable[[float], None]):
        self.contenders, self.rule, self.clock, self.sleep = contenders, rule, clock, sleep
        self.calls: dict[str, int] = {}
        self.samples: dict[str, list[list[float]]] = {}
        self.wall: dict[str, float] = {}
        self.long: set[str] = set()  # the contenders whose samples were lengthened for the head to head
        self.sized: dict[str, float] = {}  # the median of the sizing calls' figures, as a cost (1 / a rate)
        # each contender's three sizing calls (their seconds, what each measured): the far screen and the sample
        # sizes are recomputed from these
        self.sizing: dict[str, dict[str, list[float]]] = {}

    def settle(self, n: str) -> None:
        if (pause := timing.settle_time(self.contenders[n])) > 0:
            self.sleep(pause)

    def size(self, names: list[str], warmup: int, higher_is_better: bool) -> dict[str, str]:
        """Warm each contender up, then size its sample from the median of three timed calls; returns the
        contenders that cannot be timed, with why (never picked)."""
        invalid: dict[str, str] = {}
        clock = self.clock
        for n in names:
            try:
                for _ in range(warmup):
                    self.contenders[n]()
                took, values = [], []  # seconds a call takes; what it measures (a timing or a rate)
                for _ in range(3):  # a timing contender's own figure is its call's length; a rate's is the clock's
                    t = clock()
                    values.append(self.contenders[n]())
                    took.append(clock() - t if higher_is_better else values[-1])
            except Exception as e:  # noqa: BLE001 - a contender that fails is never picked, and the report says why
                invalid[n] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e) else ''}"
                continue
            self.settle(n)
            self.sizing[n] = {"seconds": took, "figures": values}
            if not all(math.isfinite(x) and x > 0 for x in (*took, *values)):  # a rate of 0 or inf: no cost
                invalid[n] = "non-finite or non-positive timings"
                continue
            self.sized[n] = median(1.0 / v if higher_is_better else v for v in values)
            self.calls[n] = max(1, min(self.rule.max_calls, math.ceil(self.rule.min_sample_s / median(took))))
        self.samples = {n: [] for n in self.calls}
        self.wall = {n: 0.0 for n in self.calls}
        return invalid

    def far(self, among: list[str], keep: set[str]) -> dict[str, str]:
        """The contenders of `among` (not in `keep`) whose sizing calls measured over `rule.far` times the cost of
        the fastest of `among`, removed before the screen; returns them, with by how much."""
        sized = {n: self.sized[n] for n in among if n in self.sized}
        if not sized:
            return {}
        best = min(sized, key=sized.__getitem__)
        out = {n: f"far slower: {t / sized[best]:.1f}x {best}'s cost per call (medians of 3, before the screen)"
               for n, t in sized.items() if n not in keep and t > self.rule.far * sized[best]}
        for n in out:
            del self.calls[n], self.samples[n], self.wall[n]
        return out

    def look(self, active: list[str], first: int, count: int) -> None:
        """Rounds `first` .. `first + count - 1` of the `active` contenders, each round in its shuffled order."""
        for r in range(first, first + count):
            for n in timing.round_order(active, r, self.rule.seed):
                timing.start_round(self.contenders[n], r)
                t = self.clock()
                self.samples[n].append([self.contenders[n]() for _ in range(self.calls[n])])
                self.wall[n] += self.clock() - t
                self.settle(n)

    def per_call(self, n: str) -> float:
        """Seconds per call of `n` so far."""
        return self.wall[n] / max(sum(len(s) for s in self.samples[n]), 1)

    def lengthen(self, names: list[str]) -> None:
        """The head-to-head's samples: at least `h2h_sample_s` each (`stopping.lengthened`), sized once, from the
        screen's calls."""
        todo = [n for n in names if n not in self.long]
        if self.rule.h2h_sample_s > self.rule.min_sample_s and todo:
            self.calls |= lengthened({n: self.calls[n] for n in todo}, {n: self.per_call(n) for n in todo},
                                     self.rule.h2h_sample_s, max(self.rule.max_calls, H2H_MAX_CALLS))
        self.long.update(todo)

    def round_seconds(self, names: list[str]) -> float:
        """What one more round of `names` is expected to take (their calls at their seconds per call so far, and
        their idle time)."""
        return sum(self.per_call(n) * self.calls[n] + timing.settle_time(self.contenders[n]) for n in names)


def _head_to_head(timed: _Samples, live: list[str], higher: bool, rule: Rule) -> tuple[int, str, list]:
    """The looks after the screen: the leader and the contenders still open against it (`stopping.contest_pairs`:
    the leader no contender is decided faster than, Holm over the contest), twice the rounds each look, until all
    are settled, the looks end or the next look would pass the budget. Returns (looks run, why it stopped,
    contenders per look)."""
    samples, schedule = timed.samples, rule.schedule()
    looks, stopped, per_look = 1, "decided", [len(samples)]
    h2h_start = timed.clock()
    while True:
        pairs = contest_pairs({n: samples[n] for n in live}, live, higher, rule.level, rule.precision)
        if not pairs:
            stopped = "decided"
            break
        if looks == len(schedule):
            stopped = "max-rounds"
            break
        active = [pairs[0][0], *(n for _, n in pairs)]
        done, total = len(samples[active[0]]), schedule[looks]
        timed.lengthen(active)
        fit = (rule.budget_s * len(pairs) - (timed.clock() - h2h_start)) / timed.round_seconds(active)
        if looks > 1 and fit < total - done:  # the last look the budget allows: as many rounds as fit
            if fit < 1:
                stopped = "budget"
                break
            total = done + int(fit)
        timed.look(active, done, total - done)
        looks += 1
        per_look.append(len(active))
    return looks, stopped, per_look


def choose(contenders: dict[str, Callable[[], float]], higher_is_better: bool, rule: Rule = Rule(),
           prefer: Callable[[str], Any] | None = None, reference: str | None = None, default: str | None = None,
           warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
           sleep: Callable[[float], None] = time.sleep) -> Choice:
    """Pick the fastest of `contenders` (functions returning one timing, or one rate when `higher_is_better`) by
    the module's rule. `prefer`: a sort key; the smallest breaks ties within the precision (default: the order
    given). `reference`: a contender timed in the screen only, never picked (e.g. the parent: every candidate's
    ratio to it is reported over the screen's rounds). `default`: the contender kept where the leader is still
    undecided against it at the end (see the module's text). A contender's `settle_s` attribute: idle seconds after its
    calls (runtimes whose threads spin-wait)."""
    names = list(contenders)
    candidates = [n for n in names if n != reference]
    if not candidates:
        raise EffkitError("nothing to choose from")
    start = clock()
    timed = _Samples(contenders, rule, clock, sleep)
    invalid = timed.size(names, warmup, higher_is_better)  # warm-up, then the median of three sizes the sample
    far = timed.far(candidates, {n for n in (reference, default) if n is not None})
    samples = timed.samples
    timed.look(list(samples), 0, rule.schedule()[0])  # the screen
    for n in list(samples):
        if not _valid(samples[n]):
            invalid[n] = "non-finite or non-positive timings"
    live = [n for n in candidates if n not in invalid and n not in far]
    if not live:
        raise EffkitError("no contender could be timed: " + "; ".join(f"{n}: {why}" for n, why in invalid.items()))
    level, higher = rule.level, higher_is_better
    reference_ratios = ({n: _ratio(samples, reference, n, level, higher) for n in live}
                        if reference is not None and reference not in invalid else {})
    screen_calls = dict(timed.calls)
    looks, stopped, per_look = _head_to_head(timed, live, higher, rule)
    longer = {n: c for n, c in timed.calls.items() if c != screen_calls[n]}
    record = {"rule": rule.describe(), "looks": looks, "stopped": stopped, "contenders_per_look": per_look,
              "calls_per_sample": screen_calls, **({"calls_per_sample_after_screen": longer} if longer else {}),
              "seconds": round(clock() - start, 3), "sizing": timed.sizing,
              "order": f"shuffled each round from seed {rule.seed}"}
    c = decide({n: samples[n] for n in live}, higher, level, rule.precision,
               prefer=lambda n: ((prefer or names.index)(n), names.index(n)), record=record, default=default)
    c.invalid, c.reference, c.far = invalid, reference_ratios, far
    c.samples = samples
    return c


def decide(samples: dict[str, list[list[float]]], higher_is_better: bool, level: float, precision: float,
           prefer: Callable[[str], Any] | None = None, record: dict[str, Any] | None = None,
           default: str | None = None) -> Choice:
    """The pick among contenders already measured in interleaved rounds (`samples`: per contender, per round, its
    calls; a contender that left early ran a prefix of the rounds): the leader (`stopping.Contest.leader`: the best
    paired point estimate among those measured longest that no contender is decided faster than), then decided / tie /
    undecided as the module says, every ratio to the pick under Holm over the contest (`Contest.standing`).
    `prefer`: the sort key that breaks a tie (default: the order of `samples`). `default`: kept where the pick
    would be a leader still undecided against it."""
    names = list(samples)
    invalid = {n: "non-finite or non-positive timings" for n in names if not _valid(samples[n])}
    live = [n for n in names if n not in invalid]
    if not live:
        raise EffkitError("no contender has valid timings: " + ", ".join(names))
    higher, contest = higher_is_better, Contest(samples, live, higher_is_better, level)
    to, lead = contest.standing, contest.leader()
    circle = _circle(live, to) if lead is None else []
    lead = lead or leader_of(samples, [n for n in live if len(samples[n]) == max(map(len, samples.values()))],
                             higher)
    to_lead = {n: PairedRatio.of(r) for n, r in to(lead).items()}
    screened = [n for n, r in to_lead.items() if r.verdict == "slower"]
    ties = [n for n, r in to_lead.items() if tie(r, precision)]
    open_ = [n for n in to_lead if n not in screened and n not in ties]
    kept_default = bool(open_) and default in live and (default in open_ or default == lead) and contest.unbeaten(
        default)
    if open_:
        verdict, picked = UNDECIDED, default if kept_default else lead
    elif ties:  # the preferred of the leader and its ties that every other is settled against, none faster
        firm = [x for x in [lead, *ties] if contest.unbeaten(x) and all(settled(PairedRatio.of(r), precision)
                                                                       for r in to(x).values())]
        verdict, picked = TIE, min(firm or [lead], key=prefer or names.index)
    else:
        verdict, picked = DECIDED, lead
    if kept_default and default != lead:  # the leader and the others still open against it, undecided vs the default
        open_ = [lead, *(n for n in open_ if n != default)]
    ratios = to(picked)
    for n in open_:
        if ratios[n]["verdict"] == "same":  # a decided ratio is never marked undecided
            ratios[n]["undecided"] = True
    record = {**(record or {}), "precision": precision, "level": level, "familywise": 1.0 - level,
              "family": contest.family, "rounds": {n: len(s) for n, s in samples.items()},
              **({"contradictory": circle} if circle else {}),
              **({"default": default, "kept_default": kept_default} if default in live else {})}
    return Choice(picked, verdict, lead, higher, ratios, screened, ties, open_, invalid, samples=dict(samples),
                  record=record)


def _circle(live: Sequence[str], to: Callable[[str], dict[str, dict[str, Any]]]) -> list[str]:
    """Where every contender of `live` is decided slower than another (`to(x)`: the others' ratios to x), a circle
    of them, each decided faster than the one before."""
    path = [live[0]]
    while (nxt := next(n for n, r in to(path[-1]).items() if r["verdict"] == "faster")) not in path:
        path.append(nxt)
    return path[path.index(nxt):]
