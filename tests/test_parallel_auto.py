"""`effkit train --parallel auto`: the layouts enumerated, planned and ranked; one that does not fit is never priced
nor timed; the ranking's inputs (the runtime probe, the collectives) measured once per machine and recorded; the
pipeline's bubble; `--simulate` on paper; one process: nothing to choose."""

import json
import sys
from dataclasses import replace

import pytest

from effkit import cli
from effkit.errors import EffkitError
from effkit.parallel import auto, machine


def nano(tiny_cfg, **kw):
    return tiny_cfg(parallel="auto", **kw)


def test_the_bubble_is_the_pipelines_idle_share():
    assert auto.bubble_fraction(1, 8) == 0
    assert auto.bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert auto.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    from transformers import GPT2Config

    mc = GPT2Config(n_embd=64, n_layer=4, n_head=2, vocab_size=512, n_positions=64)
    hw = auto.simulated_hardware("a100-nvlink")
    for m in (2, 4, 8):
        busy, bubble = auto.pipeline_seconds([1.0, 1.0], m)  # equal stages
        assert bubble / (busy + bubble) == pytest.approx(auto.bubble_fraction(2, m))
        t = auto.predict_step(auto.Layout("pp", 1, 1, 2, "1f1b", m), mc, 32, 16, 1, hw, False)
        assert 0 < t["bubble_s"] / t["step_s"] < auto.bubble_fraction(2, m)  # the first stage holds no head
    assert auto.predict_step(auto.Layout("ddp", 2), mc, 32, 16, 1, hw, False)["bubble_s"] == 0


def test_a_ring_link_fitted_to_its_own_timings_is_found_again():
    link = auto.Link(50e-6, 2e9)
    for kind in machine.KINDS:
        points = [[b, link.seconds(kind, b, 4)] for b in (1e3, 1e5, 1e7)]
        fitted = machine._fit(points, kind, 4)
        assert fitted.latency_s == pytest.approx(link.latency_s, rel=1e-6)
        assert fitted.bandwidth == pytest.approx(link.bandwidth, rel=1e-6)
    assert link.seconds("all_reduce", 1e6, 1) == 0


def test_layouts_effkit_cannot_run_are_said_with_why():
    layouts, skipped = auto.enumerate_layouts(4, n_head=2, n_layer=2, global_batch=8)
    modes = {lay.mode for lay in layouts}
    assert {"ddp", "fsdp", "fsdp+tp", "pp+fsdp"} <= modes and "tp" not in modes and "pp" not in modes
    assert any("tp 4 does not divide the 2 heads" in s for s in skipped)
    assert any("4 stages for 2 blocks" in s for s in skipped)
    assert all(lay.microbatches >= lay.pp for lay in layouts if lay.pp > 1)


def test_a_layout_that_does_not_fit_is_never_priced_nor_timed(tiny_cfg, monkeypatch):
    cfg = nano(tiny_cfg, nproc=4)
    big = auto.rank(cfg, "a100-nvlink")
    sizes = sorted(r["per_rank_bytes"] for r in big["layouts"])
    assert sizes[0] < sizes[-1]
    # a device whose usable memory lies between the smallest rank's plan and the largest's
    memory_gib = (sizes[0] + sizes[-1]) / 2 / 0.9 / 2**30
    priced = []
    real = auto.predict_step
    monkeypatch.setattr(auto, "predict_step", lambda layout, *a: priced.append(layout) or real(layout, *a))
    desc = json.dumps({"preset": "a100-nvlink", "memory_gib": memory_gib})
    ranking = auto.rank(cfg.with_flat(simulate=desc), desc)
    fits = [r for r in ranking["layouts"] if r["fits"]]
    out = [r for r in ranking["layouts"] if not r["fits"]]
    assert fits and out
    assert all(r["per_rank_bytes"] > r["usable_bytes"] and "step_s" not in r for r in out)
    assert len(priced) == len(fits)
    assert ranking["layouts"][: len(fits)] == fits  # the fitting ones first, by predicted step
    assert [r["step_s"] for r in fits] == sorted(r["step_s"] for r in fits)
    # nothing fits: nothing is trained, one line
    tiny = json.dumps({"preset": "a100-nvlink", "memory_gib": 1e-6})
    rank = auto.rank
    monkeypatch.setattr(auto, "rank", lambda c, s="": rank(c, tiny))
    priced.clear()
    with pytest.raises(EffkitError, match="no layout of 4 processes fits"):
        auto.choose(cfg, plan=False)
    assert priced == []


