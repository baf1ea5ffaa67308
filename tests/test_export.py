"""ONNX export, ONNX Runtime int8, and int8 artifacts that load outside effkit."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from effkit import cli, metrics
from effkit.config import BenchConfig, ExportConfig, PruneConfig, QuantizeConfig, TrainConfig
from effkit.data import prepare
from effkit.model import load_model
from effkit.onnx_export import OnnxCausalLM, onnx_unavailable
from effkit.prune.stage import run_prune
from effkit.quantize import backend_available, int8_layer_count, load_quantized, run_quantize
from effkit.train import train

pytestmark = pytest.mark.skipif(onnx_unavailable() is not None, reason=f"not run: {onnx_unavailable()}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("export")
    cfg = TrainConfig.from_flat(model="gpt2-nano", data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=4,
                                batch_size=4, max_steps=6, warmup_steps=1, eval_interval=0, checkpoint_interval=0,
                                runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"), run_name="x", lr=3e-3,
                                amp=False)
    report = train(cfg, progress=False)
    return tmp, report["artifact"], prepare(cfg.data).blocks.eval


def ecfg(tmp, source, **kw):
    return ExportConfig(**{"source": source, "latency_rounds": 2, "latency_repeats": 1, "gen_tokens": 4,
                           "batch_size": 4, "runs_dir": str(tmp / "runs"), "reports_dir": str(tmp / "reports"), **kw})


def logits_of(model, blocks):
    with torch.no_grad():
        return model(blocks).logits


def test_onnx_fp32_export_gives_pytorch_logits(trained):
    tmp, artifact, blocks = trained
    report = run_export_cfg(ecfg(tmp, artifact))
    assert report["tag"] == "onnx" and report["stage"] == "export"
    onnx_model = OnnxCausalLM(report["artifact"])
    diff = (logits_of(onnx_model, blocks) - logits_of(load_model(artifact).eval(), blocks)).abs().max()
    assert diff <= 1e-4
    import onnx  # attention exported causal: one ONNX Attention per layer, no mask materialised and applied
    ops = [n.op_type for n in onnx.load(str(Path(report["artifact"]) / "model.onnx")).graph.node]
    assert ops.count("Attention") == onnx_model.config.n_layer and "Where" not in ops
    assert report["metrics"]["eval_loss"] == pytest.approx(report["metrics"]["parent_fp32"]["eval_loss"], abs=1e-4)
    assert json.loads((Path(report["artifact"]) / "effkit.json").read_text())["parent"] == artifact


def run_export_cfg(cfg):
    from effkit.export import run_export

    return run_export(cfg)


def test_onnx_int8_reloads_from_its_folder_alone_and_generates(trained, tmp_path, capsys, monkeypatch):
    tmp, artifact, blocks = trained
    report = run_export_cfg(ecfg(tmp, artifact, int8=True))
    assert report["tag"] == "onnx-int8"
    moved = tmp_path / "shipped"
    shutil.copytree(report["artifact"], moved)  # the folder alone, elsewhere
    model = OnnxCausalLM(moved)
    assert int8_layer_count(model) > 0
    assert model.description["int8"]["MatMulInteger"] >= 2 * 4 + 1  # every Linear of both blocks, and the head
    assert model.description["token_embedding"].startswith("read from the int8 LM head")  # stored once
    parent = metrics.evaluate(load_model(artifact).eval(), blocks, 4)["eval_loss"]
    assert abs(metrics.evaluate(model, blocks, 4)["eval_loss"] / parent - 1) < 0.02
    monkeypatch.setattr(sys, "argv", ["effkit", "generate", "--from", str(moved), "--max-new-tokens", "5"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("The state of the Union") and len(out) > len("The state of the Union")


def test_a_row_pruned_artifact_exports_and_quantizes_to_onnx_int8(trained):
    tmp, artifact, blocks = trained
    pruned = run_prune(PruneConfig(source=artifact, mode="row", target=0.5, rounds=1, finetune_steps=0,
                                   latency_repeats=1, latency_rounds=2, control=False, runs_dir=str(tmp / "runs"),
                                   reports_dir=str(tmp / "reports")), progress=False)
    report = run_export_cfg(ecfg(tmp, pruned["artifact"], int8=True, fuse=True))
    assert report["tag"] == "prune-row-r1+onnx-int8"
    assert report["what_ran"]["fused_operators"].get("FastGelu", 0) > 0  # --fuse: ORT's fusions ran
    model = OnnxCausalLM(report["artifact"])
    assert model.config.n_inner == 128 and int8_layer_count(model) > 0
    assert abs(report["metrics"]["eval_loss"] / report["metrics"]["parent_fp32"]["eval_loss"] - 1) < 0.02


@pytest.mark.skipif(backend_available("bnb") is not None, reason=f"not run: {backend_available('bnb')}")
def test_bnb_artifact_loads_with_plain_from_pretrained(trained):
    from transformers import AutoModelForCausalLM

    tmp, artifact, blocks = trained
    report = run_quantize(QuantizeConfig(source=artifact, backend="bnb", latency_rounds=2, latency_repeats=1,
                                         gen_tokens=4, batch_size=4, runs_dir=str(tmp / "runs"),
                                         reports_dir=str(tmp / "reports")))
    plain = AutoModelForCausalLM.from_pretrained(report["artifact"]).eval()  # no effkit involved
    assert int8_layer_count(plain) == report["metrics"]["int8_layers_reloaded"] == 2 * 4
    assert torch.equal(logits_of(plain, blocks), logits_of(load_quantized(report["artifact"]), blocks))
    assert json.loads((Path(report["artifact"]) / "config.json").read_text())["quantization_config"]["load_in_8bit"]


def test_bench_measures_onnx_artifacts_beside_pytorch_ones(trained):
    from effkit.bench import run_bench

    tmp, artifact, _ = trained
    onnx8 = tmp / "runs" / "x" / "onnx-int8"
    if not onnx8.is_dir():
        run_export_cfg(ecfg(tmp, artifact, int8=True))
    report = run_bench(BenchConfig(paths=(artifact, str(onnx8)), rounds=2, repeats=1, gen_tokens=4, batch_size=4,
                                   compile=True, runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports")),
                       progress=False)
    dense, row = report["artifacts"]
    assert row["tag"] == "onnx-int8" and row["stage"] == "export" and row["params"] > 0
    assert "recomputes the whole prefix" in row["generation"]["note"]
    assert str(row["train_tokens_per_s_b12"]).startswith("not run")
    assert row["latency_ratio_b12"]["verdict"] in ("faster", "slower", "same")
    # --compile: the PyTorch artifact's compiled twin was timed in the same rounds; the ONNX one says why not
    assert dense["compiled"]["ratio_vs_eager_b12"]["verdict"] in ("faster", "slower", "same")
    assert dense["compiled"]["latency_b12"]["samples"] == 2
    assert row["compiled"]["status"].startswith("not run: an ONNX Runtime artifact")
    # and its compiled decoding (static KV cache) was timed in the generation rounds
    assert dense["compiled"]["generation_ratio_vs_eager"]["verdict"] in ("faster", "slower", "same")
    assert dense["compiled"]["generation_tokens_per_s"] > 0
    assert row["compiled"]["generation_status"].startswith("not run: an ONNX Runtime artifact")
    assert "Compiled (torch.compile" in (tmp / "reports" / "x" / "bench.md").read_text()


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    return exc.value.code, capsys.readouterr().err.strip()


def test_bad_export_input(trained, capsys, monkeypatch):
    import effkit.onnx_export

    tmp, artifact, _ = trained
    onnx8 = tmp / "runs" / "x" / "onnx-int8"
    if not onnx8.is_dir():
        run_export_cfg(ecfg(tmp, artifact, int8=True))
    dirs = ["--runs-dir", str(tmp / "runs"), "--reports-dir", str(tmp / "reports")]
    for args, says in ((["quantize", "--from", str(onnx8)], "is an ONNX artifact"),
                       (["prune", "--from", str(onnx8)], "is an ONNX artifact"),
                       (["train", "--model", str(onnx8), "--max-steps", "1"], "is an ONNX artifact"),
                       (["export", "--from", str(onnx8)], "export a dense or pruned PyTorch artifact"),
                       (["export", "--from", artifact, "--format", "tflite"], "unknown --format 'tflite'")):
        code, err = run_cli([*args, *dirs], capsys, monkeypatch)
        assert code == 2 and says in err and len(err.splitlines()) == 1, (args, err)
    from effkit.quantize import cannot_run_on

    assert "CPU only" in cannot_run_on(onnx8, torch.device("cuda"))  # bench leaves it out on a GPU, saying why
    assert cannot_run_on(onnx8, torch.device("cpu")) is None
    before = sorted(p.name for p in (tmp / "runs" / "x").iterdir())

    def unrepresentable(*args, **kwargs):
        raise RuntimeError("Unsupported: aten::weird_op\nlong exporter trace ...")

    monkeypatch.setattr(torch.onnx, "export", unrepresentable)  # a model the exporter cannot represent
    code, err = run_cli(["export", "--from", artifact, "--int8", *dirs], capsys, monkeypatch)
    assert code == 2 and "ONNX cannot represent this model" in err and len(err.splitlines()) == 1, err
    monkeypatch.setattr(effkit.onnx_export, "onnx_unavailable", lambda: "ModuleNotFoundError: onnxruntime")
    code, err = run_cli(["export", "--from", artifact, *dirs], capsys, monkeypatch)
    assert code == 2 and "onnxruntime" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in (tmp / "runs" / "x").iterdir()) == before  # nothing half-written
