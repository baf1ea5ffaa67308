"""A time budget's share in the measuring stages' fixed work: quantize `auto` writes that share of the backends and
the bench makes that share of the peers (the fastest measured before first: effkit/stage_costs.json), each one left
out listed as not run; the estimate and `effkit run --plan` price the stages by the same rule."""

import json
import time

import pytest
import torch
from test_run import write_recipe

from effkit import engines
from effkit.bench import speculative
from effkit.bench.stage import FEWEST_PEERS, BenchStep, peers_at_share
from effkit.config import BenchConfig, QuantizeConfig
from effkit.errors import EffkitError
from effkit.pipeline import expected_seconds, make_plan, shared, stage_budgets, stage_work, step_timer, unit_seconds
from effkit.quantize import backends
from effkit.quantize import stage as quantize
from effkit.stage import Plan, by_share, costs

CPU = torch.device("cpu")


@pytest.fixture
def speeds(monkeypatch):
    """Measured speeds that rank the backends and the peers in the reverse of the registries' order (the default
    last), and a weight for each backend."""
    names = [b for b in backends.names() if not (backends.unavailable(b, CPU) or backends.get(b).refuses(
        QuantizeConfig.from_flat()))]
    peers = [e.name for e in engines.peers()]
    monkeypatch.setitem(costs(), "speed", {"backends": {b: (i + 1) / len(names) for i, b in enumerate(names)},
                                           "peers": {n: (i + 1) / len(peers) for i, n in enumerate(peers)}})
    monkeypatch.setitem(costs(), "quantize", {"fixed": 100.0, "backends": {b: 10.0 * (i + 1)
                                                                           for i, b in enumerate(names)}})
    return names, peers


def test_the_share_rule_keeps_the_fastest_measured_never_under_its_floor_and_the_first_always():
    speed = {"a": 0.2, "b": 1.0, "c": 0.5, "d": 0.9}
    assert by_share(list("abcde"), 1.0, 3, speed) == (list("abcde"), [])
    assert by_share(list("abcde"), 0.2, 3, speed) == (list("bcd"), list("ae"))  # ceil(1) < 3: the three fastest
    assert by_share(list("abcde"), 0.2, 3, speed, first="e") == (list("bde"), list("ac"))  # e never measured
    assert by_share(list("abcde"), 0.7, 1, speed) == (list("abcd"), list("e"))  # ceil(3.5): the unmeasured last
    assert by_share(list("ab"), 0.2, 3, speed) == (list("ab"), [])


def test_auto_on_a_small_share_writes_fewer_backends_and_lists_each_left_out(speeds, tmp_path, monkeypatch):
    names, _ = speeds
    assert len(names) > quantize.AUTO_FEWEST  # else nothing could be left out here
    cfg = QuantizeConfig.from_flat(auto_share=0.2)
    kept, why = quantize.auto_candidates(cfg, CPU)
    others = [b for b in names if b != quantize.AUTO_DEFAULT]
    fastest = others[-(quantize.AUTO_FEWEST - 1):]  # the speeds rise along the registry's order
    assert kept == [b for b in names if b in {quantize.AUTO_DEFAULT, *fastest}]
    left = [b for b in names if b not in kept]
    assert left and all(why[b].startswith("not run: budget share 20%") and "measured fastest before" in why[b]
                        for b in left)
    assert quantize.auto_candidates(cfg.replace(auto_share=1.0), CPU)[0] == names  # the recipe's own: all of them

    written = []

    def fake_write(folder, backend, *a, **k):
        written.append(backend)
        raise EffkitError("not written in this test")

    monkeypatch.setattr(quantize, "write_quantized", fake_write)
    (tmp_path / "scratch").mkdir()
    table = quantize._within_budget(cfg, CPU, None, tmp_path, None, None, [], tmp_path / "scratch", ())
    assert written == kept and set(table) == set(backends.names())  # every backend has its row: none silently gone
    assert all(table[b]["status"] == why[b] for b in left)
    assert "on 20% of its time budget" in quantize._written(cfg) and "every" in quantize._written(cfg.replace(
        auto_share=1.0))


