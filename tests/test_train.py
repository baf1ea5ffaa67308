import csv
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import assert_choice_from_samples, assert_ratio_from_samples

from effkit.errors import EffkitError
from effkit.train import Interrupted, train


def losses(report):
    path = Path(report["config"]["run"]["reports_dir"]) / report["run"] / "train_steps.csv"
    return [float(r["loss"]) for r in csv.DictReader(path.open())]


def test_same_config_gives_the_same_loss_curve(tiny_cfg, tmp_path):
    a = losses(train(tiny_cfg(run_name="a"), progress=False))
    b = losses(train(tiny_cfg(run_name="b"), progress=False))
    assert len(a) == 6
    assert a == b
    assert a[-1] < a[0]  # it learns


def test_report_artifact_and_latest(tiny_cfg, tmp_path):
    report = train(tiny_cfg(eval_interval=3), progress=False)
    rdir = tmp_path / "reports" / "t"
    for name in ("train.json", "summary.md", "summary.csv", "train_steps.csv", "train_loss.png"):
        assert (rdir / name).is_file(), name
    assert (rdir / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((rdir / "train.json").read_text())
    m = data["metrics"]
    assert math.isclose(m["perplexity"], math.exp(m["eval_loss"]), rel_tol=1e-9)
    assert m["train_tokens_per_s"] > 0 and m["params"] > 0 and m["size_bytes"] > 0
    assert len(m["peak_memory_bytes_per_rank"]) == 1
    assert data["what_ran"]["parallel"] == "none" and data["what_ran"]["world_size"] == 1
    assert {"eval_loss", "train_tokens_per_s", "mfu", "peak_memory"} <= set(data["protocol"])
    assert data["versions"]["torch"] == torch.__version__
    rows = list(csv.DictReader((rdir / "train_steps.csv").open()))
    assert rows[2]["eval_loss"] != "" and rows[-1]["eval_loss"] != ""
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / "runs" / "t").resolve()
    meta = json.loads((tmp_path / "runs" / "t" / "train" / "effkit.json").read_text())
    assert meta["stage"] == "train" and meta["config"]["model"]["name"] == "gpt2-nano"
    assert report["artifact"] == str(tmp_path / "runs" / "t" / "train")


def test_activation_checkpointing_gives_the_same_losses(tiny_cfg):
    plain = train(tiny_cfg(run_name="plain"), progress=False)
    ckpt = train(tiny_cfg(run_name="ckpt", activation_checkpointing=True), progress=False)
    assert ckpt["what_ran"]["activation_checkpointing"] is True
    assert plain["what_ran"]["activation_checkpointing"] is False
    assert losses(ckpt) == pytest.approx(losses(plain), rel=1e-5, abs=1e-6)


def gemm_peaks_not_timed(monkeypatch):
    """The CPU's GEMM peaks (for MFU, and the slowdown a forced bf16 is told of where bf16 is emulated) given, not
    timed: a 1024x1024 GEMM in emulated bf16 takes seconds, and what these tests check is not the peak."""
    from effkit.measure import roofline

    monkeypatch.setattr(roofline, "cpu_peak_flops", lambda dtype, **k: ({torch.float32: 1e11}.get(dtype, 5e9),
                                                                         "given GEMM peak"))


def test_bf16_autocast_trains_and_says_so(tiny_cfg, monkeypatch):
    gemm_peaks_not_timed(monkeypatch)
    report = train(tiny_cfg(run_name="bf16", amp=True, max_steps=3), progress=False)
    assert report["what_ran"]["amp_dtype"] == "bfloat16"
    assert all(math.isfinite(x) for x in losses(report))


def test_fp16_on_cpu_is_refused(tiny_cfg):
    with pytest.raises(EffkitError, match="fp16 autocast does nothing on CPU"):
        train(tiny_cfg(amp=True, amp_dtype="fp16"), progress=False)


def test_resume_after_interrupt_matches_uninterrupted_run(tiny_cfg):
    full = losses(train(tiny_cfg(run_name="full", grad_accum=2), progress=False))

    def stop_at_3(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="step 3"):
        train(tiny_cfg(run_name="cut", grad_accum=2), on_step=stop_at_3, progress=False)
    resumed = train(tiny_cfg(run_name="cut", resume=True), progress=False)
    assert resumed["what_ran"]["resumed_from_step"] == 3
    assert losses(resumed) == pytest.approx(full, rel=1e-6, abs=1e-7)


def _fake_timer(seconds: float):
    import itertools

    jitter = itertools.cycle([0.0, 0.01, -0.01, 0.005])
    return lambda: seconds * (1 + next(jitter))


@pytest.mark.parametrize("fp32_s, bf16_s, picked, verdict", [(1.0, 0.6, "bf16", "faster"),
                                                             (0.6, 1.0, "fp32", "slower"),
                                                             (1.0, 1.0, "fp32", "same")])
def test_amp_auto_picks_the_faster_precision_and_records_why(fp32_s, bf16_s, picked, verdict):
    from effkit.measure import precision

    out = precision.choose({"fp32": _fake_timer(fp32_s), "bf16": _fake_timer(bf16_s)})
    assert out["picked"] == picked and out["bf16_vs_fp32_time"]["verdict"] == verdict
    assert out["bf16_vs_fp32_time"]["ratio"] == pytest.approx(bf16_s / fp32_s, rel=0.05)
    assert out["fp32_step_s"] == pytest.approx(fp32_s, rel=0.05) and "interleaved" in out["how"]


