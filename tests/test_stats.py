"""The statistics behind every comparison: intervals and verdicts on synthetic measurements."""

import json
import math
import random
import time

import pytest

from effkit.measure import stats, timing


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
    assert r["ci"][0] < scale < r["ci"][1]
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
    assert stats.fmt_ratio({"ratio": 0.71, "ci": [0.66, 0.76], "verdict": "faster"}) == "0.71x (0.66-0.76)"
    assert stats.fmt_ratio({"ratio": 0.98, "ci": [0.91, 1.05], "verdict": "same"}) == "≈ 0.98x (0.91-1.05)"
    assert stats.fmt_delta({"delta": 0.004, "ci95": [0.001, 0.007], "verdict": "worse"}) == "+0.4% (+0.1 to +0.7%)"
    small = {"delta": -0.0002, "ci95": [-0.0005, 0.0001], "verdict": "same"}
    assert stats.fmt_delta(small) == "≈ -0.02% (-0.05 to +0.01%)"


def test_interleaving_rotates_the_order():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abc"}
    samples = timing.interleaved(contenders, rounds=3, repeats=2, warmup=1)
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
    assert set(ratio) == {"ratio", "ci", "ci_level", "verdict", "rounds"}
    assert set(delta) == {"delta", "ci95", "verdict", "blocks"}
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


def synthetic(seed, scale, noise=0.05, drift=0.25):
    """Two contenders timed by a shared, drifting machine: per call, the machine's level of the moment times the
    contender's scale times its own noise."""
    rng, calls = random.Random(seed), [0]

    def timer(s):
        def once():
            calls[0] += 1
            return s * (1 + drift * math.sin(calls[0] / 7)) * (1 + rng.gauss(0, noise))
        return once
    return {"ref": timer(1.0), "other": timer(scale)}


def test_sequential_stopping_keeps_its_error_rate_and_decides_a_10_percent_shift():
    """100 seeded trials each: identical distributions end `same` in at least 95 (the looks are Bonferroni-
    corrected, so looking three times does not inflate the 5%); a 10% shift is decided in at least 95, in the
    right direction, mostly before the last look."""
    from effkit.measure import stopping

    rule = stopping.Stopping(rounds=6, min_sample_s=0)  # one call's figures, as drawn
    same = [stopping.measure(synthetic(s, 1.0), rule, repeats=3).ratio("ref", "other")["verdict"] for s in range(100)]
    assert same.count("same") >= 95
    shifted = [stopping.measure(synthetic(1000 + s, 1.1), rule, repeats=3) for s in range(100)]
    assert sum(m.ratio("ref", "other")["verdict"] == "slower" for m in shifted) >= 95
    assert all(m.record["stopped"] == "decided" and m.record["rounds"] in (6, 12, 24) for m in shifted)
    assert sum(m.record["rounds"] < 24 for m in shifted) > 50  # a clear difference stops before the last look
    r = shifted[0].ratio("ref", "other")
    assert r["ci_level"] == pytest.approx(1 - 0.05 / 3) and r["rounds"] == shifted[0].record["rounds"]
    # the same shift with one fixed look of 6 rounds: 95% intervals, no more rounds whatever they show
    fixed = stopping.measure(synthetic(7, 1.0), stopping.Stopping(rounds=6, fixed=True), repeats=3)
    assert fixed.record["rounds"] == 6 and fixed.record["stopped"] == "fixed"
    fixed_ratio = fixed.ratio("ref", "other")  # a fixed look: 95%, never "undecided"
    assert fixed_ratio["ci_level"] == 0.95 and "undecided" not in fixed_ratio


