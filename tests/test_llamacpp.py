"""llama.cpp (#44): a tiny trained model exports to one GGUF that plain llama.cpp (xllamacpp, no effkit) loads and
decodes with PyTorch's greedy tokens (f16), Q8_0 stays within effkit's int8 rule, a row-pruned model does too; Q4_0
stores a 256-wide head Q6_K by llama.cpp's own quantizer (Q8_0 otherwise, saying why); the engine and the backend
come through the registries only; the peer row is written, benched, and its ratios recompute from the samples; a
shape Q8_0 cannot store and a missing binding are one line each."""

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_ratio_from_samples, broken_copies, refused_in_one_line

from effkit import cli
from effkit.engines.llamacpp.runtime import llamacpp_unavailable
from effkit.errors import EffkitError

pytestmark = pytest.mark.skipif(llamacpp_unavailable() is not None, reason=f"not run: {llamacpp_unavailable()}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, train_tiny):
    """A tiny trained model (gpt2-nano: widths 64 and 256, head dim 32, all whole blocks of 32) exported by `effkit
    export --format gguf` (f16), with its report."""
    from effkit.config import ExportConfig
    from effkit.export import run_export

    tmp = tmp_path_factory.mktemp("llamacpp")
    artifact = train_tiny(tmp, "ll")
    cfg = ExportConfig.from_flat(fixed_rounds=True, source=artifact, format="gguf", latency_rounds=2,
                                 latency_repeats=1, gen_tokens=4, batch_size=4, runs_dir=str(tmp / "runs"),
                                 reports_dir=str(tmp / "reports"))
    return tmp, artifact, run_export(cfg)


def reference(artifact: str, prompt: torch.Tensor, new: int) -> list[list[int]]:
    from effkit.model import load_model

    with torch.no_grad():
        out = load_model(artifact).eval().generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                   use_cache=True, pad_token_id=0)
    return out[:, prompt.shape[1]:].tolist()


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    captured = capsys.readouterr()
    return exc.value.code, captured.err.strip(), captured.out


