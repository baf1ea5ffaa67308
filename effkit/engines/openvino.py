"""OpenVINO artifacts: the model converted by OpenVINO's own PyTorch front end (`openvino.convert_model`) into the
stateful layout `optimum-cli export openvino` writes for a decoder, optionally with NNCF's weight compression, and
`OpenVINOCausalLM`, which runs one on the CPU behind the few methods effkit's measurement code calls on a model
(`model(ids).logits`, `generate` with OpenVINO's internal KV cache, `config`, `eval`).

The converted graph is the with-past step effkit exports to ONNX (`engines.onnxruntime._WithPast`: inputs
`input_ids`, `attention_mask`, `position_ids`, the past keys and values; outputs `logits` and the presents),
then made stateful as optimum-intel does for its text-generation exports (`optimum.exporters.openvino.stateful`):
a `beam_idx` input gathers the cache rows, and the keys and values become the model's internal state
(`apply_make_stateful_transformation`), so the inputs are `input_ids`, `attention_mask`, `position_ids`,
`beam_idx` and the output `logits`, which `openvino_genai.LLMPipeline` and `optimum.intel.OVModelForCausalLM`
both run. The folder also holds OpenVINO's tokenizer and detokenizer models (`openvino_tokenizers`, which
LLMPipeline needs), the Hugging Face config, generation config and tokenizer, `openvino.json` (how it was
written, what it computes in) and `effkit.json`.

optimum-intel itself cannot be a dependency (2.2 pins transformers < 5.6 and pulls another torch); what its
`optimum-cli export openvino` writes for a model of this size is reproduced here and named as such: weights in
fp32 (it compresses to int8 by default only above a billion parameters), and in the model's `runtime_options`
`KV_CACHE_PRECISION=f16` for unquantized weights and `ACTIVATIONS_SCALE_FACTOR=8.0`
(`optimum/exporters/openvino/convert.py`, `_set_runtime_options`). OpenVINO's CPU plugin then picks bf16
inference wherever the CPU reports AVX-512 BF16 (its `INFERENCE_PRECISION_HINT` default), f32 elsewhere.

Nothing is written unless it passes a parity gate: the fp32 graph, compiled with f32 inference, reproduces
PyTorch's logits within `EXPORT_RTOL` of the largest logit on a probe batch and PyTorch's greedy tokens with its
cache (the ONNX export's rule, `engines.onnxruntime.check_parity`). Compressed weights and bf16 inference change
the numbers by design: their loss is measured by the bench like every other artifact's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import Engine
from effkit.errors import EffkitError

OV_DESC = "openvino.json"
OV_MODEL = "openvino_model.xml"
PORTABILITY = ("portable: plain OpenVINO loads the folder (openvino_genai.LLMPipeline(path, 'CPU'), "
               "optimum.intel.OVModelForCausalLM.from_pretrained(path), or openvino.Core().read_model)")
WEIGHTS = ("fp32", "int8", "int4")  # what NNCF stores the matrices in (int8: asymmetric per channel, as optimum)
PRECISIONS = ("auto", "bf16", "f32")  # the CPU plugin's inference precision; auto: measured on this CPU
# what `optimum-cli export openvino` stores in an unquantized text-generation model's rt_info
OPTIMUM_RUNTIME_OPTIONS = {"ACTIVATIONS_SCALE_FACTOR": "8.0", "KV_CACHE_PRECISION": "f16"}
# what effkit stores in its own artifacts: an f16 KV cache. The CPU plug-in's default, u8 (per token), turned the
# greedy decoding of the quickstart's pruned model through the stateful graph into repeated newlines (OpenVINO
# 2026.4, Zen 4; f16 and f32 decoded as PyTorch does; LLMPipeline's paged cache was unaffected)
EFFKIT_RUNTIME_OPTIONS = {"KV_CACHE_PRECISION": "f16"}


def ov_unavailable() -> str | None:
    """None if OpenVINO runs here, else the reason in one line."""
    try:
        import openvino as ov

        ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    except Exception as e:  # noqa: BLE001 - any import or plug-in failure means: not available
        return f"openvino does not run here ({type(e).__name__}: {str(e)[:100]}); pip install 'effkit[quant]'"
    return None


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plug-in says this CPU can compute in (`OPTIMIZATION_CAPABILITIES`: FP32, BF16, INT8...)."""
    import openvino as ov

    return [str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def bf16_unavailable() -> str | None:
    """None if OpenVINO computes in bf16 natively on this CPU, else why not (it emulates nothing: it falls back)."""
    caps = cpu_capabilities()
    if "BF16" not in caps:
        return f"this CPU has no native bf16 for OpenVINO (its capabilities: {', '.join(caps)})"
    return None


def _stateful(om, n_layer: int, n_head: int, head_dim: int) -> None:
    """Hide the past keys and values inside `om` as state, as optimum-intel's `patch_stateful_decoder` does: a
    `beam_idx` input gathers the cache's rows, the state starts empty (batch from `input_ids`, length 0)."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    from effkit.engines.onnxruntime import past_names, present_names

    past, present = past_names(n_layer), present_names(n_layer)
    for name in past:  # the head dimension static: the state's initial shape is read from the input's
        om.input(name).get_node().set_partial_shape(ov.PartialShape([-1, n_head, -1, head_dim]))
    om.validate_nodes_and_infer_types()
    beam = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam.output(0).get_tensor().add_names({"beam_idx"})
    om.add_parameters([beam])
    for name in past:
        port = om.input(name)
        consumers = port.get_target_inputs()
        gathered = opset13.gather(port, beam, opset13.constant(0))
        for c in consumers:
            c.replace_source_output(gathered.output(0))
    om.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(om, dict(zip(past, present, strict=True)))
    ids = om.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), opset13.constant([0]), opset13.constant(0))
    for op in om.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in list(op.get_output_partial_shape(0))]
            dims[0] = batch
            dims = [opset13.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d for d in dims]
            zeros = opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)),
                                      opset13.concat(dims, axis=0))
            op.set_arguments([zeros])
    om.validate_nodes_and_infer_types()


@torch.no_grad()
def convert(model: nn.Module):
    """`model` (effkit's or Hugging Face's GPT-2, CPU, eval) as a stateful OpenVINO model (fp32 weights)."""
    import openvino as ov

    from effkit.engines.onnxruntime import _quiet_exporter, _WithPast, past_names, present_names, probe_ids

    model = model.cpu().eval()
    c = model.config
    wrapper = _WithPast(model).eval()
    b, n, p = 2, min(5, c.n_positions - 3), 3
    head_dim = c.n_embd // c.n_head
    example = (probe_ids(c.vocab_size, (b, n)), torch.ones(b, p + n, dtype=torch.long),
               torch.arange(p, p + n).expand(b, n).contiguous(),
               *(torch.zeros(b, c.n_head, p, head_dim) for _ in past_names(c.n_layer)))
    try:
        with _quiet_exporter():
            om = ov.convert_model(wrapper, example_input=example)
        for port, name in zip(om.inputs, ["input_ids", "attention_mask", "position_ids", *past_names(c.n_layer)],
                              strict=True):
            port.get_tensor().set_names({name})
        for port, name in zip(om.outputs, ["logits", *present_names(c.n_layer)], strict=True):
            port.get_tensor().set_names({name})
        _stateful(om, c.n_layer, c.n_head, head_dim)
    except EffkitError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise EffkitError(f"OpenVINO cannot convert this model: {type(e).__name__}: {first[:200]}") from None
    return om


def compress(om, weights: str) -> dict[str, Any]:
    """NNCF's weight compression of `om` in place (data-free): int8 asymmetric per output channel (optimum-cli's
    `--weight-format int8`), or int4 symmetric in groups of 128 with the embedding / head in int8 (NNCF's
    defaults for int4)."""
    import nncf

    if weights == "int8":
        mode, how = nncf.CompressWeightsMode.INT8_ASYM, "nncf.compress_weights(mode=INT8_ASYM): int8 per channel"
        kwargs: dict[str, Any] = {}
    else:
        mode, how = nncf.CompressWeightsMode.INT4_SYM, ("nncf.compress_weights(mode=INT4_SYM, group_size=128, "
                                                        "ratio=1.0): int4 in groups of 128, data-free")
        kwargs = {"group_size": 128, "ratio": 1.0}
    import logging

    from effkit.engines.onnxruntime import _quiet_exporter

    logging.getLogger("nncf").setLevel(logging.ERROR)
    try:
        with _quiet_exporter():  # NNCF draws a progress bar on stdout
            nncf.compress_weights(om, mode=mode, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise EffkitError(f"NNCF could not compress this model's weights to {weights}: {type(e).__name__}: "
                          f"{str(e)[:160]}") from None
    return {"compression": how, "nncf": nncf.__version__}


def weight_types(om) -> dict[str, int]:
    """The model's weight constants (rank >= 2) counted by element type: what the file really stores."""
    counts: dict[str, int] = {}
    for op in om.get_ops():
        if op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) >= 2:
            shape = op.get_output_shape(0)
            if int(np.prod(shape)) >= 256:
                t = op.get_output_element_type(0).get_type_name()
                counts[t] = counts.get(t, 0) + 1
    return counts


