"""OpenVINO: the export loads in plain OpenVINO and decodes PyTorch's greedy tokens; the backend and the engine come
through the registries; the inference precision is chosen by measurement or said not run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from effkit.engines.openvino import ov_unavailable

pytestmark = pytest.mark.skipif(ov_unavailable() is not None, reason=f"not run: {ov_unavailable()}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, train_tiny):
    """A tiny trained model exported by `effkit export --format openvino` (fp32 weights, the plug-in's own
    inference precision), with its report."""
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


def test_export_loads_in_plain_openvino_and_decodes_pytorchs_greedy_tokens(exported):
    import openvino as ov
    import openvino_genai

    artifact, report = exported
    folder = Path(report["artifact"])
    assert report["tag"] == "openvino" and report["what_ran"]["format"] == "openvino"
    assert report["metrics"]["parity"]["greedy_tokens_equal"] > 0  # the gate ran before anything was written
    assert report["load_command"] == f"openvino_genai.LLMPipeline('{folder}', 'CPU')"
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
        if path.name != "openvino.py" and path != root / "registry.py":
            text = path.read_text()
            assert '== "openvino"' not in text and "engines.openvino" not in text, path


def test_quantize_backend_int8_chooses_its_precision_by_measurement(exported, tmp_path):
    from effkit.config import QuantizeConfig
    from effkit.engines.openvino import bf16_unavailable
    from effkit.quantize.stage import run_quantize

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
    if reason := bf16_unavailable():
        assert desc["inference_precision"] == "f32" and desc["precision_how"] == f"bf16 not run: {reason}"
    else:  # measured: bf16 kept only where its paired ratio to f32 says faster
        verdict = desc["precision_choice"]["bf16_vs_f32"]["verdict"]
        assert desc["inference_precision"] == ("bf16" if verdict == "faster" else "f32")