def test_sequential_stopping_respects_its_time_budget():
    from effkit.measure import stopping
    from effkit.measure.results import PairedRatio

    now, rng = [0.0], random.Random(9)

    def clock():
        return now[0]

    def slow():  # 1 s per call on the fake clock (2 s a round), never a difference: the rounds would go on to 16
        now[0] += 1.0
        return 1.0 + rng.random() * 0.5
    rule = stopping.Stopping(rounds=4, budget_s=10.0, precision=0.001)
    m = stopping.measure({"a": slow, "b": slow}, rule, repeats=1, warmup=0, clock=clock)
    # after the first look (4 rounds): 4 more rounds (8 s) fit in 10 s, the next 8 (16 s more) would not
    assert m.record["stopped"] == "budget" and m.record["rounds"] == 8
    r = m.ratio("a", "b")  # stopped by the budget, its interval contains 1 and is far wider than +-0.1%
    assert r["verdict"] == "same" and r["undecided"] is True and PairedRatio.of(r).fmt().startswith("? ")
    assert PairedRatio.of(r).to_dict() == r and PairedRatio.of(r).summary("x").startswith("x: undecided, ")
    roomy = stopping.measure({"a": slow, "b": slow}, stopping.Stopping(rounds=4, budget_s=100.0, precision=0.001),
                             repeats=1, warmup=0, clock=clock)
    assert roomy.record["rounds"] == 16 and roomy.record["stopped"] == "max-rounds"


def test_sequential_stopping_measures_only_what_is_undecided():
    """A contender twice as slow is decided at the first look and not measured again; one 2% slower goes on; each
    ratio is over the rounds both of its contenders ran."""
    from effkit.measure import stopping

    machine = synthetic(11, 2.0)
    near = synthetic(12, 1.02)["other"]
    m = stopping.measure({"ref": machine["ref"], "far": machine["other"], "near": near},
                         stopping.Stopping(rounds=6, min_sample_s=0), repeats=3)
    assert len(m["far"]) == 6 and len(m["near"]) == len(m["ref"]) == m.record["rounds"] > 6
    assert m.record["contenders_per_look"][:2] == [3, 2]
    assert m.ratio("ref", "far")["rounds"] == 6 and m.ratio("ref", "far")["verdict"] == "slower"
    assert m.ratio("ref", "near")["rounds"] == m.record["rounds"]


def test_sequential_samples_last_long_enough_and_fixed_rounds_run_as_asked():
    """Sequential: a contender's warm-up sizes its samples to at least MIN_SAMPLE_S (a 62.5 ms call repeated 4 times
    a round, a 0.5 s one the repeats asked for); fixed rounds run exactly the repeats asked for."""
    from effkit.measure import stopping

    now = [0.0]

    def timer(seconds):
        def call():
            now[0] += seconds
            return seconds
        return call
    contenders = {"slow": timer(0.5), "fast": timer(0.0625)}
    m = stopping.measure(contenders, stopping.Stopping(rounds=4), repeats=2, warmup=1, clock=lambda: now[0])
    assert m.record["calls_per_sample"] == {"slow": 2, "fast": 4}
    assert {len(r) for r in m["fast"]} == {4} and {len(r) for r in m["slow"]} == {2}
    fixed = stopping.measure(contenders, stopping.Stopping(rounds=4, fixed=True), repeats=2, warmup=1,
                             clock=lambda: now[0])
    assert fixed.record["calls_per_sample"] == {"slow": 2, "fast": 2} and {len(r) for r in fixed["fast"]} == {2}
    assert "samples of at least 0.2 s" in stopping.Stopping().describe()


def test_the_looks_after_the_first_run_samples_of_at_least_half_a_second():
    """What the first look leaves open runs on in samples of at least `h2h_sample_s` (a 62.5 ms call about 8
    times), recorded beside the first look's."""
    from effkit.measure import stopping

    now, rng = [0.0], random.Random(5)

    def timer(seconds):
        def call():
            took = seconds * (1 + rng.gauss(0, 0.3))  # equal and noisy: the first look leaves them open
            now[0] += took
            return took
        return call
    rule = stopping.Stopping(rounds=4, precision=0.001, budget_s=1e4, h2h_sample_s=stopping.H2H_SAMPLE_S)
    m = stopping.measure({"a": timer(0.0625), "b": timer(0.0625)}, rule, repeats=1, warmup=1,
                         clock=lambda: now[0])
    first, later = m.record["calls_per_sample"], m.record["calls_per_sample_after_screen"]
    assert m.record["looks"] > 1 and all(later[n] >= 7 > first[n] for n in "ab")  # ~0.5 s at ~62.5 ms a call
    assert all(len(r) == first[n] for n in "ab" for r in m[n][:4])
    assert all(len(r) == later[n] for n in "ab" for r in m[n][4:])
    assert "after the first look, samples of at least 0.5 s" in rule.describe()
    short = stopping.measure({"a": timer(0.0625), "b": timer(0.0625)},
                             stopping.Stopping(rounds=4, precision=0.001, budget_s=1e4),
                             repeats=1, warmup=1, clock=lambda: now[0])
    assert "calls_per_sample_after_screen" not in short.record  # the default (the bench's): as long as the screen's
    assert "after the first look" not in stopping.Stopping().describe()