def compile_config(precision: str, kv_cache: str | None = None) -> dict[str, str]:
    """What effkit passes to `compile_model`: the inference precision (omitted for "default": the plug-in's own
    choice), the KV cache's (None: the plug-in's or the model's runtime_options) and the thread count torch uses
    (every engine in a comparison gets the same threads)."""
    cfg = {"INFERENCE_NUM_THREADS": str(torch.get_num_threads())}
    if precision in ("bf16", "f32"):
        cfg["INFERENCE_PRECISION_HINT"] = precision
    if kv_cache:
        cfg["KV_CACHE_PRECISION"] = kv_cache
    return cfg


class OpenVINOCausalLM(nn.Module):
    """An OpenVINO artifact behind effkit's model interface. It holds no PyTorch parameters: `n_params` is the
    source's parameter count. `precision`: the inference precision to compile with (None: the artifact's);
    `kv_cache`: the KV cache's (None: the plug-in's default, u8 on CPUs, or the model's runtime_options)."""

    compilable = False  # OpenVINO compiles its own graph

    def __init__(self, path: str | Path, precision: str | None = None, kv_cache: str | None = None):
        super().__init__()
        import openvino as ov
        from transformers import GPT2Config

        path = Path(path)
        if reason := ov_unavailable():
            raise EffkitError(f"{path} is an OpenVINO artifact, which cannot run here: {reason}")
        try:
            self.description = json.loads((path / OV_DESC).read_text())
            self.config = GPT2Config.from_pretrained(path)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, ValueError) as e:
            raise EffkitError(f"{path} is not a complete OpenVINO artifact ({type(e).__name__}); write it again") \
                from None
        if not (path / OV_MODEL).is_file():
            raise EffkitError(f"{path} has no {OV_MODEL}; write it again")
        self.precision = precision or self.description.get("inference_precision", "default")
        try:
            core = ov.Core()
            self.compiled = core.compile_model(str(path / OV_MODEL), "CPU",
                                               compile_config(self.precision, kv_cache))
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file, or a plug-in crash on this CPU
            raise EffkitError(f"OpenVINO cannot compile {path / OV_MODEL}: {type(e).__name__}: {str(e)[:160]}; "
                              "write it again") from None
        self.request = self.compiled.create_infer_request()
        self._pipelines: dict[str | None, Any] = {}
        self.pipeline_error = ""  # why LLMPipeline could not be built, once it failed
        self.attention_notes: dict[int, str] = {}  # decode batch -> the attention backend and how it was chosen
        # no idle time after it is timed: 20 fp32 512x512 matmuls on torch's 2 threads right after a prefill of
        # (12, 128) took as long as 0.2 s later (median of 8, the project's Zen 4 EPYC): its threads do not spin
        self.settle_s = 0.0
        self.inference_precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
        self.kv_cache_precision = str(self.compiled.get_property("KV_CACHE_PRECISION").get_type_name())
        self.n_params = int(self.description.get("params", 0))
        self.path = path
        self.compile_note = (f"OpenVINO {ov.__version__} CPU plug-in: inference precision "
                             f"{self.inference_precision}, KV cache {self.kv_cache_precision}, "
                             f"{self.compiled.get_property('INFERENCE_NUM_THREADS')} threads")

    @property
    def generation_note(self) -> str:
        """How it decodes: the plug-in's settings, and the pipelines (once the bench has built them)."""
        if self.pipeline_error:
            return f"{self.compile_note}; decoding: {self.pipeline_error}"
        if not self.attention_notes:
            return self.compile_note
        return (f"{self.compile_note}; decoding: openvino_genai.LLMPipeline {_genai_version()}, attention " +
                "; ".join(f"batch {b}: {how}" for b, how in sorted(self.attention_notes.items())))

    def pipeline(self, attention: str | None = None):
        """`openvino_genai.LLMPipeline` over this folder (its C++ decoding loop and KV cache manager), compiled with
        this model's settings and `attention` (LLMPipeline's ATTENTION_BACKEND: "PA", paged attention and
        continuous batching, its default; "SDPA", the stateful graph; None: its default); None, with the reason in
        `pipeline_error`, where it cannot be built (no tokenizer models, openvino_genai missing)."""
        if attention not in self._pipelines and not self.pipeline_error:
            try:
                import openvino_genai

                if not (self.path / "openvino_tokenizer.xml").is_file():
                    raise EffkitError("the folder has no openvino_tokenizer.xml")
                extra = {"ATTENTION_BACKEND": attention} if attention else {}
                self._pipelines[attention] = openvino_genai.LLMPipeline(
                    str(self.path), "CPU", **compile_config(self.precision), **extra)
            except Exception as e:  # noqa: BLE001 - the Python loop still decodes
                self.pipeline_error = (f"not run: openvino_genai.LLMPipeline ({type(e).__name__}: {str(e)[:100]}); "
                                      "decoded by effkit's Python loop over the infer request")
        return self._pipelines.get(attention)

    def pipeline_generate(self, ids: np.ndarray, new_tokens: int, attention: str | None = None) -> np.ndarray:
        """Greedy decoding of exactly `new_tokens` by LLMPipeline (end-of-text ignored): the new tokens."""
        import openvino as ov
        import openvino_genai

        cfg = openvino_genai.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = new_tokens
        cfg.ignore_eos = True
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = self.pipeline(attention).generate(
            openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
        return np.array(out.tokens, dtype=np.int64)

    def attention_for(self, batch: int, start: np.ndarray) -> tuple[str | None, str]:
        """LLMPipeline's attention backend for decoding at `batch`, as (backend, how). The plain export a user
        makes (the peer) runs LLMPipeline's default; effkit's own artifacts take "SDPA" or "PA" by measurement on
        this machine, per decode batch of the workloads (the nearest), never assumed: on the project's Zen 4
        EPYC SDPA decoded an int8 model 1.17x faster than PA at batch 12. Paired, interleaved, under the bench's
        sequential rule with a 10 s budget; cached per machine, OpenVINO version, weights, precision and model
        size, with the date. `start`: the prompt's token ids."""
        if self.description.get("peer") or not self.description.get("choose_attention", True):
            return None, "LLMPipeline's default attention backend (as its users run it)"
        import openvino

        from effkit import workloads
        from effkit.measure import metrics, stopping
        from effkit.measure.results import PairedRatio

        batches = sorted({w.batch for w in workloads.all_() if w.kind == "decode"}) or [1]
        nearest = min(batches, key=lambda b: abs(b - batch))
        d = self.description
        key = (f"{metrics.describe_device(torch.device('cpu'))}|threads {torch.get_num_threads()}|openvino "
               f"{openvino.__version__}|weights {d.get('weights')}|{self.precision}|params {d.get('params', 0)}|"
               f"batches {batches}")

        def measure() -> dict[str, Any]:
            rule = stopping.Stopping(rounds=3, precision=0.03, budget_s=10.0)
            out = {}
            new = max(1, min(32, self.config.n_positions - start.shape[1]))  # within the model's context

            def timer(att: str, b: int):
                ids = np.repeat(start, b, axis=0)

                def once() -> float:
                    t = time.perf_counter()
                    self.pipeline_generate(ids, new, att)
                    return new * b / (time.perf_counter() - t)
                once.settle_s = self.settle_s
                return once

            for b in batches:
                m = stopping.measure({a: timer(a, b) for a in ("PA", "SDPA")}, rule, 1, warmup=1)
                ratio = m.ratio("PA", "SDPA", higher_is_better=True)
                out[str(b)] = {"attention": "SDPA" if PairedRatio.of(ratio).verdict == "faster" else "PA",
                               "ratio": ratio, "rounds": m.record["rounds"]}
            return out

        if self.pipeline("PA") is None or self.pipeline("SDPA") is None:
            return None, self.pipeline_error or "LLMPipeline's default"
        chosen, _ = metrics.machine_cached("openvino_attention", key, measure)
        c = chosen[str(nearest)]
        how = (f"{c['attention']}: SDPA vs PA at decode batch {nearest}, {PairedRatio.of(c['ratio']).fmt()} over "
               f"{c['rounds']} paired rounds ({'faster' if c['attention'] == 'SDPA' else 'not faster: PA, the default'}"
               f"); {metrics.cache_note('openvino_attention', key)}")
        return c["attention"], how

    def _check_length(self, n: int) -> None:
        if n > self.config.n_positions:
            raise EffkitError(f"{n} tokens exceed the model's context ({self.config.n_positions})")

    def _step(self, ids: np.ndarray, done: int) -> np.ndarray:
        b, n = ids.shape
        self.request.infer({"input_ids": ids, "attention_mask": np.ones((b, done + n), np.int64),
                            "position_ids": np.broadcast_to(np.arange(done, done + n, dtype=np.int64), (b, n)),
                            "beam_idx": np.arange(b, dtype=np.int32)})
        return self.request.get_tensor("logits").data

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        self._check_length(input_ids.shape[-1])
        self.request.reset_state()
        logits = self._step(input_ids.detach().cpu().long().numpy(), 0)
        return SimpleNamespace(logits=torch.from_numpy(np.array(logits, dtype=np.float32)))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **_: Any) -> torch.Tensor:
        """Exactly `max_new_tokens` new tokens with OpenVINO's internal KV cache (the ONNX artifact's loop and
        rules: end-of-text never picked among the first `min_new_tokens`; sampling from torch's generator)."""
        from effkit.engines.onnxruntime import never_end, next_tokens

        ids = input_ids.cpu().long().numpy()
        self._check_length(ids.shape[1] + max_new_tokens - 1)
        if streamer is not None:
            streamer.put(torch.from_numpy(ids))
        self.request.reset_state()
        todo, done, eos = ids, 0, self.config.eos_token_id
        for k in range(max_new_tokens):
            logits = self._step(todo, done)[:, -1, :]
            done += todo.shape[1]
            nxt = next_tokens(never_end(logits, eos) if k < min_new_tokens else logits, do_sample, top_k,
                              temperature)
            ids, todo = np.concatenate([ids, nxt], axis=1), nxt
            if streamer is not None:
                streamer.put(torch.from_numpy(nxt))
        if streamer is not None:
            streamer.end()
        return torch.from_numpy(ids)


