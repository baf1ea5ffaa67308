"""OpenVINO: the export loads in plain OpenVINO and decodes PyTorch's greedy tokens; the backend and the engine come
through the registries; what an artifact was measured with travels where plain OpenVINO reads it; the inference
precision and the attention backend are chosen by the decision rule (or said not run), their raw samples kept; the
decoder timed and sampled is the one its users run, checked against effkit's loop; the peer says how it deviates
from the defaults, or is not run."""

import json
import math
import random
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    assert_choice_from_samples,
    assert_ratio_from_samples,
    broken_copies,
    independent_ratio,
    refused_in_one_line,
)

from effkit.engines.openvino.settings import ov_unavailable
from effkit.errors import EffkitError

pytestmark = [pytest.mark.skipif(ov_unavailable() is not None, reason=f"not run: {ov_unavailable()}"),
              pytest.mark.slow]  # every test shares the module's exported model (an export and a compile)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, train_tiny):
    """A tiny trained model exported by `effkit export --format openvino` (fp32 weights, the plug-in's own
    inference precision, pinned), with its report."""
    from effkit.config import ExportConfig
    from effkit.export import run_export

    tmp = tmp_path_factory.mktemp("openvino")
    artifact = train_tiny(tmp, "ov")
    cfg = ExportConfig.from_flat(fixed_rounds=True, source=artifact, format="openvino", latency_rounds=2,
                                 latency_repeats=1, gen_tokens=4, batch_size=4, runs_dir=str(tmp / "runs"),
                                 reports_dir=str(tmp / "reports"))
    return artifact, run_export(cfg)


def _reference(artifact: str, prompt: torch.Tensor, new: int) -> list[int]:
    from effkit.model import load_model

    with torch.no_grad():
        out = load_model(artifact).eval().generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                   use_cache=True, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _line(folder: Path, props: dict) -> str:
    return f"openvino_genai.LLMPipeline('{folder}', 'CPU'" + "".join(f", {k}={v!r}" for k, v in props.items()) + ")"