def test_general_t_quantiles():
    for df in (1, 3, 12, 29):
        assert stats.t_quantile(0.95 + 1e-12, df) == pytest.approx(stats.t95(df), abs=1e-3)
    assert stats.t_quantile(0.99, 5) == pytest.approx(4.0321, abs=1e-4)  # tables
    assert stats.t_quantile(0.98, 10) == pytest.approx(2.7638, abs=1e-4)


def test_a_loss_interval_by_document_is_wider_when_blocks_of_a_document_agree():
    """Twelve documents, each repeated over eight blocks (its blocks nearly equal, the documents different): the
    interval by document counts twelve independent values, the one over blocks pretends there are 96."""
    rng = random.Random(5)
    doc_level = [5.0 + rng.gauss(0, 0.3) for _ in range(12)]
    values = [doc_level[d] + rng.gauss(0, 0.01) for d in range(12) for _ in range(8)]
    docs = [d for d in range(12) for _ in range(8)]
    m, lo, hi = stats.mean_ci(values)
    mc, loc, hic = stats.mean_ci(values, clusters=docs)
    assert mc == m and hic - loc > 2.5 * (hi - lo)
    # blocks that are independent within documents: about the same width either way
    flat = [5.0 + rng.gauss(0, 0.3) for _ in range(96)]
    _, lo_f, hi_f = stats.mean_ci(flat)
    _, loc_f, hic_f = stats.mean_ci(flat, clusters=docs)
    assert 0.6 < (hic_f - loc_f) / (hi_f - lo_f) < 1.6
    # and the paired delta of two models carries the documents
    other = [v + 0.05 * (d % 2) for v, d in zip(values, docs, strict=True)]  # worse on every other document
    d_docs, d_blocks = stats.paired_delta(values, other, docs), stats.paired_delta(values, other)
    assert d_docs["documents"] == 12 and "documents" not in d_blocks
    assert (d_docs["ci95"][1] - d_docs["ci95"][0]) > 2 * (d_blocks["ci95"][1] - d_blocks["ci95"][0])
    assert stats.interval_by(docs, 96) == "by document (12 documents, 96 blocks)"
    assert stats.interval_by([0] * 4, 4) == "over blocks (4 blocks, one document)"