def test_the_bench_on_a_small_share_makes_fewer_peers_and_lists_each_left_out(speeds):
    _, peers = speeds
    cfg = BenchConfig.from_flat(peers=True, peer_share=0.2)
    kept, left = peers_at_share(cfg)
    assert kept == peers[-FEWEST_PEERS:]  # the two measured fastest
    tags = {e.name: e.peer_tag for e in engines.peers()}
    assert set(left) == {tags[n] for n in peers[:-FEWEST_PEERS]}
    assert all(w.startswith("not run: budget share 20%") for w in left.values())
    assert peers_at_share(cfg.replace(peer_share=1.0)) == (peers, {})


def test_the_estimate_prices_the_measuring_stages_by_the_same_rule(speeds, tmp_path, corpus_dir):
    """What the run predicts before training for quantize and the bench on a share is what they run at that share:
    the backends `auto_candidates` keeps and the peers `peers_at_share` keeps, each at its weight."""
    names, _ = speeds
    recipe = write_recipe(tmp_path, corpus_dir)
    recipe.write_text(recipe.read_text().replace("max_steps = 4\nwarmup_steps = 1", "max_steps = 100\nwarmup_steps = 5")
                      .replace('backend = "dynamic"', 'backend = "auto"'))
    plan = make_plan(str(recipe))
    timer = step_timer(plan)
    full, small = shared(plan, timer, 100), shared(plan, timer, 20)
    assert small[1]["quantize"]["share"] == 0.2 and small[0].quantize.method.auto_share == 0.2
    kept, _ = quantize.auto_candidates(small[0].quantize, CPU)
    w = costs()["quantize"]
    assert stage_work(small[0])["quantize"] == pytest.approx(w["fixed"] + sum(w["backends"][b] for b in kept))
    assert stage_work(full[0])["quantize"] == pytest.approx(w["fixed"] + sum(w["backends"][b] for b in names))
    assert small[1]["bench"]["peers"] == peers_at_share(small[0].bench)[0] and small[1]["bench"]["not_run"]
    b, ms = costs()["bench"], small[0].bench.measure
    per_artifact = ms.rounds * b["artifact_round"] * ms.gen_tokens / 128 * ms.repeats / 3 + b["artifact"]
    dropped = len(engines.peers()) - FEWEST_PEERS
    every_peer = Plan(plan.recipe, plan.run, {**small[0].configs, "bench": small[0].bench.replace(peer_share=1.0)})
    bench_all = BenchStep().work(every_peer)
    # the speculative artifact is made on this share too (`speculative.left_out`): both price it
    assert speculative.runs(every_peer.bench) and speculative.runs(small[0].bench)
    assert bench_all - stage_work(small[0])["bench"] == pytest.approx(dropped * per_artifact)
    # the seconds `decide` and the estimate print are these works x their seconds per unit (+ the budgets' share):
    # training's the step time; a measuring step's those fitted for it x this machine's factor, not the step time
    units, m = unit_seconds(small[0], 0.5, 2.0), costs()["measuring_s"]
    assert units["train"] == 0.5 and units["quantize"] == pytest.approx(2.0 * m["default"]) == \
        unit_seconds(small[0], 0.25, 2.0)["quantize"]
    seconds = expected_seconds(stage_work(small[0]), stage_budgets(small[0]), units)
    assert seconds["quantize"] == pytest.approx(units["quantize"] * stage_work(small[0])["quantize"]
                                                + 0.35 * stage_budgets(small[0])["quantize"])
    assert seconds["train"] == pytest.approx(0.5 * stage_work(small[0])["train"])


def test_each_measuring_step_of_the_quickstart_is_priced_by_its_own_fitted_seconds():
    """The quickstart's measuring steps each at the seconds fitted from its own runs (prune row apart from depth,
    quantize of the dense model apart from the pruned one), scaled by the machine factor alone."""
    plan = make_plan("recipes/quickstart.toml")
    m = costs()["measuring_s"]
    units = unit_seconds(plan, 0.4, 1.0)
    measuring = [k for k in stage_work(plan) if k != "train"]
    assert measuring and all(units[k] == m["steps"][f"quickstart|{k}"] for k in measuring)
    assert units["prune row"] != units["prune depth"] and units["quantize train"] != units["quantize best-pruned"]
    assert unit_seconds(plan, 0.8, 1.5) == {**{k: 1.5 * v for k, v in units.items()}, "train": 0.8}


def test_the_weights_are_data_a_benchmarks_script_wrote():
    from effkit.stage import COSTS

    data = json.loads(COSTS.read_text())
    assert "benchmarks/stage_costs.py" in data["how"] and data["fitted_from"]
    assert {"train_setup", "prune_round", "quantize", "bench", "speed"} <= set(data)
    assert quantize.AUTO_DEFAULT in data["quantize"]["backends"] and data["speed"]["peers"]