def test_export_loads_in_plain_openvino_and_decodes_pytorchs_greedy_tokens(exported):
    import openvino as ov
    import openvino_genai

    artifact, report = exported
    folder = Path(report["artifact"])
    desc = json.loads((folder / "openvino.json").read_text())
    assert report["tag"] == "openvino" and report["what_ran"]["format"] == "openvino"
    assert report["metrics"]["parity"]["greedy_tokens_equal"] > 0  # the gate ran before anything was written
    # the plug-in's own precision, pinned to what it picked on the machine that measured it; the attention backend
    # chosen when written; both, and the threads, in the load line (the model file cannot carry them)
    props = desc["load_properties"]
    assert props == {"INFERENCE_PRECISION_HINT": desc["inference_precision"],
                     "INFERENCE_NUM_THREADS": desc["threads"], "ATTENTION_BACKEND": desc["attention"]}
    assert desc["inference_precision"] == ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    assert report["load_command"] == _line(folder, props)
    prompt = torch.tensor([[5, 17, 42, 9, 100, 3, 77, 250]])
    new = 20
    ref = _reference(artifact, prompt, new)
    # plain OpenVINO (no effkit): the stateful graph optimum-intel's users run, a ten-line greedy loop, f32 compute
    compiled = ov.Core().compile_model(str(folder / "openvino_model.xml"), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    assert {p.get_any_name() for p in compiled.inputs} == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    req, ids, done, tokens = compiled.create_infer_request(), prompt.numpy(), 0, []
    for _ in range(new):
        n = ids.shape[1]
        req.infer({"input_ids": ids, "attention_mask": np.ones((1, done + n), np.int64),
                   "position_ids": np.arange(done, done + n)[None], "beam_idx": np.zeros(1, np.int32)})
        done, ids = done + n, req.get_tensor("logits").data[:, -1:].argmax(-1).astype(np.int64)
        tokens.append(int(ids[0, 0]))
    assert tokens == ref
    # and OpenVINO GenAI's LLMPipeline, as its users load the folder (its tokenizer models are in it)
    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = new
    cfg.ignore_eos = True
    ids = prompt.numpy()
    out = pipe.generate(openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
    assert list(out.tokens[0]) == ref
    assert report["metrics"]["eval_loss"] == pytest.approx(report["metrics"]["parent_fp32"]["eval_loss"], rel=0.01)


def test_backend_and_engine_come_through_the_registries(exported):
    from effkit import engines
    from effkit.artifacts.loader import engine_of, load_any
    from effkit.quantize import backends

    _, report = exported
    assert "openvino" in backends.names() and "openvino" in engines.names()
    assert engine_of(report["artifact"]).name == "openvino"
    assert "peer-openvino" in [e.peer_tag for e in engines.peers()]
    model = load_any(report["artifact"])
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)
    # effkit's own OpenVINO artifacts keep their KV cache in f16 (the CPU plug-in's u8 default broke greedy decoding
    # of a pruned model): stored in the model, so plain OpenVINO compiles it so too
    assert model.kv_cache_precision == "f16"
    # no engine or backend module is named in code outside its own module and the registry
    root = Path(__file__).parents[1] / "effkit"
    for path in root.rglob("*.py"):
        own = path.name == "openvino.py" or root / "engines" / "openvino" in path.parents  # the backend, the package
        if not own and path != root / "registry.py":
            text = path.read_text()
            assert '== "openvino"' not in text and "engines.openvino" not in text, path


def _stand_in_timer(rates: dict):
    """In place of `engines.openvino.tune.pipeline_timer`: new tokens/s around `rates[(inference precision, attention
    backend)]` with 2% seeded noise and no time spent, so that the choices do not hang on this machine's timings."""

    def make(model, ids, new_tokens, attention):
        rng = random.Random(zlib.crc32(f"{model.inference_precision}|{attention}|{ids[0].shape[0]}".encode()))
        base = rates[(model.inference_precision, attention or "PA")]

        def once() -> float:
            return base * math.exp(rng.gauss(0.0, 0.02))
        once.settle_s = 0.0
        return once
    return make


def _assert_pick_recomputes(decision: dict) -> None:
    """A recorded choice recomputed from its raw samples with numpy and scipy: each ratio to the pick as recorded,
    the pick the best paired point estimate unless a tie went to the preferred one, every other contender decided
    slower where the pick says decided."""
    samples, picked, higher = decision["samples"], decision["picked"], decision["higher_is_better"]
    assert set(samples) == {picked, *decision["ratios"]}
    for other, reported in decision["ratios"].items():
        assert_ratio_from_samples(reported, samples, picked, other, higher)
        ratio, _, verdict = independent_ratio(samples[picked], samples[other], decision["record"]["level"], higher)
        if decision["verdict"] != "tie":  # a tie may go to one a little behind by its point estimate
            assert (ratio < 1) if higher else (ratio > 1), (other, ratio)
        if decision["verdict"] == "decided":
            assert verdict == "slower", (other, verdict)
    assert_choice_from_samples(decision)


def test_quantize_records_what_it_measured_where_plain_openvino_reads_it(exported, tmp_path, monkeypatch):
    """#42 (2) and the decisions: int8 weights; f32 timed faster than bf16 and SDPA than PA (a stand-in timer);
    both choices keep their raw samples, and the picks recompute from them; plain OpenVINO runs the folder with the
    settings measured: the KV cache's from the model file, the inference precision (which the CPU plug-in ignores in
    rt_info, where it is kept as a record) and the threads from the load line, which also names the backend."""
    import openvino as ov
    import openvino_genai

    from effkit.artifacts.loader import load_command
    from effkit.config import QuantizeConfig
    from effkit.engines.openvino import tune
    from effkit.engines.openvino.settings import bf16_unavailable
    from effkit.quantize.stage import run_quantize

    # a cache of its own: the backend is chosen here, and the stand-in's choice is never read by another test
    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune, "pipeline_timer", _stand_in_timer(
        {("f32", "PA"): 1000.0, ("f32", "SDPA"): 1300.0, ("bf16", "PA"): 700.0, ("bf16", "SDPA"): 900.0}))
    artifact, _ = exported
    cfg = QuantizeConfig.from_flat(source=artifact, backend="openvino", fixed_rounds=True, latency_rounds=2,
                                   latency_repeats=1, gen_tokens=4, batch_size=4,
                                   runs_dir=str(Path(artifact).parents[1]), reports_dir=str(tmp_path / "reports"))
    report = run_quantize(cfg)
    assert report["tag"] == "quantize-openvino"
    folder = Path(report["artifact"])
    desc = json.loads((folder / "openvino.json").read_text())
    assert desc["weights"] == "int8" and desc["weight_types"].get("u8", 0) > 0  # NNCF's int8, in the file
    assert report["metrics"]["int8_layers_reloaded"] == desc["weight_types"]["u8"]
    # #45: the bytes a token reads: the file (the tied token table stored once, read whole by the head), less all
    # but one row of the position table, only looked up (int8: a byte a weight, each row's uint8 zero point and f16
    # scale); the bound the bandwidth measured with it sets
    config = json.loads((folder / "config.json").read_text())
    per_token = desc["weight_bytes_per_token"]
    positions = (config["n_positions"] - 1) * (config["n_embd"] + 3)
    assert per_token["bytes_per_token"] == pytest.approx(per_token["file_bytes"] - positions, rel=0.01)
    assert per_token["bandwidth_bound_tokens_per_s"] == pytest.approx(
        per_token["memory_bandwidth_bytes_per_s"] / per_token["bytes_per_token"])
    if reason := bf16_unavailable():  # nothing timed: the CPU's flags rule bf16 out
        assert desc["inference_precision"] == "f32" and desc["precision_how"] == f"bf16 not run: {reason}"
        assert "decision" not in desc["precision_choice"]
    else:
        decision = desc["precision_choice"]["decision"]
        assert decision["picked"] == desc["inference_precision"] == "f32"
        _assert_pick_recomputes(decision)
    attention = desc["attention_choice"]["decision"]
    assert attention["picked"] == desc["attention"] == "SDPA"
    _assert_pick_recomputes(attention)

    core = ov.Core()
    xml = str(folder / "openvino_model.xml")
    om = core.read_model(xml)
    assert om.get_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"]).astype(str) == "f32"  # the record
    bare = core.compile_model(xml, "CPU")  # plain OpenVINO, nothing passed: what the model file carries
    assert bare.get_property("KV_CACHE_PRECISION").get_type_name() == "f16"
    line = load_command(folder)
    props = desc["load_properties"]
    assert line == _line(folder, props) and "ATTENTION_BACKEND='SDPA'" in line
    assert set(props) == {"INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "ATTENTION_BACKEND"}
    compiled = core.compile_model(xml, "CPU", {k: v for k, v in props.items() if k != "ATTENTION_BACKEND"})
    assert compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == desc["inference_precision"] == "f32"
    assert compiled.get_property("INFERENCE_NUM_THREADS") == desc["threads"] == torch.get_num_threads()
    assert compiled.get_property("KV_CACHE_PRECISION").get_type_name() == "f16"
    assert eval(line, {"openvino_genai": openvino_genai}) is not None  # the printed line runs as printed


def test_a_tie_goes_to_f32_and_to_pa(exported, tmp_path, monkeypatch):
    """The decision rule's preference breaks only ties: two precisions, and two attention backends, timed alike (a
    stand-in timer) are a tie within the precision, and the pick is f32 (whose loss the export gate checked) and
    PA (LLMPipeline's default), recomputed from the recorded samples."""
    from transformers import AutoTokenizer

    from effkit.engines.openvino import tune
    from effkit.engines.openvino.runtime import OpenVINOCausalLM
    from effkit.engines.openvino.settings import bf16_unavailable
    from effkit.engines.openvino.tune import choose_attention, choose_precision

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune, "pipeline_timer", _stand_in_timer(
        {(p, a): 1000.0 for p in ("f32", "bf16") for a in ("PA", "SDPA")}))
    folder = Path(exported[1]["artifact"])
    tok = AutoTokenizer.from_pretrained(folder)
    picked, how = choose_precision(folder, tok, "decode-b1")
    if reason := bf16_unavailable():
        assert (picked, how["how"]) == ("f32", f"bf16 not run: {reason}")
    else:
        decision = how["decision"]
        assert picked == "f32" and decision["verdict"] == "tie"
        assert {decision["leader"], *decision["ties"]} == {"f32", "bf16"}
        assert "tie within +-3%, broken by preference" in how["how"]
        _assert_pick_recomputes(how["decision"])
    chosen = choose_attention(OpenVINOCausalLM(folder), tok, "decode-b1")
    assert chosen["attention"] == "PA" and chosen["decision"]["verdict"] == "tie"
    assert {chosen["decision"]["leader"], *chosen["decision"]["ties"]} == {"PA", "SDPA"}
    _assert_pick_recomputes(chosen["decision"])
    assert chosen["line"].endswith("timed when the artifact was written") and not chosen["cached"]
    again = choose_attention(OpenVINOCausalLM(folder), tok, "decode-b1")  # a cache hit says when and for what
    assert again["cached"] and "cached: measured " in again["line"] and "for a model of " in again["line"]