def test_amp_probe_decides_by_an_interval_never_by_one_round():
    """#39 (7): one first round more than 2x apart decided alone, with no interval. Now a 20x slower bf16 is decided
    at the screen (3 rounds, its interval at 1 - 0.05/4), and a first round that looks 3x faster by chance does
    not pick bf16."""
    from effkit.measure import precision

    calls = {"fp32": 0, "bf16": 0}

    def timer(name, seconds):
        def once():
            calls[name] += 1
            return seconds * (1 + 0.01 * (calls[name] % 3))
        return once

    out = precision.choose({"fp32": timer("fp32", 0.1), "bf16": timer("bf16", 2.0)})
    r = out["bf16_vs_fp32_time"]
    assert out["picked"] == "fp32" and r["verdict"] == "slower" and r["rounds"] == 3
    assert r["ci_level"] == pytest.approx(1 - 0.05 / 4) and r["ci"][0] > 1
    # a warm-up and three sizing steps each; then three rounds of samples of at least 0.2 s (two 0.1 s fp32 steps)
    assert calls == {"fp32": 1 + 3 + 3 * 2, "bf16": 1 + 3 + 3}
    assert_choice_from_samples(out["choice"])
    lucky = iter([1.0, 0.3] + [1.0] * 200)  # bf16's warm-up, then one fast step by chance, then as fast as fp32
    out = precision.choose({"fp32": lambda: 1.0, "bf16": lambda: next(lucky)})
    assert out["picked"] == "fp32" and out["bf16_vs_fp32_time"]["verdict"] != "faster"


def test_amp_probe_is_cached_per_machine_and_model_shape(monkeypatch, tmp_path):
    from effkit.measure import hardware, precision
    from effkit.model import build_model

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    # a CPU with native bf16: on one without, the flags alone decide and nothing is measured or cached
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ["avx512_bf16", "avx512f", "avx2"])
    calls = []

    def measure():
        calls.append(1)
        return {"picked": "fp32", "bf16_vs_fp32_time": {"ratio": 2.0, "ci": [1.8, 2.2], "verdict": "slower"}}

    nano = build_model("gpt2-nano", vocab_size=512)
    first = precision.cpu_choice(nano, 4, 32, measure=measure)
    again = precision.cpu_choice(nano, 4, 32, measure=measure)
    assert (first["cached"], again["cached"], len(calls)) == (False, True, 1)
    assert again["picked"] == "fp32" and "cpu_flags" in again
    precision.cpu_choice(nano, 8, 32, measure=measure)  # another batch: another shape
    precision.cpu_choice(build_model("gpt2-mini", vocab_size=512), 4, 32, measure=measure)  # another model
    assert len(calls) == 3
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)  # the machine as training runs it: another thread count
    try:
        precision.cpu_choice(nano, 4, 32, measure=measure)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 4
    assert "L2-d64-h2" in first["key"] and "threads" in first["key"]


def test_amp_probe_trains_a_shallow_model_of_the_shape_not_copies_of_the_model(monkeypatch, tmp_path):
    """#47: the probe trained two private copies of the whole model (gpt2-large killed at 17.9 GB on 24 GiB); now
    a model of the same width, heads and vocabulary with at most PROBE_BLOCKS blocks, and only that is built."""
    from effkit.measure import hardware, precision
    from effkit.model.gpt2 import preset_config

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ["avx512_bf16", "avx512f", "avx2"])
    built = []

    def step_seconds(model, batch, block, dtype):
        built.append((model.config.n_layer, model.config.n_embd, model.config.vocab_size))
        return _fake_timer(1.0 if dtype is None else 0.6)

    monkeypatch.setattr(precision, "step_seconds", step_seconds)
    out = precision.cpu_choice(preset_config("gpt2-medium", vocab_size=512), 4, 32)
    assert built == [(precision.PROBE_BLOCKS, 1024, 512)] * 2 and out["picked"] == "bf16"
    assert f"{precision.PROBE_BLOCKS} of its 24 blocks" in out["probed"] and "L4-d1024" in out["key"]


@pytest.mark.slow
def test_default_training_precision_is_measured_and_reported(tiny_cfg, monkeypatch, tmp_path):
    from effkit.measure import hardware

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    # the probe's path, on any CPU (one without native bf16 is decided by its flags: tests/test_bf16_flags.py)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ["avx512_bf16", "avx512f", "avx2"])
    gemm_peaks_not_timed(monkeypatch)
    report = train(tiny_cfg(amp=None, max_steps=2), progress=False)
    w = report["what_ran"]
    assert w["amp_note"].startswith("auto: ")
    assert {"fp32": "fp32", "bf16": "bfloat16"}[w["amp_probe"]["picked"]] == w["amp_dtype"]
    assert_ratio_from_samples(w["amp_probe"]["bf16_vs_fp32_time"], w["amp_probe"]["samples"], "fp32", "bf16")