def test_the_rankings_inputs_are_measured_once_per_machine_and_recorded(tiny_cfg, monkeypatch, tmp_path):
    import effkit.child
    from effkit.measure.machine_cache import machine_id

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(effkit.child, "run_isolated", lambda *a, **k: pytest.fail("the probe runs in the ranks"))
    probes, timings, blocks = [], [], []

    def measuring(world, threads, probe, meanwhile, layers):
        meanwhile()  # the simulations, made while the ranks start
        timings.append(world)
        probes.append(probe)
        blocks.append(layers)
        link = auto.Link(1e-4, 1e9)
        return {"probe": {"bytes": 50 * 2**20, "step_s": 0.1, "step2_s": None},
                "probe2": {"bytes": None, "step_s": 0.15, "step2_s": None},
                "collectives": {k: [[b, link.seconds(k, b, world)] for b in (1e4, 1e6, 1e7)] for k in machine.KINDS},
                "optimizer": {"param_s": 1e-9, "dtensor_s": 1e-3, "dtensor_param_s": 2e-9},
                "layers": {"plain_s": 0.02, "plain2_s": 0.03, "local_s": 0.015, "tp_s": 0.05, "fsdp_s": 0.04,
                           "step_s": 0.1, "alone_s": 0.08}}

    monkeypatch.setattr(machine, "launch_measuring", measuring)
    cfg = nano(tiny_cfg, nproc=2)
    first = auto.rank(cfg)
    second = auto.rank(cfg)
    # the probe and the collectives measured in one launch, once
    assert len(probes) == 1 and probes[0]["threads"] == 1 and timings == [2]
    assert probes[0]["batch"] == auto.PROBE_BATCH and probes[0]["rounds"] == auto.PROBE_ROUNDS
    assert probes[0]["min_s"] == auto.PROBE_MIN_S > 0 and "in turns" in first["hardware"]["how"]["compute"]
    assert probes[0]["blocks"] == 1  # the whole model is the one-block step and, per block more, a block's pass
    from effkit.memplan import _model_config, step_flops

    mc, hw = _model_config(cfg), first["hardware"]
    more = (mc.n_layer - 1) * 1e-9 * auto._block_params(mc)  # the further blocks' optimizer steps
    one, two = 0.1 + (mc.n_layer - 1) * 0.02 + more, 0.15 + (mc.n_layer - 1) * 0.03 + more
    tokens = auto.PROBE_BATCH * cfg.data.block_size
    assert hw["peak_flops"] == pytest.approx(step_flops(mc, mc.n_layer, tokens, cfg.data.block_size) / (two - one))
    assert hw["fixed_s"] + hw["optimizer_s"] == pytest.approx((one + two) / 2 - 1.5 * (two - one))
    how = second["hardware"]["how"]
    assert "measured now" in first["hardware"]["how"]["collectives"]
    assert f"machine {machine_id()}" in how["collectives"] and "cached" in how["collectives"]
    assert "GFLOP/s per rank" in how["compute"] and "cached" in how["compute"]
    # the block timed plain, tensor-parallel and sharded at the probe's batch, recorded and cached with the rest
    assert blocks[0]["batch"] == auto.PROBE_BATCH and blocks[0]["model_config"]["n_layer"] == 1
    assert "tensor-parallel 50.0 ms" in how["layouts' blocks"] and "cached" in how["layouts' blocks"]
    assert 0 < second["hardware"]["tp_block_s"] < 0.05 - 0.02 / 2
    assert 0 < second["hardware"]["fsdp_unit_s"] < 0.04 - 0.02
    assert second["hardware"]["dtensor_param_s"] == 2e-9 and "ns more per element" in how["collectives"]
    assert second["hardware"]["solo_speedup"] == pytest.approx(0.1 / 0.08) and "1.25x" in how["layouts' blocks"]
    assert not second["simulated"] and second["layouts"][0]["fits"]
    cache = json.loads((tmp_path / "cache" / f"{machine.COLLECTIVES}.json").read_text())
    assert all(machine_id() in key for key in cache)
    # with the probe cached (another shape's collectives too), the collectives alone are measured
    (tmp_path / "cache" / f"{machine.COLLECTIVES}.json").unlink()
    auto.rank(cfg)
    assert timings == [2, 2] and probes[1] is None