def test_a_setting_is_timed_on_the_new_tokens_of_the_workload_it_is_chosen_for(exported, tmp_path, monkeypatch):
    """The attention backend chosen for a workload of 8 new tokens is timed decoding 8, as that workload is judged,
    never a fixed count of the tuner's own."""
    from transformers import AutoTokenizer

    from effkit import workloads
    from effkit.engines.openvino import tune
    from effkit.engines.openvino.runtime import OpenVINOCausalLM

    monkeypatch.setenv("EFFKIT_CACHE", str(tmp_path / "cache"))
    seen, stand_in = [], _stand_in_timer({(p, a): 1000.0 for p in ("f32", "bf16") for a in ("PA", "SDPA")})

    def timer(model, ids, new_tokens, attention):
        seen.append(new_tokens)
        return stand_in(model, ids, new_tokens, attention)
    monkeypatch.setattr(tune, "pipeline_timer", timer)
    workloads.register(workloads.Workload("decode-short", "decode", 1, tokens=8))
    try:
        folder = Path(exported[1]["artifact"])
        chosen = tune.choose_attention(OpenVINOCausalLM(folder), AutoTokenizer.from_pretrained(folder),
                                       "decode-short")
    finally:
        workloads.unregister("decode-short")
    assert seen and set(seen) == {8} and "greedy decoding of 8 new tokens" in chosen["how"]


