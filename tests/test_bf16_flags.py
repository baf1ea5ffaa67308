"""Issue 42 (7): a CPU whose flags show no native bf16 (AVX2 only: no AVX-512, no VNNI, no bf16) is told so by its
flags, not by a probe: `--amp auto` takes fp32 with nothing timed, a forced `--amp` is announced before the first
step with the slowdown to expect, MFU is over the peaks of the dtypes the CPU runs natively (never over 100%), and
quantize and export neither time nor evaluate the parent under bf16 autocast there. Every test fakes the flags
(`hardware.cpu_flags`): the machine-cached figures are keyed by them (`machine_cache.machine_id`), so nothing
measured on the real CPU answers for the fake one."""

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from effkit import artifacts, cli, console, engines
from effkit.config import DataConfig, QuantizeConfig
from effkit.data import prepare
from effkit.engines import Engine
from effkit.measure import compare, evaluation, hardware, precision, roofline, timing
from effkit.model import build_model, load_model
from effkit.train import Trainer, train

AVX2_ONLY = ["avx2"]


@pytest.fixture
def avx2_only(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: list(AVX2_ONLY))


def fake_peaks(monkeypatch, fp32: float, bf16: float) -> list[torch.dtype]:
    """The machine's GEMM peaks set to these FLOP/s (nothing timed); returns the dtypes asked for, in order."""
    asked: list[torch.dtype] = []

    def peak(dtype, n=1024, repeats=10):
        asked.append(dtype)
        return {torch.float32: fp32, torch.bfloat16: bf16}[dtype], f"fake {dtype} GEMM peak"

    monkeypatch.setattr(roofline, "cpu_peak_flops", peak)
    return asked


def no_probe(*args, **kwargs):
    raise AssertionError("the bf16 probe ran on a CPU whose flags rule bf16 out")


def test_amp_auto_takes_fp32_from_the_flags_without_a_probe(avx2_only, tiny_cfg, monkeypatch):
    monkeypatch.setattr(precision, "choose", no_probe)
    monkeypatch.setattr(precision, "step_seconds", no_probe)
    # the launcher's path (train_in_processes) asks cpu_choice directly: no measurement either
    direct = precision.cpu_choice(build_model("gpt2-nano", vocab_size=512), 4, 32, measure=no_probe)
    assert direct["picked"] == "fp32" and direct["probe_seconds"] == 0
    report = train(tiny_cfg(amp=None, max_steps=2), progress=False)
    w = report["what_ran"]
    assert w["amp_dtype"] == "fp32"
    assert "bf16 not run: this CPU has no native bf16 (flags: avx2" in w["amp_note"]
    assert w["amp_probe"]["not_run"].startswith("bf16 not run: this CPU has no native bf16 (flags: avx2")
    assert "samples" not in w["amp_probe"] and w["amp_probe"]["probe_seconds"] == 0


def test_forced_amp_on_emulated_bf16_is_announced_before_the_first_step(avx2_only, tiny_cfg, monkeypatch, capsys):
    fake_peaks(monkeypatch, fp32=100e9, bf16=5e9)
    seen_before_first_step: list[str] = []
    step = Trainer.train_step

    def first_step_reads_the_console(self):
        if not seen_before_first_step:
            seen_before_first_step.append(capsys.readouterr().out)
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", first_step_reads_the_console)
    report = train(tiny_cfg(amp=True, max_steps=2), progress=False)
    assert report["what_ran"]["amp_dtype"] == "bfloat16"  # honoured
    before = seen_before_first_step[0]
    assert "this CPU has no native bf16 (flags: avx2" in before
    assert "20.0x slower than fp32" in before and "GEMM peak ratio" in before  # 100 / 5 GFLOP/s
    assert "--no-amp" in before
    assert before.count("warning: --amp forces bf16") == 1
    assert "warning: --amp" not in capsys.readouterr().out  # said once, before the work, not again after
    assert any("20.0x slower than fp32" in v for v in report["verdicts"])


def test_mfu_is_over_the_native_peak_and_never_over_100_percent(avx2_only, tiny_cfg, monkeypatch, capsys):
    fake_peaks(monkeypatch, fp32=1e12, bf16=1e3)  # an emulated bf16 GEMM peak far below the run's FLOP/s
    report = train(tiny_cfg(run_name="bf16", amp=True, max_steps=2), progress=False)
    m = report["metrics"]
    assert m["peak_flops"] == 1e12 and 0 < m["mfu"] <= 1  # over the fp32 peak, though the run was bf16
    assert "(fp32)" in report["protocol"]["mfu"]
    assert "bf16 not counted: this CPU has no native bf16" in report["protocol"]["mfu"]

    fake_peaks(monkeypatch, fp32=1e3, bf16=1e3)  # a peak below what the run achieved: a wrong measurement
    report = train(tiny_cfg(run_name="low", amp=False, max_steps=2), progress=False)
    m = report["metrics"]
    assert m["mfu"] is None and "MFU not reported" in m["mfu_invalid"]
    assert any("MFU not reported" in v for v in report["verdicts"])
    console.show_train(report)
    out = capsys.readouterr().out
    assert "invalid" in out and not [p for p in re.findall(r"([\d,.]+)%", out) if float(p.replace(",", "")) > 100]


def test_mfu_peak_is_the_best_over_the_dtypes_the_cpu_runs_natively(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ["avx512_bf16", "avx512f", "avx2"])
    fake_peaks(monkeypatch, fp32=1e12, bf16=3e12)
    peak, how = roofline.peak_flops(torch.device("cpu"), torch.float32)  # an fp32 run on a native-bf16 CPU
    assert peak == 3e12 and "fp32 and bf16" in how