def test_machine_cached_keeps_what_was_measured_meanwhile(tmp_path, monkeypatch):
    """Two measurements that overlap (one finishes while the other runs) both stay in the cache file; a key
    already there is returned without measuring."""
    from effkit.measure import machine_cache

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path))

    def slow_a():
        machine_cache.machine_cached("probe", "b", lambda: 2)  # another measurement lands while this one runs
        return 1

    assert machine_cache.machine_cached("probe", "a", slow_a) == (1, False)
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert {k.rpartition("|")[2]: v["value"] for k, v in saved.items()} == {"a": 1, "b": 2}
    assert machine_cache.machine_cached("probe", "b", lambda: 1 / 0) == (2, True)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_cached_measurement_belongs_to_its_machine_says_when_and_can_be_taken_again(tmp_path, monkeypatch):
    """#39 (5): the caches were keyed by the CPU's model name and thread count only (no flags, no host) and never
    expired, so a shared $EFFKIT_CACHE handed another host's GEMM peak over as "this CPU's"."""
    from effkit.measure import hardware, machine_cache

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path))
    monkeypatch.delenv(machine_cache.REMEASURE_ENV, raising=False)
    assert machine_cache.machine_cached("probe", "k", lambda: 1) == (1, False)
    assert machine_cache.machine_cached("probe", "k", lambda: 2) == (1, True)
    note = machine_cache.cache_note("probe", "k")
    assert note.startswith("measured 20") and "on host" in note and "machine" in note
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ["sse2"])  # the same host name, another CPU: not its figure
    assert machine_cache.machine_cached("probe", "k", lambda: 3) == (3, False)
    monkeypatch.setenv(machine_cache.REMEASURE_ENV, "1")  # effkit --remeasure: once in this process, then that value
    monkeypatch.setattr(machine_cache, "_REMEASURED", set())
    assert machine_cache.machine_cached("probe", "k", lambda: 4) == (4, False)
    assert machine_cache.machine_cached("probe", "k", lambda: 6) == (4, True)
    monkeypatch.delenv(machine_cache.REMEASURE_ENV)
    path = tmp_path / "probe.json"
    saved = json.loads(path.read_text())
    for entry in saved.values():  # measured 40 days ago: too old to trust
        entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 40 * 86400))
    path.write_text(json.dumps(saved))
    assert machine_cache.machine_cached("probe", "k", lambda: 5) == (5, False)


def test_a_non_finite_measurement_is_invalid_never_no_difference():
    """#39 (11): a NaN loss (a diverged model) or an infinite timing gave NaN bounds, fell through to `same` and
    printed `≈` (no difference); it is `invalid`, printed as such."""
    d = stats.paired_delta([1.0, 2.0, 3.0, 4.0], [1.1, math.nan, 3.0, 4.1])
    assert d["verdict"] == "invalid" and stats.fmt_delta(d) == "invalid (non-finite loss)"
    assert stats.paired_delta([1.0, 2.0], [math.inf, 2.0])["verdict"] == "invalid"
    r = stats.paired_ratio([[1.0], [1.1], [0.9]], [[math.inf], [1.0], [1.0]])
    assert r["verdict"] == "invalid" and "≈" not in stats.fmt_ratio(r)
    assert stats.paired_ratio([[1.0], [1.1]], [[math.nan], [1.0]], higher_is_better=True)["verdict"] == "invalid"
    assert stats.paired_delta([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])["verdict"] == "same"  # finite: as before


def test_the_rounds_shuffle_who_runs_before_whom_from_a_recorded_seed():
    """#39 (3): rotating the order by one each round kept the cyclic order, so each contender always ran right
    after the same one (carry-over from a spinning engine always hit the same pair). Now the order is shuffled each
    round from a seed that the stopping record gives."""
    from effkit.measure import stopping

    calls: list[str] = []
    contenders = {n: (lambda n=n: calls.append(n) or 1.0) for n in "abcd"}
    measured = stopping.measure(contenders, stopping.Stopping(rounds=12, fixed=True, seed=5), repeats=1, warmup=0)
    rounds = [calls[i * 4:(i + 1) * 4] for i in range(12)]
    before = {n: {r[r.index(n) - 1] for r in rounds if r.index(n) > 0} for n in "abcd"}
    assert all(len(b) >= 2 for b in before.values()), before
    assert all(sorted(r) == list("abcd") for r in rounds)  # every contender once per round
    assert "seed 5" in measured.record["order"]
    calls.clear()
    stopping.measure(contenders, stopping.Stopping(rounds=12, fixed=True, seed=5), repeats=1, warmup=0)
    assert [calls[i * 4:(i + 1) * 4] for i in range(12)] == rounds  # the seed reproduces the orders