def test_a_precision_picked_after_writing_is_written_into_the_model_and_its_load_line(exported, tmp_path):
    """`--inference-precision auto` picks after the folder is written: the pick replaces the record in the model's
    rt_info (the file rewritten beside itself, weights untouched) and the precision in the load line."""
    import openvino as ov

    from effkit.engines import openvino as ov_engine
    from effkit.engines.openvino import settings

    source = Path(exported[1]["artifact"])
    folder = tmp_path / "repicked"
    shutil.copytree(source, folder)
    desc = settings.read_description(folder)
    other = "f32" if desc["inference_precision"] == "bf16" else "bf16"
    desc.update(inference_precision=other, precision_how="picked after writing (test)")
    desc = settings.record(folder, desc)
    om = ov.Core().read_model(str(folder / "openvino_model.xml"))
    assert om.get_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"]).astype(str) == other
    assert om.get_rt_info(["runtime_options", "KV_CACHE_PRECISION"]).astype(str) == "f16"
    assert desc["load_properties"]["INFERENCE_PRECISION_HINT"] == other
    assert f"INFERENCE_PRECISION_HINT='{other}'" in ov_engine.ENGINE.load_command(folder)
    assert not list(folder.glob(".*.tmp.*"))
    ids = torch.tensor([[5, 17, 42, 9]])
    before = ov_engine.OpenVINOCausalLM(source, precision="f32")(ids).logits
    assert torch.equal(ov_engine.OpenVINOCausalLM(folder, precision="f32")(ids).logits, before)


def test_a_pa_that_cannot_be_built_is_not_run_and_the_defaults_fallback_is_seen(exported, tmp_path, monkeypatch):
    """#42 (3): LLMPipeline built with its default falls back from PA to SDPA silently, and says nothing; built with
    an explicit ATTENTION_BACKEND='PA' it raises. A stateless graph (PA's transformation refuses one) makes that
    real: effkit's choice records SDPA untimed with "PA: not run: <reason>", and what the default runs is known."""
    import openvino as ov
    import openvino_genai
    from transformers import AutoTokenizer

    from effkit.engines.openvino import convert, tune
    from effkit.engines.openvino.runtime import OpenVINOCausalLM
    from effkit.model import load_model

    artifact, report = exported
    folder = tmp_path / "stateless"
    shutil.copytree(report["artifact"], folder)
    monkeypatch.setattr(convert, "_stateful", lambda *a, **k: None)
    ov.save_model(convert.convert(load_model(artifact).eval()), str(folder / "openvino_model.xml"),
                  compress_to_fp16=False)
    monkeypatch.undo()
    assert openvino_genai.LLMPipeline(str(folder), "CPU") is not None  # the default builds: it fell back, unseen
    timed = []
    monkeypatch.setattr(tune, "pipeline_timer", lambda *a: timed.append(a))
    model = OpenVINOCausalLM(folder)
    chosen = tune.choose_attention(model, AutoTokenizer.from_pretrained(folder), "decode-b1")
    assert chosen["attention"] == "SDPA" and not timed and "decision" not in chosen
    assert chosen["how"].startswith("SDPA, untimed: PA: not run: RuntimeError:") and "stateful" in chosen["how"]
    ran, how = model.default_attention()
    assert ran == "SDPA" and "falls back to SDPA silently" in how
    # the real artifact: an explicit PA builds, so its default ran PA
    assert OpenVINOCausalLM(report["artifact"]).default_attention()[0] == "PA"