@torch.no_grad()
def check_parity(model: nn.Module, folder: Path) -> dict[str, Any]:
    """The gate of an fp32 conversion, compiled with f32 inference and an f32 KV cache: logits within EXPORT_RTOL x
    max(1, max |logit|) of PyTorch's on a (3, 24) probe batch, and PARITY_TOKENS greedy tokens equal to PyTorch's
    with its cache."""
    from effkit.engines.onnxruntime import EXPORT_RTOL, PARITY_TOKENS, probe_ids

    ov_model = OpenVINOCausalLM(folder, precision="f32", kv_cache="f32")  # the conversion, not the u8 cache
    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    reference = model(probe).logits
    diff = float((ov_model(probe).logits - reference).abs().max())
    allowed = EXPORT_RTOL * max(1.0, float(reference.abs().max()))
    if not diff <= allowed:
        raise EffkitError(f"the converted OpenVINO model does not reproduce the model (max logit difference "
                          f"{diff:.2e} > {allowed:.2e}); this model cannot be converted faithfully")
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    ours = ov_model.generate(prompt, **kw)
    cached = model.generate(prompt, use_cache=True, **kw)
    if not torch.equal(ours, cached):
        raise EffkitError("the converted OpenVINO model's greedy tokens with its internal KV cache differ from "
                          "PyTorch's; this model cannot be converted faithfully")
    return {"max_abs_logit_diff": diff, "max_abs_logit_diff_allowed": allowed, "greedy_tokens_equal": new,
            "how": f"fp32 weights compiled with f32 inference and an f32 KV cache: logits of a (3, {probe.shape[1]}) "
                   f"probe batch within {allowed:.2e} of PyTorch's ({EXPORT_RTOL} of the largest logit's magnitude); "
                   f"{new} greedy tokens with OpenVINO's internal KV cache equal PyTorch's with its cache"}


