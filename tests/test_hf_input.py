"""A plain Hugging Face GPT-2 folder (saved by transformers, no effkit.json) as the input of every stage that
compresses or measures a model: what post-training compression is for."""

import json
import sys
from pathlib import Path

import pytest
import torch

from effkit import cli
from effkit.config import BenchConfig, DataConfig, ExportConfig, PruneConfig, QuantizeConfig
from effkit.data import prepare


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, corpus_dir):
    folder = tmp_path_factory.mktemp("hf") / "my-gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = prepare(DataConfig(source=str(corpus_dir), vocab_size=512)).tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=2))
    model.save_pretrained(folder)  # plain transformers: Conv1D weights, no effkit.json
    tokenizer.save_pretrained(folder)
    assert not (folder / "effkit.json").exists()
    return folder


def dirs(tmp):
    return {"runs_dir": str(tmp / "runs"), "reports_dir": str(tmp / "reports")}


@pytest.mark.slow
def test_a_plain_hugging_face_folder_goes_through_every_stage(hf_folder, corpus_dir, tmp_path, capsys, monkeypatch):
    from effkit.bench import run_bench
    from effkit.export import run_export
    from effkit.prune.stage import run_prune
    from effkit.quantize.stage import run_quantize

    data = str(corpus_dir)
    pruned = run_prune(PruneConfig.from_flat(fixed_rounds=True,
                                             source=str(hf_folder), data=data, mode="row", target=0.5, rounds=1,
                                             finetune_steps=1, batch_size=4, latency_repeats=1, latency_rounds=2,
                                             control=False, **dirs(tmp_path)), progress=False)
    assert pruned["source"] == {"model": str(hf_folder), "data": data, "tokenizer": f"pretrained:{hf_folder}"}
    assert "not trained by effkit" in pruned["protocol"]["finetune_lr"]  # no schedule to continue: says so
    q = run_quantize(QuantizeConfig.from_flat(fixed_rounds=True,
                                              source=str(hf_folder), data=data, backend="dynamic", latency_rounds=2,
                                              latency_repeats=1, gen_tokens=4, batch_size=4, **dirs(tmp_path)))
    assert q["tag"] == "quantize-dynamic" and q["what_ran"]["source_model"] == str(hf_folder)
    assert q["what_ran"]["data"] == data and q["metrics"]["int8_layers_reloaded"] > 0
    e = run_export(ExportConfig.from_flat(fixed_rounds=True,
                                          source=str(hf_folder), data=data, latency_rounds=2, latency_repeats=1,
                                          gen_tokens=4, batch_size=4, **dirs(tmp_path)))
    assert e["tag"] == "onnx" and e["metrics"]["parity"]["greedy_tokens_equal"] > 0
    b = run_bench(BenchConfig.from_flat(fixed_rounds=True,
                                        paths=(str(hf_folder), q["artifact"]), data=data, rounds=2, repeats=1,
                                        gen_tokens=4, batch_size=4, **dirs(tmp_path)), progress=False)
    assert [r["stage"] for r in b["artifacts"]] == ["import", "quantize"]
    assert json.loads((Path(q["artifact"]) / "effkit.json").read_text())["parent"] == str(hf_folder)
    monkeypatch.setattr(sys, "argv", ["effkit", "generate", "--from", str(hf_folder), "--max-new-tokens", "3"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("The state of the Union")


@pytest.mark.parametrize("break_it, says", [
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                         "model_type": "llama"})), "effkit compresses GPT-2 models"),
    (lambda f: [p.unlink() for p in f.glob("tokenizer*")], "has no tokenizer"),
])
def test_a_folder_that_is_not_a_gpt2_with_its_tokenizer_is_refused(break_it, says, hf_folder, tmp_path, capsys,
                                                                     monkeypatch):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_folder, bad)
    break_it(bad)
    for command in ("quantize", "prune", "export", "bench", "generate"):
        args = ["effkit", command, bad] if command == "bench" else ["effkit", command, "--from", str(bad)]
        monkeypatch.setattr(sys, "argv", [*map(str, args), "--runs-dir", str(tmp_path / "runs")]
                            if command != "generate" else list(map(str, args)))
        with pytest.raises(SystemExit) as exc:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and says in err and len(err.splitlines()) == 1, (command, err)
    assert not (tmp_path / "runs").exists()  # nothing half-written