def test_a_warm_cache_lowers_the_estimate_by_what_filling_it_cost(tmp_path, corpus_dir, monkeypatch):
    """The estimate prices the caches a step consults: those it consulted the last time this run ran here (recorded
    with what filling each cost, timed by the look-up itself), each looked up by its key now: warm, it adds nothing;
    cold, the recorded fill; a step never run here, the caches effkit/stage_costs.json lists for it, cold. eta.json
    says which was which and what each added."""
    from rich.console import Console

    from effkit.data.tokenizer import cache_dir
    from effkit.measure import machine_cache
    from effkit.pipeline import Eta, cache_fills, predicted_total, remember_caches, with_fills

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))  # its records stay out of other tests' estimates
    plan = make_plan(str(write_recipe(tmp_path, corpus_dir)))
    work = stage_work(plan)
    mine, other = [k for k in work if k != "train"][:2]
    # a machine on which `mine` costs 0.5 s per unit of its work (as training's step here)
    factor = 0.5 / unit_seconds(plan, 0.5, 1.0)[mine]
    monkeypatch.setattr("effkit.pipeline.machine_factor", lambda: {"factor": factor})
    clock, real = iter([10.0, 16.0]), time.perf_counter  # filling takes 6 s by this clock
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    mark = len(machine_cache.CONSULTED)
    assert machine_cache.machine_cached("test_fill", f"{tmp_path}", lambda: 42) == (42, False)
    monkeypatch.setattr("time.perf_counter", real)
    used = remember_caches(plan, mine, machine_cache.CONSULTED[mark:], 0.5)
    assert used == [{"cache": "test_fill", "key": f"{tmp_path}", "warm": False, "fill_s": 6.0, "fill_steps": 12.0}]

    warm = cache_fills(plan, work)
    assert [u["warm"] for u in warm[mine]] == [True] and with_fills(work, warm) == work
    (cache_dir() / "test_fill.json").unlink()  # the cache emptied (or aged out): the step fills it again
    cold = cache_fills(plan, work)
    assert [u["warm"] for u in cold[mine]] == [False]
    assert with_fills(work, cold) == {**work, mine: work[mine] + 12.0}
    timer = step_timer(plan)
    assert predicted_total(plan, timer, 4, 0.5, cold) - predicted_total(plan, timer, 4, 0.5, warm) == \
        pytest.approx(6.0)
    eta = Eta(plan, Console(file=__import__("io").StringIO()))
    eta.set_step_time(0.5, "a test")
    assert eta.first[mine] == pytest.approx(expected_seconds(work, stage_budgets(plan), 0.5)[mine] + 6.0)
    assert eta.record()["caches"][mine][0] | {"how": ""} == {
        "cache": "test_fill", "key": f"{tmp_path}", "warm": False, "fill_s": 6.0, "fill_steps": 12.0,
        "added_s": 6.0, "how": ""}

    monkeypatch.setitem(costs(), "step_caches", {f"tiny|{other}": ["never_filled"]})  # never run here: cold
    monkeypatch.setitem(costs(), "cache_fill", {"never_filled": 3.0})
    assert with_fills(work, cache_fills(plan, work))[other] == work[other] + 3.0


def test_the_fitted_seconds_hold_on_their_own_cpu_and_the_reference_scales_them_to_another(monkeypatch):
    """On the CPU the measuring seconds were fitted on, the factor is 1 whatever the reference timing reads (its
    spread between idle runs on one machine is wider than a CPU's difference); on another CPU, the timing's ratio."""
    from effkit import pipeline

    fitted = {"measuring_s": {"reference_s": 0.04, "cpu": "Some CPU|family 1 model 2|avx2"}}
    monkeypatch.setattr(pipeline, "costs", lambda: fitted)
    monkeypatch.setattr(pipeline, "reference_s", lambda: 0.05)
    for cpu, factor in (("Some CPU|family 1 model 2|avx2", 1.0), ("Some CPU|family 1 model 17|avx512f,avx2", 1.25)):
        monkeypatch.setattr("effkit.measure.hardware.cpu_identity", lambda cpu=cpu: cpu)
        pipeline.machine_factor.cache_clear()
        assert pipeline.machine_factor()["factor"] == pytest.approx(factor)
    pipeline.machine_factor.cache_clear()