def _genai_version() -> str:
    import openvino_genai

    return openvino_genai.__version__


def write_tokenizer_models(folder: Path, tokenizer) -> str:
    """OpenVINO's tokenizer and detokenizer models (what LLMPipeline reads), or why they are missing."""
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer

        tok, detok = convert_tokenizer(tokenizer, with_detokenizer=True)
        ov.save_model(tok, str(folder / "openvino_tokenizer.xml"))
        ov.save_model(detok, str(folder / "openvino_detokenizer.xml"))
    except Exception as e:  # noqa: BLE001 - optional: the model itself loads without them
        return f"not written: openvino_tokenizers failed ({type(e).__name__}: {str(e)[:100]})"
    return "openvino_tokenizer.xml, openvino_detokenizer.xml (openvino_tokenizers.convert_tokenizer)"


def write_artifact(folder: Path, model: nn.Module, tokenizer, weights: str = "fp32", precision: str = "default",
                   runtime_options: dict[str, str] | None = None, precision_how: str = "") -> dict[str, Any]:
    """Convert `model` into `folder`: the stateful IR (weights as `weights`; `runtime_options` stored in it, effkit's
    own by default), the tokenizer models and files, the configs, and `openvino.json`, which says how and what the
    loader compiles it with (`precision`: bf16, f32 or "default", the CPU plug-in's own choice). Refused unless the
    fp32 conversion passes the parity gate."""
    import copy

    import openvino as ov

    if weights not in WEIGHTS:
        raise EffkitError(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS)}")
    if runtime_options is None:
        runtime_options = EFFKIT_RUNTIME_OPTIONS
    model = copy.deepcopy(model).cpu().float().eval()
    t0 = time.perf_counter()
    om = convert(model)
    seconds = time.perf_counter() - t0
    for name, value in (runtime_options or {}).items():
        om.set_rt_info(value, ["runtime_options", name])
    model.config.use_cache = True
    model.config.save_pretrained(folder)
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc: dict[str, Any] = {"format": "openvino", "weights": weights, "inference_precision": precision,
                            "precision_how": precision_how, "params": sum(p.numel() for p in model.parameters()),
                            "converter": f"openvino.convert_model (PyTorch front end), OpenVINO {ov.__version__}, "
                                         "made stateful as optimum-intel's patch_stateful_decoder",
                            "convert_seconds": seconds, "runtime_options": dict(runtime_options or {})}
    (folder / OV_DESC).write_text(json.dumps(desc, indent=2))  # the loader needs it for the gate
    desc["parity"] = check_parity(model, folder)
    if weights != "fp32":
        desc.update(compress(om, weights))
        ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc["weight_types"] = weight_types(om)
    desc["tokenizer_models"] = write_tokenizer_models(folder, tokenizer)
    desc["runtime"] = ("openvino.Core().compile_model(model, 'CPU', {INFERENCE_NUM_THREADS: torch threads" +
                       (f", INFERENCE_PRECISION_HINT: {precision}" if precision != "default" else "") + "})")
    (folder / OV_DESC).write_text(json.dumps(desc, indent=2))
    return desc