def test_steps_timed_in_turns_reach_a_time_floor_each_as_every_process_agrees_and_keep_their_median():
    """The probe's models and the layouts' blocks: warm-up calls discarded, then rounds in turns in which a short
    step runs as many times as its calls take to reach the floor, a long one once; the median resists outliers."""
    from effkit.measure.timing import medians_in_turns

    calls, order = {"short": 0, "long": 0}, []

    def timer(name: str, seconds: float):
        def once() -> float:
            calls[name] += 1
            order.append(name)
            return 5.0 if calls[name] == 3 else seconds  # one preempted call among the short one's
        return once

    agreed = []
    timed = medians_in_turns({"short": timer("short", 1 / 64), "long": timer("long", 0.5)}, 4, 2.0,
                             agree=lambda c: agreed.append(c) or [c[0], c[1] + 1])
    assert agreed == [[32, 1]]  # 2 s over 4 rounds: 32 calls of 1/64 s a round, one of 0.5 s
    assert calls == {"short": 1 + 4 * 32, "long": 1 + 4 * 2}  # a warm-up call each; what `agree` returned
    assert timed == {"short": 1 / 64, "long": 0.5}
    assert order[2:34] == ["short"] * 32 and order[34:38] == ["long"] * 4 and order[38] == "short"  # in turns
    assert medians_in_turns({"a": lambda: 0.2}, 3) == {"a": 0.2}  # no floor: one call a round


def test_the_simulate_preset_path_ranks_on_paper(tiny_cfg, monkeypatch, capsys):
    import effkit.child

    monkeypatch.setattr(effkit.child, "run_isolated", lambda *a, **k: pytest.fail("a simulation runs nothing"))
    monkeypatch.setattr(machine, "launch_measuring", lambda *a: pytest.fail("a simulation times nothing"))
    r = auto.rank(nano(tiny_cfg, nproc=8, simulate="h100-nvlink"), "h100-nvlink")
    assert r["simulated"] and r["world"] == 8 and r["hardware"]["name"] == "h100-nvlink"
    assert r["hardware"]["memory_bytes"] == 80 * 2**30 and all(x["fits"] for x in r["layouts"])
    over = auto.simulated_hardware('{"preset": "a100-nvlink", "inter_gbps": 50, "name": "mine"}')
    assert over.name == "mine" and over.inter["all"].bandwidth == 50e9 and over.peak_flops == 312e12
    for bad, needle in (("b200-nvlink", "neither a preset"), ('{"peak_tflops": 1}', "lacks"),
                        ('{"preset": "a100-nvlink", "speed": 3}', "unknown keys"),
                        ('{"preset": "a100-nvlink", "efficiency": -1}', "positive")):
        with pytest.raises(EffkitError, match=needle):
            auto.simulated_hardware(bad)
    with pytest.raises(EffkitError, match="trains nothing"):
        auto.choose(nano(tiny_cfg, simulate="a100-nvlink"), plan=False)


def test_auto_with_one_process_says_there_is_nothing_to_choose(tiny_cfg, monkeypatch, capsys):
    monkeypatch.setattr(auto, "rank", lambda *a: pytest.fail("nothing to rank"))
    cfg, ranking = auto.choose(nano(tiny_cfg, nproc=1), plan=False)
    assert ranking is None and cfg.parallel.mode == "none" and not cfg.parallel.launched
    assert capsys.readouterr().out.strip().splitlines() == [
        "--parallel auto: one process, nothing to choose; training in this process"]


