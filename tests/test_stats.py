"""The statistics behind every comparison: intervals and verdicts on synthetic measurements."""

import math
import random

import pytest

from effkit.measure import metrics, stats


def rounds(rng, scale, n_rounds=8, repeats=3, drift=0.25, noise=0.05):
    """Per-round timings: a common machine drift per round (what interleaving cancels) and per-call noise."""
    out = []
    for r in range(n_rounds):
        level = 1 + drift * math.sin(r)  # the machine slows down and speeds up between rounds
        out.append([scale * level * (1 + rng.gauss(0, noise)) for _ in range(repeats)])
    return out


def test_identical_distributions_are_the_same():
    rng = random.Random(0)
    verdicts = [stats.paired_ratio(rounds(rng, 0.3), rounds(rng, 0.3))["verdict"] for _ in range(20)]
    assert verdicts.count("same") >= 18  # a 95% interval: about 1 in 20 may miss


@pytest.mark.parametrize("scale, verdict", [(0.7, "faster"), (1.3, "slower")])
def test_a_30_percent_shift_is_decided(scale, verdict):
    rng = random.Random(1)
    r = stats.paired_ratio(rounds(rng, 0.3), rounds(rng, 0.3 * scale))
    assert r["verdict"] == verdict
    assert r["ci95"][0] < scale < r["ci95"][1]
    assert r["ratio"] == pytest.approx(scale, rel=0.05)


def test_rates_read_the_other_way():
    rng = random.Random(2)
    r = stats.paired_ratio(rounds(rng, 100.0), rounds(rng, 130.0), higher_is_better=True)
    assert r["verdict"] == "faster" and r["ratio"] > 1


def test_pairing_cancels_drift_that_would_hide_a_difference():
    """A 5% difference under 25% drift between rounds: decided when paired by round."""
    rng = random.Random(3)
    ref, other = rounds(rng, 1.0, noise=0.01), rounds(rng, 0.95, noise=0.01)
    assert stats.paired_ratio(ref, other)["verdict"] == "faster"
    flat_ref, flat_other = [x for r in ref for x in r], [x for r in other for x in r]
    assert stats.unpaired_ratio(flat_ref, flat_other)["verdict"] == "same"  # unpaired, the drift swamps it


def test_paired_delta_of_a_model_with_itself_is_exactly_zero():
    losses = [5.1, 5.7, 6.0, 5.4, 5.9]
    d = stats.paired_delta(losses, losses)
    assert d == {"delta": 0.0, "ci95": [0.0, 0.0], "verdict": "same", "blocks": 5}


def test_paired_delta_decides_a_consistent_one_percent_change():
    rng = random.Random(4)
    ref = [5.7 + rng.gauss(0, 0.4) for _ in range(64)]  # blocks differ a lot from each other
    worse = [x * 1.01 + rng.gauss(0, 0.005) for x in ref]  # but the change is the same on each
    d = stats.paired_delta(ref, worse)
    assert d["verdict"] == "worse" and d["ci95"][0] > 0 and d["delta"] == pytest.approx(0.01, abs=0.002)
    _, lo, hi = stats.mean_ci(ref)
    assert hi - lo > 0.1  # unpaired, the loss's own interval is far wider than 1%


def test_formatting_marks_what_is_not_a_difference():
    assert stats.fmt_ratio({"ratio": 0.71, "ci95": [0.66, 0.76], "verdict": "faster"}) == "0.71x (0.66-0.76)"
    assert stats.fmt_ratio({"ratio": 0.98, "ci95": [0.91, 1.05], "verdict": "same"}) == "≈ 0.98x (0.91-1.05)"
    assert stats.fmt_delta({"delta": 0.004, "ci95": [0.001, 0.007], "verdict": "worse"}) == "+0.4% (+0.1 to +0.7%)"
    small = {"delta": -0.0002, "ci95": [-0.0005, 0.0001], "verdict": "same"}
    assert stats.fmt_delta(small) == "≈ -0.02% (-0.05 to +0.01%)"


def test_interleaving_rotates_the_order():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abc"}
    samples = metrics.interleaved(contenders, rounds=3, repeats=2, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert calls[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(len(r) == 2 for v in samples.values() for r in v)


@pytest.mark.parametrize("df, exact", [(5, 2.571), (30, 2.042), (31, 2.0395), (40, 2.0211), (59, 2.0010),
                                       (120, 1.9799), (1000, 1.9623)])
def test_t_quantiles_are_exact_at_every_degree_of_freedom(df, exact):
    from effkit.measure.stats import t95

    assert t95(df) == pytest.approx(exact, abs=1e-4)  # beyond 30: not the normal's 1.96


def test_typed_results_round_trip_the_report_format_and_refuse_a_renamed_key():
    from effkit.measure.results import LossDelta, PairedRatio, comparison

    rng = random.Random(3)
    ratio = stats.paired_ratio(rounds(rng, 0.3), rounds(rng, 0.2))
    delta = stats.paired_delta([1.0, 2.0, 3.0], [1.1, 2.1, 3.0])
    assert set(ratio) == {"ratio", "ci95", "verdict", "rounds"} and set(delta) == {"delta", "ci95", "verdict", "blocks"}
    assert PairedRatio.of(ratio).to_dict() == ratio and LossDelta.of(delta).to_dict() == delta  # the JSON, unchanged
    assert isinstance(comparison(ratio), PairedRatio) and isinstance(comparison(delta), LossDelta)
    assert stats.fmt_ratio(ratio) == PairedRatio.of(ratio).fmt() and stats.fmt_delta(delta) == LossDelta.of(delta).fmt()
    unpaired = stats.unpaired_ratio([1.0, 1.1, 0.9], [2.0, 2.1, 1.9])
    assert PairedRatio.of(unpaired).method == "unpaired" and PairedRatio.of(unpaired).to_dict() == unpaired
    renamed = {("speedup" if k == "ratio" else k): v for k, v in ratio.items()}
    with pytest.raises(KeyError, match="not a paired ratio: no ratio"):
        PairedRatio.of(renamed)
    with pytest.raises(ValueError, match="verdict"):
        LossDelta.of({**delta, "verdict": "faster"})