class OpenVINOEngine(Engine):
    """OpenVINO through its PyTorch front end, in optimum-intel's stateful layout."""

    name = "openvino"
    marker = OV_DESC
    label = "OpenVINO"
    noun = "an OpenVINO"  # "is an OpenVINO artifact"
    summary = "OpenVINO (stateful IR as optimum-cli writes it; fp32, int8 or int4 weights; bf16 or f32 inference)"
    format = "openvino"
    portability = PORTABILITY
    peer_tag = "peer-openvino"
    peer_how = ("what `optimum-cli export openvino` writes for a model of this size (fp32 weights, stateful, "
                "runtime_options KV_CACHE_PRECISION=f16, ACTIVATIONS_SCALE_FACTOR=8.0), compiled with OpenVINO's "
                "defaults (bf16 inference where the CPU has AVX-512 BF16)")

    def available(self, device: torch.device | None = None, path: Path | None = None, **options: Any) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs OpenVINO artifacts on the CPU only; use --device cpu"
        return ov_unavailable()

    def load(self, path: Path, device: torch.device) -> OpenVINOCausalLM:
        if device.type != "cpu":
            raise EffkitError(f"{path} is an OpenVINO artifact, which effkit runs on the CPU only; use --device cpu")
        return OpenVINOCausalLM(path)

    def convert(self, folder: Path, source: Path, model: nn.Module, tokenizer, int8: bool = False,
                weights: str | None = None, precision: str = "default", **options: Any) -> dict[str, Any]:
        return write_artifact(folder, model, tokenizer, weights or ("int8" if int8 else "fp32"), precision)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"precision": f"weights {desc['weights']}, inference {desc['inference_precision']}",
                 "runtime": desc["runtime"], "exporter": desc["converter"], "weights": desc["weight_types"]},
                {"max_abs_logit_diff_vs_pytorch": desc["parity"]["max_abs_logit_diff"], "parity": desc["parity"]})

    def write_peer(self, folder: Path, reference: Path, model: nn.Module, tokenizer) -> dict[str, Any]:
        desc = write_artifact(folder, model, tokenizer, "fp32", "default", OPTIMUM_RUNTIME_OPTIONS)
        desc["peer"] = True  # decoded with LLMPipeline's defaults, as its users run it: nothing chosen for it
        (folder / OV_DESC).write_text(json.dumps(desc, indent=2))
        return desc

    def decode(self, model: OpenVINOCausalLM, tokenizer, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None):
        """Greedy decoding as OpenVINO's users run it: `openvino_genai.LLMPipeline` (its C++ loop; effkit's Python
        loop over the infer request where the pipeline cannot be built), from `batch` copies of the prompt, with
        the attention backend `attention_for` gives."""
        from effkit.measure import metrics

        start = tokenizer(metrics.GENERATION_PROMPT, return_tensors="np").input_ids
        attention, how = model.attention_for(batch, start)
        if model.pipeline(attention) is None:
            return super().decode(model, tokenizer, batch, new_tokens, generate_kwargs)
        model.attention_notes[batch] = how
        ids = start.repeat(batch, 0)

        def once() -> float:
            t = time.perf_counter()
            new = model.pipeline_generate(ids, new_tokens, attention)
            seconds = time.perf_counter() - t
            if new.shape != (batch, new_tokens):
                raise EffkitError(f"LLMPipeline returned {new.shape} tokens, not ({batch}, {new_tokens})")
            return batch * new_tokens / seconds

        once.settle_s = model.settle_s
        return once

    def quantized_layers(self, model: nn.Module, path: Path | None = None) -> int:
        desc = getattr(model, "description", {})
        return sum(v for k, v in desc.get("weight_types", {}).items() if k in ("u8", "i8", "u4", "i4"))

    def load_command(self, path: Path) -> str:
        return f"openvino_genai.LLMPipeline('{path}', 'CPU')"


ENGINE = OpenVINOEngine()