def test_llmpipelines_tokens_are_checked_against_effkits_loop_and_the_samples_are_its_own(exported, monkeypatch):
    """#42 (3): the decode timer's first call checks LLMPipeline's greedy tokens against effkit's loop over the same
    graph (a difference in f32 is an error, never a speed); the report's greedy and sampled texts come from
    LLMPipeline, and the check is in the generation note."""
    from transformers import AutoTokenizer

    from effkit.engines.openvino import ENGINE
    from effkit.engines.openvino.runtime import OpenVINOCausalLM
    from effkit.measure.compare import generate_sample

    folder = Path(exported[1]["artifact"])
    tok = AutoTokenizer.from_pretrained(folder)
    model = OpenVINOCausalLM(folder, precision="f32")
    timer = ENGINE.decode(model, tok, 2, 6)
    assert timer() > 0 and model.decoder_checks[-1]["equal"] and model.decoder_checks[-1]["batch"] == 2
    calls = []
    real = model.pipeline_generate

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("sampling", args[4] if len(args) > 4 else None))
        return real(*args, **kwargs)
    monkeypatch.setattr(model, "pipeline_generate", recorded)
    g = generate_sample(model, tok, 6)
    assert calls == [None, (40, 0.8, 0)]  # greedy, then seeded top-k sampling: both LLMPipeline's
    assert "equal (batch 1, 6 tokens" in g["note"] and "openvino_genai.LLMPipeline" in g["note"]
    # an LLMPipeline decoding other tokens than the graph (a stand-in shifts them) is refused on the first call
    vocab = model.config.vocab_size
    monkeypatch.setattr(model, "pipeline_generate", lambda *a, **k: (real(*a, **k) + 1) % vocab)
    with pytest.raises(EffkitError, match="other greedy tokens than effkit's loop"):
        ENGINE.decode(model, tok, 2, 6)()


def test_llmpipelines_prompt_lookup_is_exact_and_a_measured_k_travels_with_the_artifact(exported, tmp_path):
    """Speculative decoding in OpenVINO is LLMPipeline's own prompt lookup: at each k its greedy tokens equal the
    artifact's plain ones (and effkit's loop's, checked inside), its target forwards counted; an artifact that records
    a k decodes with it at batch 1 (generate and the bench's decode timer), its load line says how; a draft model,
    or lookup at a batch, is refused in one line."""
    from transformers import AutoTokenizer

    from effkit.engines import speculative as spec
    from effkit.engines.openvino import ENGINE
    from effkit.engines.openvino.runtime import LOOKUP, OpenVINOCausalLM

    folder = Path(exported[1]["artifact"])
    model = OpenVINOCausalLM(folder, precision="f32")
    if model.pipeline(LOOKUP) is None:
        pytest.skip(f"not run: LLMPipeline with prompt lookup cannot be built here ({model.why_no_pipeline(LOOKUP)})")
    ids, kw = torch.tensor([[11, 12, 13, 14, 15, 16] * 4]), {"max_new_tokens": 24, "min_new_tokens": 24}
    plain = model.generate(ids, prompt_lookup_num_tokens=0, **kw)
    for k in (2, 4):
        assert model.generate(ids, prompt_lookup_num_tokens=k, **kw).tolist() == plain.tolist()
        stats = model.speculative_stats.to_dict()
        assert stats["new_tokens"] == 24 and 1 <= stats["tokens_per_target_forward"] <= k + 1
        assert stats["acceptance_rate"] is None  # LLMPipeline does not say what its lookup proposed
        assert model.decoder_checks[-1] == {**model.decoder_checks[-1], "attention": LOOKUP, "equal": True}
    desc = json.loads((folder / "openvino.json").read_text())
    assert ENGINE.speculative_target(folder) == (desc["inference_precision"] == "f32")
    shutil.copytree(folder, measured := tmp_path / "speculative")
    spec.write_settings(measured, spec.KChoice("ngram", 4, {"picked": "k4", "label": "decided"}, {}), "by hand")
    model = OpenVINOCausalLM(measured, precision="f32")
    assert model.generate(ids, **kw).tolist() == plain.tolist() and model.speculative_stats.new_tokens == 24
    assert ENGINE.decode(model, AutoTokenizer.from_pretrained(measured), 1, 6)() > 0
    assert model.decoder_checks[-1]["attention"] == LOOKUP  # the bench times it with its k at batch 1
    line = ENGINE.load_command(measured)
    assert "prompt_lookup=True" in line and "ATTENTION_BACKEND='PA'" in line and "num_assistant_tokens=4" in line
    with pytest.raises(EffkitError, match="draft model"):
        model.generate(ids, assistant_model=object(), **kw)
    with pytest.raises(EffkitError, match="one prompt at a time"):
        model.generate(torch.cat([ids, ids]), prompt_lookup_num_tokens=2, **kw)