def test_a_contender_that_settled_early_is_shown_beside_the_reference_over_the_same_rounds():
    """#39 (1): a contender that settled after the first look stopped running while the reference went on; its
    figure (its own rounds) sat next to the reference's median over all rounds and beside a ratio over the shared
    rounds, so the columns could not be reconciled. The row now carries the reference's figure over its rounds."""
    from effkit import workloads
    from effkit.bench.render import same_rounds_note
    from effkit.bench.rows import combine
    from effkit.measure.stopping import Measured

    level = [0.5] * 6 + [1.0] * 18  # the machine: slow for 6 rounds (tokens/s halved), then fast
    ref_rounds = [[100.0 * x] for x in level]
    fast = [[146.0 * x] for x in level[:6]]  # settled after the first look: 6 rounds
    record = {"level": 0.95, "rounds": 24}
    timed = {w.measure: Measured({"ref": ref_rounds, "a": fast}, record) for w in workloads.all_()}
    timed |= {m: Measured({}, record) for m in ("train_b4", "train_b12")}
    static = [{"tag": t, "stage": "train" if t == "ref" else "quantize", "block_losses": [1.0, 2.0],
               "block_docs": [0, 1], "size_bytes": 10, "generation": {}, "eval_loss": 1.5} for t in ("ref", "a")]
    rows = combine(static, timed)
    a = rows[1]
    d = workloads.get("decode-b1")
    assert a[d.figure] == 73.0 and rows[0][d.figure] == 100.0  # each over its own rounds
    same = a["same_rounds"][d.key]
    assert same == {"rounds": 6, "reference": 50.0}  # the reference over a's 6 rounds: 73 / 50 = the ratio
    assert a[d.ratio]["ratio"] == pytest.approx(73.0 / 50.0)
    note = same_rounds_note({"stopping": {d.measure: {"rounds": 24}}}, a, d.ratio)
    assert note == "; ref 50 in these 6 rounds"


def _holm_bench(seed: int, tables: bool, looks_level: bool = False):
    """A measure of the bench's: a reference and seven contenders each 8% faster under the tests' noise model (a
    fake clock), the seven ratios of one table; returns (the measure, its ratios as the table reports them)."""
    from effkit.measure import stopping

    now, rng = [0.0], random.Random(seed)

    def contender(speed: float):
        def call() -> float:
            took = 0.05 * speed * rng.lognormvariate(0, 0.04)
            now[0] += took
            return took
        return call
    names = ["ref", *"abcdefg"]
    stop = stopping.Stopping(rounds=6, budget_s=600.0, looks=3, min_sample_s=0)
    cells = stopping.Tables(("main", "latency", "ref", n) for n in names[1:])
    m = stopping.measure({n: contender(1.0 if n == "ref" else 0.92) for n in names}, stop, 1, clock=lambda: now[0],
                         tables=(cells, "latency") if tables else None)
    family = stopping.Family("main")
    ratios = [family.ratio(m, "ref", n) for n in names[1:]]
    family.close()
    return m, ratios


def test_the_bench_stops_a_ratio_only_where_its_holm_level_in_its_table_settles_it():
    """The bench reports each ratio of a table at its Holm level over the table; its stopping rule judges each ratio
    at that level, at every look: measuring never stops as "decided" with a ratio the table reports undecided, and
    a ratio reported decided or tied is settled at the level the stopping rule judged it at. Seeds where the looks'
    own level would have stopped after the first look while Holm's left ratios open are among those run."""
    from effkit.measure import stopping
    from effkit.measure.results import PairedRatio

    early = 0
    for seed in range(12):
        m, ratios = _holm_bench(seed, tables=True)
        if m.record["stopped"] == "decided":
            assert all(stopping.settled(PairedRatio.of(r), 0.03) and not r.get("undecided") for r in ratios), ratios
        else:
            assert m.record["stopped"] in ("max-rounds", "budget") and m.record["rounds"] == 24, m.record
        # the same seed judged at the looks' own level: stopped as decided, some ratios reported undecided
        old, at_look = _holm_bench(seed, tables=False)
        early += old.record["stopped"] == "decided" and any(r.get("undecided") for r in at_look)
    assert early >= 3, early


def test_two_rounds_at_a_strict_holm_level_give_an_unbounded_interval_not_an_overflow():
    """t with one degree of freedom at level 0.99896 puts the upper log bound past a float's exponent."""
    r = stats.ratio_of_logs([-3.959, -1.295], 2, True, 0.9989583333333333)
    assert r["ci"][1] == math.inf and r["ci"][0] < r["ratio"] < 1 and r["verdict"] == "same"
