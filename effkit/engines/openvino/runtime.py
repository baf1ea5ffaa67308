"""`OpenVINOCausalLM`: an OpenVINO artifact run on the CPU behind the few methods effkit's measurement code calls on
a model (`model(ids).logits`, `generate`, `config`, `eval`).

Speed and quality come from the decoder the user runs: `openvino_genai.LLMPipeline`, with the attention backend
recorded in the artifact. Its greedy tokens are checked, on each timer's first call and on each greedy sample,
against effkit's own loop over the same stateful graph compiled with the same settings (`loop_generate`): a
difference in f32 is an error, one in bf16 (whose arithmetic differs between LLMPipeline's kernels and the graph's by
design) is flagged in the generation note. The held-out loss comes from a forward of that compiled graph
(LLMPipeline returns no logits). LLMPipeline built with its default attention backend (paged attention, "PA") falls
back to SDPA silently when PA cannot be built, and exposes neither which one it built nor the error; built with an
explicit `ATTENTION_BACKEND="PA"` it raises instead (openvino.genai `llm/pipeline.cpp`, 2026.x). So effkit always
builds its own artifacts' pipelines with an explicit backend, and learns what the default ran (the peer's) by
building an explicit PA beside it.

Speculative decoding is LLMPipeline's own prompt lookup (`prompt_lookup=True`, which runs on paged attention only;
`num_assistant_tokens` = k, `max_ngram_size` the n-gram draft's), asked with transformers' keyword
`prompt_lookup_num_tokens=k`, or at batch 1 where the artifact records a measured k (`speculative.SETTINGS`, as the
ONNX Runtime artifact's); its greedy tokens checked against effkit's plain loop like every other."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from effkit.engines import speculative
from effkit.engines.openvino.settings import (
    OV_MODEL,
    REWRITE,
    compile_config,
    ov_unavailable,
    property_name,
    read_description,
)
from effkit.engines.shared import check_length, decode_loop, load_or_fail, one_line, stream_after
from effkit.errors import EffkitError
from effkit.measure.engine_model import EngineModel

LOOKUP = "PA, prompt lookup"  # the pipeline key of LLMPipeline's speculative decoding (prompt lookup on PA)


def genai_version() -> str:
    import openvino_genai

    return openvino_genai.__version__


class OpenVINOCausalLM(EngineModel):
    """An OpenVINO artifact behind effkit's model interface. It holds no PyTorch parameters: `n_params` is the
    source's parameter count. `precision`: the inference precision to compile with (None: the artifact's);
    `kv_cache`: the KV cache's (None: the plug-in's default, u8 on CPUs, or the model's runtime_options).
    Forward (the loss, prefill) runs the compiled stateful graph; `generate` and the bench's decode timers run
    `openvino_genai.LLMPipeline` with the attention backend the artifact records, checked against effkit's own
    loop over the graph (`loop_generate`)."""

    compilable = False  # OpenVINO compiles its own graph

    def __init__(self, path: str | Path, precision: str | None = None, kv_cache: str | None = None):
        super().__init__()
        import openvino as ov
        from transformers import GPT2Config

        path = Path(path)
        if reason := ov_unavailable():
            raise EffkitError(f"{path} is an OpenVINO artifact, which cannot run here: {reason}")
        self.description = read_description(path)
        try:
            self.config = GPT2Config.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise EffkitError(f"{path} is not a complete OpenVINO artifact ({type(e).__name__}); {REWRITE}") \
                from None
        if not (path / OV_MODEL).is_file():
            raise EffkitError(f"{path} has no {OV_MODEL}; {REWRITE}")
        self.precision = precision or self.description.get("inference_precision", "default")
        self.kv_cache = kv_cache
        with load_or_fail(f"OpenVINO cannot compile {path / OV_MODEL}", REWRITE):  # a truncated or foreign file
            self.compiled = ov.Core().compile_model(str(path / OV_MODEL), "CPU",
                                                    compile_config(self.precision, kv_cache))
        self.request = self.compiled.create_infer_request()
        # by ATTENTION_BACKEND (None: LLMPipeline's default; LOOKUP: paged attention with prompt lookup)
        self._pipelines: dict[str | None, Any] = {}
        self._pipeline_errors: dict[str | None, str] = {}
        self.speculative = speculative.read_settings(path)  # a measured draft and k, or None
        self.speculative_stats: speculative.SpecStats | None = None  # of the last prompt-lookup generate
        self._decoding: tuple[str | None, str] | None = None
        self.decoder_checks: list[dict[str, Any]] = []  # LLMPipeline's greedy tokens against effkit's loop
        # no idle time after it is timed: its threads do not spin-wait after a call (measured; docs/benchmarks.md)
        self.inference_precision = property_name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.kv_cache_precision = property_name(self.compiled.get_property("KV_CACHE_PRECISION"))
        self.n_params = int(self.description.get("params", 0))
        self.path = path
        self.compile_note = (f"OpenVINO {ov.__version__} CPU plug-in: inference precision "
                             f"{self.inference_precision}, KV cache {self.kv_cache_precision}, "
                             f"{self.compiled.get_property('INFERENCE_NUM_THREADS')} threads")

    @property
    def generation_note(self) -> str:
        """How it decodes: the plug-in's settings, the pipeline and its attention backend (once built), and how its
        greedy tokens compared with effkit's loop over the same graph."""
        if self._decoding is None:
            return self.compile_note
        key, how = self._decoding
        if self.pipeline(key) is None:
            return (f"{self.compile_note}; decoding: not run: openvino_genai.LLMPipeline "
                    f"({self.why_no_pipeline(key)}); decoded by effkit's Python loop over the infer request")
        note = f"{self.compile_note}; decoding: openvino_genai.LLMPipeline {genai_version()}, attention {how}"
        if self.decoder_checks:
            note += ("; its greedy tokens against effkit's loop over the same compiled graph: " +
                     "; ".join(_check_line(c) for c in self.decoder_checks))
        return note

    def pipeline(self, attention: str | None = None):
        """`openvino_genai.LLMPipeline` over this folder (its C++ decoding loop and KV cache manager), compiled with
        this model's settings and `attention` (LLMPipeline's ATTENTION_BACKEND: "PA", paged attention and
        continuous batching, or "SDPA", the stateful graph; None: no ATTENTION_BACKEND, its default, which falls
        back from PA to SDPA silently); None, with the reason in `why_no_pipeline(attention)`, where it cannot be
        built (no tokenizer models, openvino_genai missing, that backend failing)."""
        if attention not in self._pipelines and attention not in self._pipeline_errors:
            try:
                import openvino_genai

                if not (self.path / "openvino_tokenizer.xml").is_file():
                    raise EffkitError("the folder has no openvino_tokenizer.xml")
                extra = ({"ATTENTION_BACKEND": "PA", "prompt_lookup": True} if attention == LOOKUP else
                         {"ATTENTION_BACKEND": attention} if attention else {})
                self._pipelines[attention] = openvino_genai.LLMPipeline(
                    str(self.path), "CPU", **compile_config(self.precision, self.kv_cache), **extra)
            except Exception as e:  # noqa: BLE001 - the reason is reported; the caller decides
                self._pipeline_errors[attention] = one_line(e)
        return self._pipelines.get(attention)

    def why_no_pipeline(self, attention: str | None = None) -> str:
        return self._pipeline_errors.get(attention, "")

    def default_attention(self) -> tuple[str, str]:
        """Which attention backend LLMPipeline built with its default runs here, as (backend, how). It exposes
        neither, and falls back from PA to SDPA silently; built with an explicit ATTENTION_BACKEND="PA" it raises
        instead, so an explicit PA pipeline that builds means the default built PA too (the same code path)."""
        if self.pipeline("PA") is not None:
            return "PA", ("PA (paged attention), LLMPipeline's default: an explicit ATTENTION_BACKEND='PA' builds "
                          "here, so the default did not fall back")
        return "SDPA", (f"SDPA: LLMPipeline's default PA does not build here ({self.why_no_pipeline('PA')}), and "
                        "the default then falls back to SDPA silently")

    def decoding(self) -> tuple[str | None, str]:
        """(what LLMPipeline is built with to decode this artifact: its ATTENTION_BACKEND, None for its default;
        the backend that runs and how it was set, in words). The artifact's recorded backend; the peer's: the
        default, as its users run it, with the backend it falls to; an artifact that records none: the backend
        the default would run, named explicitly."""
        if self._decoding is None:
            d = self.description
            if d.get("attention"):
                self._decoding = d["attention"], d.get("attention_how") or f"{d['attention']}, recorded"
            else:
                ran, how = self.default_attention()
                if d.get("peer"):
                    self._pipelines.pop("PA", None)  # the probe: the peer decodes with the default, as users do
                    self._decoding = None, how
                else:
                    self._decoding = ran, f"{how}; not recorded in the artifact, named explicitly"
        return self._decoding

    def pipeline_generate(self, ids: np.ndarray, new_tokens: int, attention: str | None = None,
                          min_new_tokens: int | None = None,
                          sampling: tuple[int | None, float, int] | None = None, lookup: int = 0) -> np.ndarray:
        """`new_tokens` new tokens by LLMPipeline (end-of-text never ends it, and is never picked among the first
        `min_new_tokens`, default all): greedy, or `sampling` = (top_k, temperature, seed) by its sampler; `lookup`
        = k > 0: greedy with its prompt lookup proposing k tokens a step (the pipeline `LOOKUP`; `attention` then
        unused), its forwards and the tokens each gave in `speculative_stats`."""
        import openvino as ov
        import openvino_genai

        cfg = openvino_genai.GenerationConfig()
        cfg.max_new_tokens = new_tokens
        cfg.min_new_tokens = new_tokens if min_new_tokens is None else min(min_new_tokens, new_tokens)
        cfg.ignore_eos = True
        if sampling is not None:
            top_k, temperature, seed = sampling
            cfg.do_sample = True
            cfg.temperature = float(temperature)
            cfg.rng_seed = int(seed) % 2**32
            if top_k:
                cfg.top_k = int(top_k)
        if lookup:
            cfg.num_assistant_tokens, cfg.max_ngram_size = int(lookup), speculative.NGRAM_MAX
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = self.pipeline(LOOKUP if lookup else attention).generate(
            openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
        new = np.array(out.tokens, dtype=np.int64)
        if lookup:  # each forward's tokens: its own and the drafts it accepted
            made = list(out.perf_metrics.raw_metrics.m_batch_sizes)
            self.speculative_stats = speculative.SpecStats(new_tokens=int(sum(made)), forwards=len(made),
                                                           accepted=int(sum(made)) - len(made))
        if new.shape != (ids.shape[0], new_tokens):
            raise EffkitError(f"LLMPipeline returned {new.shape} tokens, not ({ids.shape[0]}, {new_tokens})")
        return new

    def check_tokens(self, ids: np.ndarray, new: np.ndarray, attention: str | None,
                     min_new_tokens: int | None = None) -> dict[str, Any]:
        """LLMPipeline's greedy tokens `new` for the prompts `ids` against effkit's loop over the same compiled graph
        (`loop_generate`), recorded in `decoder_checks` (and the generation note). A difference in f32 inference is
        an error: the speed measured would not be this model's decoding. In bf16 it is flagged: LLMPipeline's
        kernels and the graph's round differently by design, and greedy decoding amplifies a near tie."""
        n = new.shape[1]
        ref = self.loop_generate(ids, n, n if min_new_tokens is None else min_new_tokens)[:, ids.shape[1]:]
        differ = np.flatnonzero((new != ref).any(axis=0))
        entry = {"attention": attention or "LLMPipeline's default", "batch": int(new.shape[0]), "tokens": int(n),
                 "equal": not len(differ), "first_difference": int(differ[0]) if len(differ) else None,
                 "inference_precision": self.inference_precision}
        self.decoder_checks.append(entry)
        if len(differ) and self.inference_precision == "f32":
            raise EffkitError(f"{self.path}: openvino_genai.LLMPipeline ({entry['attention']}) decodes other greedy "
                              f"tokens than effkit's loop over the same graph in f32 inference (from new token "
                              f"{entry['first_difference']} of {n}, batch {entry['batch']}); its speed would not be "
                              "this model's decoding")
        return entry

    def lookup_k(self, batch: int, do_sample: bool, kwargs: dict[str, Any]) -> int:
        """The k of LLMPipeline's prompt lookup for a `generate` call: transformers' `prompt_lookup_num_tokens` where
        asked (0: plain), else the artifact's measured k at batch 1, greedy; a draft model is refused in one line
        (effkit writes none for OpenVINO)."""
        if kwargs.get("assistant_model") is not None:
            raise EffkitError("an OpenVINO artifact decodes speculatively with LLMPipeline's prompt lookup "
                              "(prompt_lookup_num_tokens=k); a draft model (assistant_model) is not supported here")
        asked = kwargs.get("prompt_lookup_num_tokens")
        if asked is None:
            asked = self.speculative["k"] if self.speculative and batch == 1 and not do_sample else 0
        if asked and (do_sample or batch != 1):
            raise EffkitError("LLMPipeline's prompt lookup decodes greedily, one prompt at a time: drop "
                              "prompt_lookup_num_tokens, or decode greedily at batch 1")
        return int(asked or 0)

    def _step(self, ids: np.ndarray, done: int) -> np.ndarray:
        b, n = ids.shape
        self.request.infer({"input_ids": ids, "attention_mask": np.ones((b, done + n), np.int64),
                            "position_ids": np.broadcast_to(np.arange(done, done + n, dtype=np.int64), (b, n)),
                            "beam_idx": np.arange(b, dtype=np.int32)})
        return self.request.get_tensor("logits").data

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        check_length(input_ids.shape[-1], self.config.n_positions)
        self.request.reset_state()
        logits = self._step(input_ids.detach().cpu().long().numpy(), 0)
        return SimpleNamespace(logits=torch.from_numpy(np.array(logits, dtype=np.float32)))

    def loop_generate(self, ids: np.ndarray, max_new_tokens: int, min_new_tokens: int = 0, do_sample: bool = False,
                      top_k: int | None = None, temperature: float = 1.0, streamer=None) -> np.ndarray:
        """Prompts and exactly `max_new_tokens` new tokens by effkit's own loop over the compiled stateful graph and
        its internal KV cache (the ONNX artifact's loop and rules: end-of-text never picked among the first
        `min_new_tokens`; sampling from torch's generator): the reference LLMPipeline is checked against."""
        ids = np.asarray(ids, dtype=np.int64)
        check_length(ids.shape[1], self.config.n_positions, max_new_tokens)
        self.request.reset_state()
        step = lambda ids, done: self._step(np.ascontiguousarray(ids[:, done:]), done)[:, -1, :]  # noqa: E731
        return decode_loop(step, ids, max_new_tokens, self.config.eos_token_id, min_new_tokens, do_sample, top_k,
                           temperature, streamer)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **kwargs: Any) -> torch.Tensor:
        """Prompts and exactly `max_new_tokens` new tokens by the decoder the artifact's users run: LLMPipeline with
        its recorded attention backend (end-of-text never picked among the first `min_new_tokens`; sampling by its
        sampler, seeded from torch's initial seed). Greedy tokens are checked against effkit's loop
        (`check_tokens`). Where LLMPipeline cannot be built, effkit's loop decodes (the generation note says so)."""
        ids = input_ids.cpu().long().numpy()
        check_length(ids.shape[1], self.config.n_positions, max_new_tokens)
        key, _ = self.decoding()
        lookup = self.lookup_k(ids.shape[0], do_sample, kwargs)
        if self.pipeline(LOOKUP if lookup else key) is None:
            if lookup:
                raise EffkitError(f"openvino_genai.LLMPipeline with prompt lookup cannot be built for {self.path} "
                                  f"({self.why_no_pipeline(LOOKUP)}); decode without it (prompt_lookup_num_tokens=0)")
            return torch.from_numpy(self.loop_generate(ids, max_new_tokens, min_new_tokens, do_sample, top_k,
                                                       temperature, streamer))
        sampling = (top_k, temperature, torch.initial_seed()) if do_sample else None
        new = self.pipeline_generate(ids, max_new_tokens, key, min_new_tokens, sampling, lookup)
        if not do_sample:
            self.check_tokens(ids, new, LOOKUP if lookup else key, min_new_tokens)
        stream_after(streamer, torch.from_numpy(ids), torch.from_numpy(new))  # LLMPipeline streams text, one row only
        return torch.from_numpy(np.concatenate([ids, new], axis=1))


def _check_line(c: dict[str, Any]) -> str:
    where = f"batch {c['batch']}, {c['tokens']} tokens, {c['attention']}"
    if c["equal"]:
        return f"equal ({where})"
    return (f"DIFFERENT from new token {c['first_difference']} ({where}; {c['inference_precision']} inference: "
            "flagged, the two round differently)")