def test_gguf_export_loads_in_plain_llamacpp_and_decodes_pytorchs_greedy_tokens(exported):
    import gguf
    import xllamacpp
    from transformers import AutoTokenizer

    _, artifact, report = exported
    folder = Path(report["artifact"])
    assert report["tag"] == "gguf" and report["what_ran"]["precision"] == "f16"
    # every matrix of both blocks and the tied embedding; the position embedding f32, as llama.cpp's converter keeps it
    assert report["what_ran"]["weights"] == {"F16": 2 * 4 + 1, "F32": 1}
    parity = report["metrics"]["parity"]
    assert parity["greedy_tokens_equal"] == parity["stored_greedy_tokens_equal"] == 32  # the gate ran first
    assert parity["max_abs_logit_diff"] <= parity["max_abs_logit_diff_allowed"]
    # the file alone holds what llama.cpp needs: GPT-2's keys, the real MLP width, the BPE with its merges, and the
    # tokenizer's own end-of-text id
    fields = gguf.GGUFReader(str(folder / "model.gguf")).fields
    tok = AutoTokenizer.from_pretrained(artifact)

    def value(key):
        f = fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()[0]

    assert value("general.architecture") == "gpt2" and value("gpt2.feed_forward_length") == 256
    assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "gpt-2"
    assert len(fields["tokenizer.ggml.merges"].data) > 0
    assert value("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    # plain llama.cpp (xllamacpp's server, no effkit): a text prompt, tokenized by the GGUF's own tokenizer, decodes
    # PyTorch's greedy tokens of the same text
    p = xllamacpp.CommonParams()
    p.model.path = str(folder / "model.gguf")
    p.n_ctx, p.verbosity = 128, 0
    server = xllamacpp.Server(p)
    text = "The state of the Union"
    out = server.handle_completions({"prompt": text, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                                     "logprobs": 1})
    tokens = [t["id"] for t in out["choices"][0]["logprobs"]["content"]]
    assert tokens == reference(artifact, torch.tensor([tok(text).input_ids]), 20)[0]
    assert report["load_command"].startswith(f"llama-server -m {folder / 'model.gguf'} -t {torch.get_num_threads()}")
    assert "xllamacpp.Server(p)" in report["load_command"]
    # the held-out loss from llama.cpp's own hidden states: PyTorch's, to f16 rounding
    assert report["metrics"]["eval_loss"] == pytest.approx(report["metrics"]["parent_fp32"]["eval_loss"], rel=1e-3)


@pytest.mark.slow
def test_q8_0_and_q4_0_stay_within_effkits_int8_rule_and_load_through_the_registry(exported, capsys, monkeypatch):
    """`--type q8_0` on the command line; `quantize --backend gguf --gguf-type q4_0` through the backend registry.
    Both are measured against the parent like every int8 artifact: held-out loss within 1% (auto's budget)."""
    from effkit.artifacts.loader import engine_of, load_any, quantized_layers
    from effkit.config import QuantizeConfig
    from effkit.quantize.stage import AUTO_LOSS_BUDGET, run_quantize

    tmp, artifact, _ = exported
    dirs = ["--runs-dir", str(tmp / "runs"), "--reports-dir", str(tmp / "reports")]
    code, err, out = run_cli(["export", "--from", artifact, "--format", "gguf", "--type", "q8_0", "--fixed-rounds",
                              "--latency-rounds", "2", "--latency-repeats", "1", "--gen-tokens", "4", *dirs],
                             capsys, monkeypatch)
    assert code == 0, err
    folder = tmp / "runs" / "ll" / "gguf-q8_0"
    assert f"artifact: {folder}" in out and "load it: llama-server -m" in out
    report = json.loads((folder / "effkit.json").read_text())
    assert abs(report["metrics"]["eval_loss"] / report["metrics"]["parent_fp32"]["eval_loss"] - 1) < AUTO_LOSS_BUDGET
    assert report["metrics"]["int8_layers_reloaded"] == quantized_layers(folder, load_any(folder)) == 2 * 4 + 1
    q4 = run_quantize(QuantizeConfig.from_flat(fixed_rounds=True, source=artifact, backend="gguf", gguf_type="q4_0",
                                               latency_rounds=2, latency_repeats=1, gen_tokens=4, batch_size=4,
                                               runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports")))
    assert q4["tag"] == "quantize-gguf-q4_0" and engine_of(q4["artifact"]).name == "llamacpp"
    desc = json.loads((Path(q4["artifact"]) / "gguf.json").read_text())
    assert desc["weights"] == {"Q8_0": 1, "Q4_0": 2 * 4, "F32": 19}  # the tied head kept in Q8_0
    # gpt2-nano's n_embd (64) is no whole Q6_K super-block: llama-quantize's fallback, and why, in the record
    why = "not llama-quantize's Q6_K: n_embd 64 is not a multiple of 256"
    storage = json.loads((Path(q4["artifact"]) / "quantization.json").read_text())["storage"]
    assert why in desc["head"] and why in desc["quantizer"] and why in storage
    assert abs(q4["metrics"]["eval_loss"] / q4["metrics"]["parent_fp32"]["eval_loss"] - 1) < AUTO_LOSS_BUDGET


def test_a_row_pruned_model_exports_with_pytorchs_greedy_tokens(exported):
    """Row pruning to half the MLP width (128, whole blocks of 32): the GGUF says the real width (llama.cpp's own
    converter writes 4 x n_embd), decodes the pruned model's greedy tokens in f16 and keeps its loss in Q8_0."""
    from transformers import AutoTokenizer

    from effkit.artifacts import data_section
    from effkit.config import DataConfig, PruneConfig
    from effkit.data import prepare
    from effkit.engines import llamacpp as ll
    from effkit.engines.llamacpp import writer
    from effkit.engines.llamacpp.artifact import write_artifact
    from effkit.measure import evaluation
    from effkit.model import load_model
    from effkit.prune.stage import run_prune

    tmp, artifact, _ = exported
    pruned = run_prune(PruneConfig.from_flat(fixed_rounds=True, source=artifact, mode="row", target=0.5, rounds=1,
                                             finetune_steps=0, latency_repeats=1, latency_rounds=2, control=False,
                                             runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports")),
                       progress=False)["artifact"]
    model, tok = load_model(pruned).eval(), AutoTokenizer.from_pretrained(pruned)
    assert model.config.n_inner == 128
    for wtype in ("f16", "q8_0"):
        (folder := tmp / f"pruned-{wtype}").mkdir()
        desc = write_artifact(folder, model, tok, wtype)
        assert desc["parity"]["greedy_tokens_equal"] == 32
        gguf_model = ll.ENGINE.load(folder, torch.device("cpu"))
        prompt = torch.tensor([[5, 17, 42, 9, 100, 3, 77, 250], [1, 2, 3, 4, 5, 6, 7, 8]])
        if wtype == "f16":  # two rows decoded as parallel sequences of one request
            assert desc["parity"]["stored_greedy_tokens_equal"] == 32
            assert gguf_model.generate(prompt, 16, min_new_tokens=16)[:, 8:].tolist() == reference(pruned, prompt, 16)
        else:
            blocks = prepare(DataConfig.from_dict(data_section(Path(pruned))), tokenizer_from=pruned).blocks.eval
            ours, theirs = (evaluation.evaluate(m, blocks, 4)["eval_loss"] for m in (gguf_model, model))
            assert abs(ours / theirs - 1) < 0.01
        assert writer.tensor_types(folder / "model.gguf")[{"f16": "F16", "q8_0": "Q8_0"}[wtype]] == 2 * 4 + 1


def test_the_conv1d_layout_of_a_plain_hugging_face_gpt2_is_written_as_effkits_linear_one(tmp_path):
    """GGUF stores a matrix in nn.Linear's (out, in) numpy layout: a plain transformers GPT-2 (Conv1D, (in, out))
    gives the same arrays as effkit's Linear form of the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from effkit.engines.llamacpp.writer import tensors
    from effkit.model import load_model

    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=32, vocab_size=96)).eval()
    hf.save_pretrained(tmp_path)
    ours = {n: a for n, a, _ in tensors(load_model(str(tmp_path)))}
    theirs = {n: a for n, a, _ in tensors(hf)}
    assert ours.keys() == theirs.keys() and theirs["blk.0.ffn_up.weight"].shape == (256, 64)
    assert all((ours[n] == theirs[n]).all() for n in ours)


def test_engine_and_backend_come_through_the_registries_only(exported):
    from effkit import engines
    from effkit.artifacts.loader import engine_of
    from effkit.quantize import backends
    from effkit.registry import BACKENDS, ENGINES

    _, _, report = exported
    assert list(ENGINES.builtin)[-1] == "llamacpp" and list(BACKENDS.builtin)[-1] == "gguf"
    assert engine_of(report["artifact"]).name == "llamacpp" and "peer-llamacpp" in [e.peer_tag for e in engines.peers()]
    assert "gguf" in backends.names() and backends.unavailable("gguf") is None
    sys.path.insert(0, str(Path(__file__).parent))
    from test_architecture import import_graph

    package = "effkit.engines.llamacpp"  # its modules import one another
    importers = {m for m, edges in import_graph().items() if not (m == package or m.startswith(package + "."))
                 and any(e == package or e.startswith(package + ".") for e in edges)}
    assert importers == {"effkit.quantize.backends.gguf"}, importers  # the registry names it by its dotted path
    root = Path(__file__).parents[1] / "effkit"
    for path in root.rglob("*.py"):
        own = path.name == "gguf.py" or root / "engines" / "llamacpp" in path.parents  # the backend, the package
        if not own and path != root / "registry.py":
            text = path.read_text()
            assert '"llamacpp"' not in text and "engines.llamacpp" not in text, path


@pytest.mark.slow
def test_the_peer_row_is_written_benched_and_its_ratios_recompute_from_the_samples(exported):
    from effkit.bench import run_bench
    from effkit.bench.rows import peer_workloads
    from effkit.config import BenchConfig
    from effkit.engines.llamacpp import ENGINE

    tmp, artifact, _ = exported
    report = run_bench(BenchConfig.from_flat(paths=(artifact,), peers=True, peer_engines="llamacpp",
                                             fixed_rounds=True, quick=True, rounds=2, repeats=1, gen_tokens=8,
                                             batch_size=4,
                                             runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports")),
                       progress=False)
    rows = {r["tag"]: r for r in report["artifacts"]}
    assert set(rows) == {"train", "peer-llamacpp"} and rows["peer-llamacpp"]["stage"] == "peer"
    peer = rows["peer-llamacpp"]
    assert peer["decode_tokens_per_s_b1"] > 0 and peer["decode_tokens_per_s_b12"] > 0
    assert peer["generation"]["new_tokens"] == rows["train"]["generation"]["new_tokens"]
    for w in peer_workloads():
        assert_ratio_from_samples(rows["train"]["vs_peers"]["peer-llamacpp"][w.key], report["samples"][w.measure],
                                  "peer-llamacpp", "train", w.higher_is_better)
    # the peer says how it runs other than with llama.cpp's defaults: threads first
    assert "deviations from llama.cpp's defaults: -t / -tb" in ENGINE.peer_how
    assert abs(peer["eval_loss"] / rows["train"]["eval_loss"] - 1) < 0.01  # Q8_0 from the f16 values


def test_a_shape_q8_0_cannot_store_and_a_missing_binding_are_one_line(exported, tmp_path, capsys, monkeypatch):
    from effkit.bench import make_peers
    from effkit.model import load_model, save_model
    from effkit.prune.row import prune_mlp_channels

    tmp, artifact, _ = exported
    odd = tmp_path / "odd"
    shutil.copytree(artifact, odd)
    model = load_model(artifact)
    prune_mlp_channels(model, 100)  # an MLP width that is not a whole number of blocks of 32
    save_model(model, odd)
    capsys.readouterr()  # the loading above is not what is checked below
    dirs = ["--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "reports")]
    for args, says in ((["--from", str(odd), "--format", "gguf", "--type", "q8_0"],
                        "the MLP width n_inner is 100; export it as f16 (--type f16), or prune with widths rounded "
                        "to 32"),
                       (["--from", artifact, "--format", "gguf", "--type", "q5_k"], "unknown --type 'q5_k'"),
                       (["--from", artifact, "--format", "onnx", "--type", "q8_0"], "--type applies to --format gguf")):
        code, err, _ = run_cli(["export", *args, *dirs], capsys, monkeypatch)
        assert code == 2 and says in err and len(err.splitlines()) == 1, (args, err)
    from effkit.engines.llamacpp import artifact as gguf_artifact
    from effkit.engines.llamacpp import parity, writer

    write = writer.write_gguf

    def every_token_is_7(path, model, tokenizer, wtype, **kw):  # a wrong f16 file behind a right f32 conversion
        if wtype == "f16":
            model = copy.deepcopy(model)
            with torch.no_grad():
                model.transformer.ln_f.weight.zero_()
                model.transformer.ln_f.bias.copy_(1000 * model.transformer.wte.weight[7])
        return write(path, model, tokenizer, wtype, **kw)

    monkeypatch.setattr(gguf_artifact, "write_gguf", every_token_is_7)
    code, err, _ = run_cli(["export", "--from", artifact, "--format", "gguf", *dirs], capsys, monkeypatch)
    assert code == 2 and "cannot be stored in f16 faithfully" in err and len(err.splitlines()) == 1, err
    monkeypatch.setattr(gguf_artifact, "write_gguf", write)
    monkeypatch.setattr(parity, "GGUF_RTOL", -1.0)  # the f32 conversion's logits gate refuses
    code, err, _ = run_cli(["export", "--from", artifact, "--format", "gguf", *dirs], capsys, monkeypatch)
    assert code == 2 and "does not reproduce the model" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.gguf"))  # nothing written
    broken = tmp_path / "broken"  # a GGUF file llama.cpp cannot load: one line when it is first run
    shutil.copytree(tmp / "runs" / "ll" / "gguf", broken)
    (broken / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    code, err, _ = run_cli(["generate", "--from", str(broken), "--max-new-tokens", "2"], capsys, monkeypatch)
    assert code == 2 and "llama.cpp cannot load" in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # the binding no longer imports
    code, err, _ = run_cli(["export", "--from", artifact, "--format", "gguf", *dirs], capsys, monkeypatch)
    assert code == 2 and "--format gguf cannot run here" in err and "xllamacpp" in err and len(err.splitlines()) == 1
    made, not_run = make_peers(Path(artifact), tmp_path, ["llamacpp"])
    assert made == [] and not_run["peer-llamacpp"].startswith("not run: llama.cpp's bindings do not import")
    with pytest.raises(EffkitError, match="llama.cpp cannot run here"):
        from effkit.engines.llamacpp.runtime import LlamaCppCausalLM

        LlamaCppCausalLM.open(tmp / "runs" / "ll" / "gguf")


def test_a_broken_gguf_artifact_is_one_line_with_its_fix(exported, tmp_path, capsys, monkeypatch):
    """A GGUF file cut in half, or the tokenizer files gone (with them, the prompt of `effkit generate` became no
    tokens and llama.cpp decoded from nothing), through `effkit generate`: exit code 2, one line naming what is
    wrong and the fix, no traceback, nothing written. A prompt of no tokens is refused before a server starts."""
    from effkit.engines.llamacpp.runtime import LlamaCppCausalLM

    folder = Path(exported[2]["artifact"])
    broken = broken_copies(folder, tmp_path, "model.gguf")
    err = refused_in_one_line(["generate", "--from", str(broken["cut"]), "--max-new-tokens", "2"], capsys,
                              monkeypatch, tmp_path)
    assert f"llama.cpp cannot load {broken['cut'] / 'model.gguf'}: " in err, err
    assert err.endswith("write it again (effkit export --format gguf)"), err
    err = refused_in_one_line(["generate", "--from", str(broken["untokenized"]), "--max-new-tokens", "2"], capsys,
                              monkeypatch, tmp_path)
    assert f"{broken['untokenized']} has no tokenizer files (tokenizer.json, or vocab.json" in err, err
    model = LlamaCppCausalLM.open(folder)
    with pytest.raises(EffkitError, match="the prompt has no tokens"):
        model.generate(torch.zeros((1, 0), dtype=torch.long), 2)
    assert model._servers == {}


def test_q6_k_by_llamacpps_quantizer_round_trips_through_gguf_py(monkeypatch):
    """llama.cpp's own Q6_K quantizer (ggml_quantize_chunk in xllamacpp's library) on a 512-wide matrix: the bytes
    gguf-py dequantizes come back within 2% of the largest value (6 bits a value), closer than Q4_0; a width that
    is no whole super-block of 256, or a quantizer that cannot be reached, stores the head Q8_0 and says why."""
    import gguf
    import numpy as np

    from effkit.engines.llamacpp import q6k as ll

    Q = gguf.GGMLQuantizationType
    x = (np.random.default_rng(0).standard_normal((96, 512)) * 0.05).astype(np.float32)
    x[3] *= 40  # a row on another scale: every row and block has its own scales
    data = ll.quantize_q6_k(x)
    assert data.dtype == np.uint8 and data.shape == (96, 2 * 210)
    back = gguf.quants.dequantize(data, Q.Q6_K).reshape(x.shape)
    # every row within 2% of its own largest value
    assert (np.abs(back - x).max(axis=1) <= 0.02 * np.abs(x).max(axis=1)).all()
    q4 = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0).reshape(x.shape)
    assert np.sqrt(((back - x) ** 2).mean()) < 0.3 * np.sqrt(((q4 - x) ** 2).mean())
    assert ll.head_storage(256, "q4_0")[0] == "Q6_K" and "llama.cpp's own quantizer" in ll.head_storage(256, "q4_0")[1]
    assert ll.head_storage(256, "q8_0") == (None, "") == ll.head_storage(768, "f16")
    kind, why = ll.head_storage(96, "q4_0")
    assert kind == "Q8_0" and "n_embd 96 is not a multiple of 256" in why
    monkeypatch.setattr(ll, "_GGML", {})
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # the library cannot be found: Q8_0, and why
    kind, why = ll.head_storage(256, "q4_0")
    assert kind == "Q8_0" and "xllamacpp's library) cannot be reached (ModuleNotFoundError" in why
    with pytest.raises(EffkitError, match="cannot store Q6_K"):
        ll.quantize_q6_k(x)


def test_a_256_wide_q4_0_file_stores_its_head_in_q6_k_and_llamacpp_decodes_it(exported, tmp_path, capsys,
                                                                              monkeypatch):
    """A random 256-wide GPT-2 written as q4_0: the tied embedding / LM head is Q6_K in the file (an untied head
    too), llama.cpp loads and decodes it, and its own log-probabilities (its Q6_K kernel) equal effkit's loss path
    (llama.cpp's hidden states x the head as gguf-py dequantizes it); the Q8_0 fallback is larger and says why."""
    import gguf
    import numpy as np
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from effkit.engines.llamacpp import q6k, runtime, writer

    _, artifact, _ = exported
    tok = AutoTokenizer.from_pretrained(artifact)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=64, vocab_size=512,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(config).eval()
    capsys.readouterr()
    path = tmp_path / "q6_k.gguf"
    assert writer.write_gguf(path, model, tok, "q4_0") == {"Q6_K": 1, "Q4_0": 2 * 4, "F32": 19}
    assert capsys.readouterr().err == ""  # no fallback to say
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert stored["token_embd.weight"] == "Q6_K" and "output.weight" not in stored
    m = runtime.LlamaCppCausalLM(path, config, threads=2)
    wte = model.transformer.wte.weight.detach().numpy()
    assert np.abs(m.head() - wte).max() <= 0.02 * np.abs(wte).max()
    prompt = [[5, 17, 42, 9, 100, 3, 77, 250]]
    r = m.complete(prompt, 1, {**runtime.greedy_body(), "logprobs": 5})
    theirs = r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    ours = torch.log_softmax(m(torch.tensor(prompt)).logits[0, -1], -1)
    assert len(theirs) == 5 and max(abs(t["logprob"] - float(ours[t["id"]])) for t in theirs) < 1e-2
    assert theirs[0]["id"] == int(ours.argmax())
    new = m.generate(torch.tensor(prompt), 8, min_new_tokens=8)[0, 8:].tolist()
    assert len(new) == 8 and new[0] == theirs[0]["id"]
    del m
    # untied: llama.cpp reads its own output.weight, stored Q6_K as well
    untied = GPT2LMHeadModel(GPT2Config(**{**config.to_dict(), "tie_word_embeddings": False})).eval()
    assert writer.write_gguf(tmp_path / "untied.gguf", untied, tok, "q4_0") == {"Q6_K": 2, "Q4_0": 2 * 4, "F32": 19}
    assert runtime.LlamaCppCausalLM(tmp_path / "untied.gguf", untied.config, threads=2).generate(
        torch.tensor(prompt), 4, min_new_tokens=4).shape == (1, 12)
    # llama.cpp's quantizer unreachable: Q8_0, one line on stderr saying why, and a larger file
    monkeypatch.setattr(q6k, "_GGML", {"why": "llama.cpp's quantizer cannot be reached (a test)"})
    assert writer.write_gguf(tmp_path / "q8_0.gguf", model, tok, "q4_0") == {"Q8_0": 1, "Q4_0": 2 * 4, "F32": 19}
    err = capsys.readouterr().err.strip()
    assert err.startswith("effkit: note: the tied embedding / LM head in Q8_0") and "(a test)" in err
    assert len(err.splitlines()) == 1
    assert (tmp_path / "q8_0.gguf").stat().st_size - path.stat().st_size == 512 * (256 // 32 * 34 - 210)