def test_the_bench_makes_an_openvino_artifacts_speculative_twin_checked_exact(exported, tmp_path, monkeypatch):
    """An OpenVINO artifact of the run compiled for f32 is a speculative target in its own engine: the bench makes
    its twin with the n-gram draft (k here monkeypatched: no timing decides a test), exact on the held-out prompts,
    and no weight-only form of the reference beside it."""
    from effkit import artifacts
    from effkit.bench import speculative as bs
    from effkit.config import BenchConfig
    from effkit.engines import speculative as spec
    from effkit.engines.openvino.runtime import LOOKUP, OpenVINOCausalLM

    reference, folder = Path(exported[0]), Path(exported[1]["artifact"])
    if json.loads((folder / "openvino.json").read_text())["inference_precision"] != "f32":
        pytest.skip("not run: this CPU's OpenVINO artifact infers in bf16, no speculative target")
    if OpenVINOCausalLM(folder).pipeline(LOOKUP) is None:
        pytest.skip("not run: LLMPipeline with prompt lookup cannot be built here")
    monkeypatch.setattr(spec, "choose_k", lambda *a, **k: spec.KChoice("ngram", 4, {"picked": "k4"}, {}))
    assert bs.targets([reference, folder]) == [folder]
    paths, why = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path, [reference, folder], 8)
    twin = tmp_path / bs.tag_of(folder)
    assert why == {} and paths == [reference, folder, twin]
    what = artifacts.read_meta(twin)[bs.ROW_KEY]
    assert what["target"] == f"{folder.name}: an OpenVINO artifact" and what["k"] == 4
    assert what["tokens_per_target_forward"] >= 1 and what["acceptance_rate"] is None
    rows = [{"tag": twin.name, "stage": "export", "artifact": str(twin), "flags": []}]
    bs.annotate(rows)
    assert "proposals and time not reported by the engine's own loop" in rows[0]["flags"][0]


def test_the_peer_names_its_deviations_and_is_not_run_where_llmpipeline_cannot_run_it(exported, tmp_path,
                                                                                      monkeypatch):
    """#42 (5): the peer row's description lists each way it runs other than with the defaults (the threads set to
    torch's count, ...), and says which attention backend LLMPipeline's default ran; without the tokenizer models
    LLMPipeline needs, it is "not run: <reason>", never effkit's loop under LLMPipeline's label."""
    from effkit.bench import make_peers
    from effkit.engines import openvino as ov_engine
    from effkit.engines.openvino import convert

    artifact, _ = exported
    how = ov_engine.ENGINE.peer_how
    assert f"INFERENCE_NUM_THREADS={torch.get_num_threads()}: torch's thread count" in how
    (tmp_path / "a").mkdir()
    made, not_run = make_peers(Path(artifact), tmp_path / "a", ["openvino"])
    assert [p.name for p in made] == ["peer-openvino"] and not not_run
    desc = json.loads((made[0] / "openvino.json").read_text())
    assert desc["peer"] and desc["inference_precision"] == "default" and "load_properties" not in desc
    assert desc["attention_ran"] == "PA" and desc["deviations"][0].startswith("INFERENCE_NUM_THREADS=")
    assert json.loads((made[0] / "effkit.json").read_text())["config"]["how"] == how
    monkeypatch.setattr(convert, "write_tokenizer_models", lambda folder, tok: "not written: openvino_tokenizers "
                                                                                "failed (stand-in)")
    (tmp_path / "b").mkdir()
    made, not_run = make_peers(Path(artifact), tmp_path / "b", ["openvino"])
    assert made == [] and not_run["peer-openvino"].startswith(
        "not run: LLMPipeline, which its users run, needs OpenVINO's tokenizer models: not written")