def test_the_cli_prints_a_simulated_ranking_one_line_per_layout(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["effkit", "train", "--parallel", "auto", "--plan", "--simulate", "a100-nvlink",
                                      "--nproc", "2", "--model", "gpt2-nano", "--vocab-size", "512", "--block-size",
                                      "32", "--batch-size", "4", "--max-steps", "1"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None), out
    assert "SIMULATION on paper for a100-nvlink" in out
    lines = [line for line in out.splitlines() if "--parallel " in line]
    assert len(lines) == len({"ddp", "fsdp", "tp"}) + 2 * 3  # pp: gpipe and 1f1b, 2, 4 and 8 micro-batches
    assert " 1. " in out and "step " in out and "fits" in out


def test_the_trial_times_only_fitting_layouts_in_paired_rounds_and_keeps_prediction_beside_measurement(
        tiny_cfg, monkeypatch, capsys):
    cfg = nano(tiny_cfg, nproc=4, simulate="")
    desc = json.dumps({"preset": "a100-nvlink", "memory_gib": 80})
    rank = auto.rank
    monkeypatch.setattr(auto, "rank", lambda c, s="": rank(c, desc))
    ranked = rank(cfg, desc)["layouts"]
    second = ranked[1]["layout"]  # predicted second, measured fastest: the measurement decides
    timed = []

    def time_steps(c):
        layout = next(r["layout"] for r in ranked if auto._layout_of(r).config(cfg, 16).parallel == c.parallel
                      and auto._layout_of(r).config(cfg, 16).optim.batch_size == c.optim.batch_size)
        timed.append(layout)
        assert c.optim.max_steps == cfg.parallel.auto_steps
        warmup = [9.0, 5.0]  # the optimizer's state built, then DDP's buckets rebuilt: not in the sample
        return warmup + [1.0 + 0.01 * i if layout == second else 2.0 + 0.01 * i for i in range(4)]

    cfg = cfg.with_flat(auto_top=3)
    chosen, ranking = auto.choose(cfg, plan=False, time_steps=lambda cs: [time_steps(c) for c in cs])
    top = ranking["layouts"][:3]
    assert sorted(timed) == sorted([r["layout"] for r in top] * auto.TRIAL_ROUNDS)
    assert all(r["fits"] for r in ranking["layouts"] if r["layout"] in timed)
    assert ranking["chosen"]["layout"] == second and "decided" in ranking["chosen"]["why"]
    assert chosen.parallel.mode == auto._layout_of(ranked[1]).mode and chosen.parallel.mode != "auto"
    for r in top:
        assert r["measured_step_s"] in (pytest.approx(1.015), pytest.approx(2.015))
        assert r["predicted_over_measured"] == pytest.approx(r["step_s"] / r["measured_step_s"])
    assert "--parallel auto: " + second in capsys.readouterr().out


@pytest.mark.slow
def test_auto_measures_this_machine_in_launched_processes_then_trains_with_the_winner(tmp_path, corpus_dir,
                                                                                      monkeypatch, capsys):
    """This machine's collectives and runtime probe timed in launched processes (while the simulations run here),
    then `effkit train --parallel auto` ranking on them (cached per machine), timing the best two layouts and
    training with the winner."""
    from effkit import cli
    from effkit.config import TrainConfig

    monkeypatch.setenv("EFFKIT_REMEASURE", "1")  # measured here even where the session's cache has them
    flags = dict(model="gpt2-nano", data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=4, batch_size=4,
                 max_steps=2, parallel="auto", nproc=2, auto_top=2, auto_steps=3, eval_interval=0,
                 checkpoint_interval=0)
    started, measured = [], []
    launch = machine.launch_measuring

    def spy(world, threads, probe, meanwhile, layers):
        measured.append(launch(world, threads, probe, lambda: started.append(meanwhile()), layers))
        return measured[-1]

    monkeypatch.setattr(machine, "launch_measuring", spy)
    auto.rank(TrainConfig.from_flat(**flags, run_name="auto", runs_dir=str(tmp_path / "runs"),
                                    reports_dir=str(tmp_path / "reports")))
    assert len(started) == 1 and len(measured) == 1
    timed = measured[0]["collectives"]
    assert set(timed) == set(machine.KINDS)
    assert all(len(v) == len(machine.SIZES) and all(s > 0 for _, s in v) for v in timed.values())
    probe = measured[0]["probe"]
    assert probe["bytes"] > 0 and probe["step_s"] > 0 and probe["step2_s"] is None  # measured (no timing asserts)
    assert measured[0]["probe2"]["step_s"] > 0 and measured[0]["optimizer"]["param_s"] > 0
    assert measured[0]["optimizer"]["dtensor_param_s"] >= 0
    assert all(measured[0]["layers"][k] > 0 for k in ("plain_s", "plain2_s", "local_s", "tp_s", "fsdp_s", "step_s",
                                                      "alone_s"))

    monkeypatch.delenv("EFFKIT_REMEASURE")  # the launch below ranks on what was just measured and cached
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    args += ["--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "reports"), "--run-name", "auto"]
    monkeypatch.setattr(sys, "argv", ["effkit", "train", *args])  # the command, in this process
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code in (0, None), capsys.readouterr().err[-3000:]
    report = json.loads((tmp_path / "reports" / "auto" / "train.json").read_text())
    choice = report["parallel_auto"]
    assert choice["chosen"]["layout"].startswith(report["config"]["parallel"]["mode"] + ":")
    timed = [r for r in choice["layouts"] if "measured_step_s" in r]
    assert len(timed) == 2 and all(r["fits"] and r["predicted_over_measured"] > 0 for r in timed)


def _hardware(**kw):
    link = auto.Link(1e-5, 1e9)
    return auto.Hardware("test", 8, 2**40, kw.pop("peak", 1e12), 1.0, {"all": link}, {"all": link}, **kw)


def _gpt(**kw):
    from transformers import GPT2Config

    return GPT2Config(**{"n_embd": 64, "n_layer": 4, "n_head": 2, "vocab_size": 512, "n_positions": 64, **kw})


def test_a_pipeline_works_at_its_busiest_stage_and_waits_on_the_lighter_one_once_per_micro_batch():
    from effkit.memplan import step_flops

    mc, hw = _gpt(), _hardware()
    head = step_flops(mc, 0, 16 * 32, 32)
    two_blocks = step_flops(mc, 2, 16 * 32, 32) - head
    for m in (2, 4, 8):
        t = auto.predict_step(auto.Layout("pp", 1, 1, 2, "gpipe", m), mc, 32, 16, 1, hw, False)
        assert t["compute_s"] == pytest.approx((two_blocks + head) / 1e12)  # the last stage holds the head
        assert t["bubble_s"] == pytest.approx(two_blocks / 1e12 / m)  # the first stage's, once per micro-batch
    # the tied head's gradient is summed with the embedding's once per step
    untied = auto.predict_step(auto.Layout("pp", 1, 1, 2, "gpipe", 2), _gpt(tie_word_embeddings=False), 32, 16, 1,
                               hw, False)
    tied = auto.predict_step(auto.Layout("pp", 1, 1, 2, "gpipe", 2), mc, 32, 16, 1, hw, False)
    assert tied["comm_s"] - untied["comm_s"] == pytest.approx(hw.link("all_reduce", False).seconds(
        "all_reduce", 4 * mc.vocab_size * mc.n_embd, 2))


def test_ddp_hides_the_buckets_the_blocks_fill_behind_their_backward_but_not_the_last():
    mc = _gpt(n_embd=256, n_layer=12, vocab_size=8192)
    buckets = auto.ddp_buckets(mc)
    assert sum(buckets) == 4 * (auto._vocab_params(mc) + mc.n_layer * auto._block_params(mc))
    assert buckets[0] >= auto.DDP_BUCKET_BYTES[0] and len(buckets) > 2
    assert buckets[-1] >= 4 * mc.vocab_size * mc.n_embd  # the token embedding, tied to the head, is in the last
    link = auto.Link(1e-5, 1e9)
    cost = [link.seconds("all_reduce", b, 2) for b in buckets]
    slow = auto.predict_step(auto.Layout("ddp", 2), mc, 32, 16, 1, _hardware(peak=1e9), False)  # a long backward
    assert slow["comm_s"] == pytest.approx(cost[-1])
    fast = auto.predict_step(auto.Layout("ddp", 2), mc, 32, 16, 1, _hardware(peak=1e18), False)  # none to hide in
    assert fast["comm_s"] == pytest.approx(sum(cost), rel=1e-3)
    # ranks with no core to spare for the backend's threads: the long backward hides nothing
    busy = auto.predict_step(auto.Layout("ddp", 2), mc, 32, 16, 1, _hardware(peak=1e9, overlaps=False), False)
    assert busy["comm_s"] == pytest.approx(sum(cost)) and busy["compute_s"] == slow["compute_s"]


def test_ddp_hides_its_all_reduces_on_this_machine_only_with_a_core_to_spare_per_rank(tiny_cfg, monkeypatch,
                                                                                      tmp_path):
    import os

    from effkit.memplan import _model_config

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    link = auto.Link(1e-4, 1e9)
    measured = {"probe": {"bytes": 50 * 2**20, "step_s": 0.1, "step2_s": None},
                "probe2": {"bytes": None, "step_s": 0.15, "step2_s": None},
                "collectives": {k: [[b, link.seconds(k, b, 2)] for b in (1e4, 1e6, 1e7)] for k in machine.KINDS},
                "optimizer": {"param_s": 1e-9, "dtensor_s": 1e-3, "dtensor_param_s": 2e-9},
                "layers": {"plain_s": 0.02, "plain2_s": 0.03, "local_s": 0.015, "tp_s": 0.05, "fsdp_s": 0.04,
                           "step_s": 0.1, "alone_s": 0.08}}
    monkeypatch.setattr(machine, "launch_measuring", lambda world, threads, probe, meanwhile, layers: measured)
    for cores, threads, overlaps in ((2, 0, False), (8, 0, False), (8, 1, True), (4, 2, False), (5, 2, True)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        cfg = nano(tiny_cfg, nproc=2, threads=threads)
        hw, _ = machine.this_machine(cfg, _model_config(cfg), 2)
        assert hw.overlaps is overlaps, (cores, threads)
        assert ("a core to spare" if overlaps else "none to spare") in hw.how["collectives"]


def test_a_pipelines_fill_and_drain_go_at_the_pace_of_a_rank_alone_and_nothing_else_does():
    mc, together = _gpt(), _hardware(fixed_s=0.1, optimizer_s=0.05)
    alone = replace(together, solo_speedup=1.25)
    for m in (2, 4):  # 2 stages: the busiest stage's first micro-batch and the bubble while the other rank waits
        layout = auto.Layout("pp", 1, 1, 2, "1f1b", m)
        t, s = (auto.predict_step(layout, mc, 32, 16, 1, hw, False) for hw in (together, alone))
        busy = t["compute_s"] - 0.05 * (auto._vocab_params(mc) + 2 * auto._block_params(mc)) / (
            auto._vocab_params(mc) + mc.n_layer * auto._block_params(mc))  # the optimizer's share: once, together
        assert s["bubble_s"] == pytest.approx(t["bubble_s"] / 1.25)
        assert t["compute_s"] - s["compute_s"] == pytest.approx(busy / m * (1 - 1 / 1.25))
    for layout in (auto.Layout("ddp", 2), auto.Layout("fsdp", 2), auto.Layout("tp", 1, 2)):  # every rank at once
        assert auto.predict_step(layout, mc, 32, 16, 1, alone, False) == auto.predict_step(layout, mc, 32, 16, 1,
                                                                                            together, False)


def test_the_fixed_seconds_are_paid_per_micro_batch_the_optimizers_per_step_and_dtensors_per_parameter():
    mc = _gpt()
    hw = _hardware(peak=1e30, fixed_s=0.1, optimizer_s=0.05, dtensor_s=0.001)  # no work that grows with the batch
    whole = auto._vocab_params(mc) + mc.n_layer * auto._block_params(mc)
    half = (auto._vocab_params(mc) + 2 * auto._block_params(mc)) / whole  # a stage's parameters: two blocks
    for m in (2, 4):
        t = auto.predict_step(auto.Layout("pp", 1, 1, 2, "1f1b", m), mc, 32, 16, 1, hw, False)
        assert t["compute_s"] == pytest.approx(m * 0.1 * half + 0.05 * half)
        assert t["bubble_s"] == pytest.approx(0.1 * half)
    fsdp = auto.predict_step(auto.Layout("fsdp", 2), mc, 32, 16, 1, hw, False)
    assert fsdp["compute_s"] == pytest.approx(0.1 + 0.05 / 2 + 0.001 * (12 * 4 + 4))
    tp = auto.predict_step(auto.Layout("tp", 1, 2), mc, 32, 16, 1, hw, False)
    assert tp["compute_s"] == pytest.approx(0.15 * half + 0.001 * 8 * 4)  # half the blocks' parameters: two blocks'
    assert auto.predict_step(auto.Layout("ddp", 2), mc, 32, 16, 1, hw, False)["compute_s"] == pytest.approx(0.15)


def test_a_tensor_parallel_block_and_a_sharded_unit_add_their_measured_cost_per_micro_batch():
    mc, base = _gpt(), dict(peak=1e12, fixed_s=0.1, optimizer_s=0.05, dtensor_s=0.001)
    plain, extra = _hardware(**base), _hardware(**base, tp_block_s=0.002, fsdp_unit_s=0.003)
    for m in (1, 2):  # gradient accumulation: micro-batches of the same step
        tp = [auto.predict_step(auto.Layout("tp", 1, 2), mc, 32, 16, m, hw, False) for hw in (plain, extra)]
        assert tp[1]["compute_s"] - tp[0]["compute_s"] == pytest.approx(0.002 * mc.n_layer * m)
        assert tp[1]["comm_s"] == tp[0]["comm_s"]
        fsdp = [auto.predict_step(auto.Layout("fsdp", 2), mc, 32, 16, m, hw, False) for hw in (plain, extra)]
        assert fsdp[1]["comm_s"] - fsdp[0]["comm_s"] == pytest.approx(0.003 * (mc.n_layer + 1) * m)  # and the root
        assert fsdp[1]["compute_s"] == fsdp[0]["compute_s"]
    foreach = _hardware(**base, dtensor_param_s=1e-9)  # AdamW's foreach kernels on DTensors, per element
    whole = auto._vocab_params(mc) + mc.n_layer * auto._block_params(mc)
    tp = [auto.predict_step(auto.Layout("tp", 1, 2), mc, 32, 16, 1, hw, False) for hw in (plain, foreach)]
    assert tp[1]["compute_s"] - tp[0]["compute_s"] == pytest.approx(1e-9 * mc.n_layer * auto._block_params(mc) / 2)
    fsdp = [auto.predict_step(auto.Layout("fsdp", 2), mc, 32, 16, 1, hw, False) for hw in (plain, foreach)]
    assert fsdp[1]["compute_s"] - fsdp[0]["compute_s"] == pytest.approx(1e-9 * whole / 2)  # its shard
    for layout in (auto.Layout("ddp", 2), auto.Layout("pp", 1, 1, 2, "gpipe", 2)):  # neither a DTensor nor a shard
        for hw in (extra, foreach):
            assert auto.predict_step(layout, mc, 32, 16, 1, hw, False) == auto.predict_step(layout, mc, 32, 16, 1,
                                                                                             plain, False)