def test_quantize_neither_times_nor_evaluates_bf16_without_native_bf16(avx2_only, train_tiny, tmp_path,
                                                                     monkeypatch, capsys):
    artifact = train_tiny(tmp_path, "qb")
    autocast: list[torch.dtype] = []
    evaluate, forward_timer = evaluation.evaluate, timing.forward_timer

    def evaluate_spy(model, blocks, batch_size, amp_dtype=None, **kw):
        autocast.append(amp_dtype)
        return evaluate(model, blocks, batch_size, amp_dtype, **kw)

    def timer_spy(model, batch, block, amp_dtype=None, **kw):
        autocast.append(amp_dtype)
        return forward_timer(model, batch, block, amp_dtype, **kw)

    monkeypatch.setattr(evaluation, "evaluate", evaluate_spy)
    monkeypatch.setattr(timing, "forward_timer", timer_spy)
    monkeypatch.setattr(sys, "argv", ["effkit", "quantize", "--from", artifact, "--backend", "dynamic",
                                      "--fixed-rounds", "--latency-rounds", "2", "--latency-repeats", "1",
                                      "--gen-tokens", "4", "--batch-size", "4", "--runs-dir", str(tmp_path / "runs"),
                                      "--reports-dir", str(tmp_path / "reports")])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert autocast and torch.bfloat16 not in autocast  # neither evaluated nor timed under bf16 autocast
    report = json.loads((tmp_path / "reports" / "qb" / "quantize-dynamic.json").read_text())
    m = report["metrics"]
    assert m["bf16_autocast"].startswith("not run: this CPU has no native bf16 (flags: avx2")
    assert not [k for k in m if "bf16" in k and k != "bf16_autocast"]
    assert "bf16" not in m["samples"]["b12"]
    assert any(v.startswith("bf16 autocast: not run: this CPU has no native bf16") for v in report["verdicts"])
    assert "note: bf16 autocast: not run" in out and "parent bf16" not in out


class _OwnDecoder(Engine):
    """An engine whose artifacts decode at a fixed rate through its own decoder (no model runs)."""

    name = "own-decoder"
    marker = "own-decoder.json"
    label = "OwnDecoder"

    def __init__(self):
        self.asked: list[tuple[int, int]] = []

    def available(self, device=None, path=None, **options):
        return None

    def load(self, path, device):
        raise AssertionError("not loaded here")

    def decode(self, model, tokenizer, batch, new_tokens, generate_kwargs=None, prompts=None):
        self.asked.append((batch, new_tokens))
        rates = itertools.cycle([1000.0, 1010.0, 990.0])
        return lambda: next(rates)


def test_a_model_is_timed_with_its_own_engines_decoder(avx2_only, train_tiny, tmp_path):
    """The bench times an artifact with its engine's decoder (`engine_of(path).decode`); quantize and export
    report the tokens/s of the same decoder."""
    source = train_tiny(tmp_path, "gen")
    prepared = prepare(DataConfig.from_dict(artifacts.data_section(Path(source))), tokenizer_from=source)
    blocks, docs, tokenizer = prepared.blocks.eval, prepared.blocks.eval_docs, prepared.tokenizer
    parent = load_model(source).eval()
    folder = tmp_path / "own"
    folder.mkdir()
    (folder / _OwnDecoder.marker).write_text("{}")
    engine = engines.register(_OwnDecoder())
    try:
        results = {}
        for name in ("fp32", "q"):
            r = evaluation.evaluate(parent, blocks, 4, docs=docs)
            r["generation"] = compare.generate_sample(parent, tokenizer, 4)
            r["size_bytes"] = 1
            results[name] = r
        measure = QuantizeConfig.from_flat(fixed_rounds=True, latency_rounds=2, latency_repeats=1).measure
        m, _, protocol = compare.compare_with_parent(measure, torch.device("cpu"), parent, parent, tokenizer, 32,
                                                     results["fp32"], None, results["q"], "own", artifact=folder)
    finally:
        engines.unregister(engine.name)
    assert engine.asked == [(1, 4)]
    assert m["generation"]["tokens_per_s"] == pytest.approx(1000.0, rel=0.02)
    assert m["samples"]["generation"]["int8"][0] in ([1000.0], [1010.0], [990.0])
    assert "OwnDecoder" in protocol["generation"]


@pytest.mark.parametrize("flags", [AVX2_ONLY, ["avx2", "avx512f", "avx512_bf16"]])
def test_the_amp_probe_times_bf16_only_where_the_flags_allow_it(flags, monkeypatch):
    """Both answers of the code that decides (`hardware.no_native_bf16`), whatever CPU runs the suite: the report's
    amp probe holds timings only where bf16 is native, and says why nothing was timed elsewhere."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: list(flags))
    timed = {"picked": "fp32", "fp32_step_s": 1.0, "bf16_step_s": 2.0, "how": "fake timings"}
    out = precision.cpu_choice(build_model("gpt2-nano", vocab_size=512), 4, 32, measure=lambda: dict(timed))
    if reason := hardware.no_native_bf16():
        assert out["not_run"] == f"bf16 not run: {reason}" and "fp32_step_s" not in out
    else:
        assert out["fp32_step_s"] == 1.0 and out["how"] == "fake timings" and "not_run" not in out