def test_an_openvino_json_that_is_not_an_object_is_one_line_naming_the_file(exported, tmp_path, capsys,
                                                                           monkeypatch):
    """#42 (6): valid JSON that is not an object, through the loader and the CLI: one line naming the file and
    the fix, exit code 2."""
    from effkit import cli
    from effkit.artifacts.loader import load_any

    folder = tmp_path / "broken"
    shutil.copytree(exported[1]["artifact"], folder)
    (folder / "openvino.json").write_text("[1, 2]")
    with pytest.raises(EffkitError) as e:
        load_any(folder)
    assert str(e.value) == (f"{folder / 'openvino.json'} holds a JSON list, not an object; write the artifact again "
                            "(effkit export --format openvino, or effkit quantize --backend openvino)")
    monkeypatch.setattr(sys, "argv", ["effkit", "generate", "--from", str(folder), "--device", "cpu",
                                      "--max-new-tokens", "2"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "openvino.json holds a JSON list" in err


def test_a_broken_openvino_artifact_is_one_line_with_its_fix(exported, tmp_path, capsys, monkeypatch):
    """A weight file cut in half (OpenVINO's own message runs over three lines), or the tokenizer files gone,
    through `effkit generate`: exit code 2, one line naming what is wrong and the fix, no traceback, nothing
    written. A prompt of no tokens is refused before LLMPipeline or the graph sees it."""
    from effkit.engines.openvino.runtime import OpenVINOCausalLM

    broken = broken_copies(Path(exported[1]["artifact"]), tmp_path, "openvino_model.bin")
    err = refused_in_one_line(["generate", "--from", str(broken["cut"]), "--max-new-tokens", "2"], capsys,
                              monkeypatch, tmp_path)
    assert f"OpenVINO cannot compile {broken['cut'] / 'openvino_model.xml'}: RuntimeError: " in err, err
    assert "Exception from" not in err and err.endswith("write the artifact again (effkit export --format "
                                                         "openvino, or effkit quantize --backend openvino)"), err
    err = refused_in_one_line(["generate", "--from", str(broken["untokenized"]), "--max-new-tokens", "2"], capsys,
                              monkeypatch, tmp_path)
    assert f"{broken['untokenized']} has no tokenizer files (tokenizer.json, or vocab.json" in err, err
    model = OpenVINOCausalLM(exported[1]["artifact"])
    for decode in (model.generate, model.loop_generate):
        with pytest.raises(EffkitError, match="the prompt has no tokens"):
            decode(torch.zeros((1, 0), dtype=torch.long), 2)


@pytest.fixture(scope="module")
def data_aware(exported, tmp_path_factory):
    """#45: the tiny model through `--weight-format int4-data` (f32 inference, a stand-in attention timer), with
    every sequence NNCF's compress_weights was handed captured as the model saw it (its input_ids)."""
    import nncf

    from effkit.config import QuantizeConfig
    from effkit.engines.openvino import tune
    from effkit.quantize.stage import run_quantize

    tmp = tmp_path_factory.mktemp("int4data")
    artifact, _ = exported
    seen: list[np.ndarray] = []
    real = nncf.compress_weights

    def capture(model, **kwargs):
        if kwargs.get("dataset") is not None:
            seen.extend(np.array(x["input_ids"]) for x in kwargs["dataset"].get_inference_data())
        return real(model, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFKIT_CACHE", str(tmp / "cache"))
        mp.setattr(nncf, "compress_weights", capture)
        mp.setattr(tune, "pipeline_timer", _stand_in_timer({(p, a): 1000.0 for p in ("f32", "bf16")
                                                                 for a in ("PA", "SDPA")}))
        cfg = QuantizeConfig.from_flat(source=artifact, backend="openvino", weight_format="int4-data",
                                       inference_precision="f32", fixed_rounds=True, latency_rounds=2,
                                       latency_repeats=1, gen_tokens=4, batch_size=4,
                                       runs_dir=str(Path(artifact).parents[1]), reports_dir=str(tmp / "reports"))
        report = run_quantize(cfg)
    return artifact, report, seen


def _split_blocks(artifact: str):
    """The blocks the quantize stage reads for `artifact`: (training, held-out) token ids."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare

    prepared = prepare(DataConfig.from_dict(artifacts.data_section(Path(artifact))), tokenizer_from=artifact)
    return prepared.blocks.train.numpy(), prepared.blocks.eval.numpy()


def test_data_aware_int4_reloads_in_plain_openvino_with_the_loss_effkit_reported(data_aware):
    """#45 (1, 2): the int4-data artifact says what NNCF did (asymmetric int4, the group that divides the tiny
    model's width 64, ratio 1.0, AWQ and scale estimation asked, the calibration blocks' split and count, NNCF's
    version), stores 4-bit weights, and plain OpenVINO (read_model, compile with the recorded load properties, a
    forward per block) gives the held-out loss effkit reported for it."""
    import nncf
    import openvino as ov

    artifact, report, _ = data_aware
    folder = Path(report["artifact"])
    assert report["tag"] == "quantize-openvino-int4-data-f32"
    desc = json.loads((folder / "openvino.json").read_text())
    wc = desc["weight_compression"]
    assert desc["weights"] == "int4-data" and desc["nncf"] == nncf.__version__
    assert (wc["mode"], wc["group_size"], wc["ratio"], wc["awq"], wc["scale_estimation"]) == (
        "INT4_ASYM", 64, 1.0, True, True)
    assert wc["awq_scales"] == 0 and "changed no layer" in wc["awq_note"]  # GPT-2's graph: NNCF finds no pattern
    train, held = _split_blocks(artifact)
    assert wc["data"]["split"] == "train" and wc["data"]["sequences"] == min(64, len(train)) == len(
        wc["data"]["indices"]) and wc["data"]["tokens_each"] == train.shape[1]
    assert desc["weight_types"].get("u4", 0) > 0 and "group_size=64" in desc["compression"]

    core = ov.Core()
    om = core.read_model(str(folder / "openvino_model.xml"))
    props = {k: v for k, v in desc["load_properties"].items() if k != "ATTENTION_BACKEND"}
    request = core.compile_model(om, "CPU", props).create_infer_request()
    losses = []
    for block in held:
        n = len(block)
        request.reset_state()
        request.infer({"input_ids": block[None], "attention_mask": np.ones((1, n), np.int64),
                       "position_ids": np.arange(n)[None], "beam_idx": np.zeros(1, np.int32)})
        logits = torch.from_numpy(request.get_tensor("logits").data[0].copy())
        losses.append(float(torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(block[1:]))))
    assert float(np.mean(losses)) == pytest.approx(report["metrics"]["eval_loss"], rel=1e-4)


def test_data_aware_int4_calibrates_on_training_blocks_never_held_out_ones(data_aware):
    """#45: every sequence NNCF's compress_weights received is a block of the run's training split, the recorded
    ones, and none is a held-out block (which would fail this: the splits share no block here)."""
    artifact, report, seen = data_aware
    train, held = _split_blocks(artifact)
    train_rows = {r.tobytes(): i for i, r in enumerate(train)}
    held_rows = {r.tobytes() for r in held}
    assert not held_rows & set(train_rows)  # the check below can tell the splits apart
    assert seen and all(s.shape == (1, train.shape[1]) for s in seen)
    assert not {s[0].tobytes() for s in seen} & held_rows
    desc = json.loads((Path(report["artifact"]) / "openvino.json").read_text())
    assert [train_rows[s[0].tobytes()] for s in seen] == desc["weight_compression"]["data"]["indices"]


def test_data_aware_int4_on_a_width_nncf_cannot_group_is_one_line(exported, tmp_path, capsys, monkeypatch):
    """#45 (3): a model whose width (48) no int4 group of 128, 64 or 32 divides: `effkit quantize --backend openvino
    --weight-format int4-data` says so in one line naming the fix, exit code 2, nothing written."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from effkit import cli

    artifact, _ = exported
    folder = tmp_path / "runs" / "odd" / "train"
    shutil.copytree(artifact, folder)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=48, n_head=2, n_layer=1, n_positions=128, vocab_size=512, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(folder)
    capsys.readouterr()  # save_pretrained's progress bar
    monkeypatch.setattr(sys, "argv", ["effkit", "quantize", "--from", str(folder), "--backend", "openvino",
                                      "--weight-format", "int4-data", "--inference-precision", "f32", "--device",
                                      "cpu", "--fixed-rounds", "--latency-rounds", "2", "--gen-tokens", "2",
                                      "--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "rep")])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "int4-data" in err and "width 48" in err and "--width-multiple 32" in err
    assert not list((tmp_path / "runs" / "odd").glob("*quantize*"))


def test_a_choice_timed_through_two_decoders_says_so():
    """Where LLMPipeline cannot be built for one precision, `decode_timer` decodes it with effkit's loop: the record
    names each one's decoder and the line says the timings are mixed."""
    from types import SimpleNamespace

    from effkit.engines.openvino.tune import decoders_of, mixed

    def model(pipeline):
        return SimpleNamespace(decoding=lambda: ("PA", None), pipeline=lambda key: pipeline)
    both = decoders_of({"f32": model(object()), "bf16": model(object())})
    assert both == {"f32": "LLMPipeline", "bf16": "LLMPipeline"} and mixed(both) == ""
    split = decoders_of({"f32": model(object()), "bf16": model(None)})
    assert mixed(split) == "; mixed decoders: f32 through LLMPipeline, bf16 through effkit's loop"
