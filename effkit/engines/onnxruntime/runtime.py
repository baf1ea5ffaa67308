"""ONNX Runtime running an ONNX artifact: its CPU session (`session`, configured as its users get it), one step of
the with-past graph (`step`), and `OnnxCausalLM`, which runs the artifact behind the few methods effkit's
measurement code calls on a model (`model(ids).logits`, `generate` with the KV cache, `config`, `eval`).
ONNX Runtime has no speculative decoding of its own: `generate` runs effkit's (`engines.speculative`, `verifier`
checks a draft's k tokens in one run of the with-past graph) when asked with transformers' keywords or where the
artifact records a measured k (`speculative.SETTINGS`, applied at batch 1, where it was measured).

Artifacts of older effkit versions (no past inputs) still load; generation with them recomputes the prefix, and
reports say so (`GENERATION_NOTE`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from effkit.engines import speculative
from effkit.engines.decoder_step import past_names
from effkit.engines.onnxruntime.graph import ONNX_DESC, ONNX_FILE, int8_counts, int8_layers, require_onnx
from effkit.engines.shared import check_length, decode_loop, load_or_fail
from effkit.errors import EffkitError
from effkit.measure.engine_model import EngineModel
from effkit.measure.timing import SETTLE_S  # idle seconds after timing a spinning thread pool

GENERATION_NOTE = ("ONNX artifact of an older effkit, exported without past key/values: generation recomputes the "
                   "whole prefix for every new token (measured as it is); export the parent again for the KV cache")


def empty_past(config, batch: int) -> dict[str, np.ndarray]:
    shape = (batch, config.n_head, 0, config.n_embd // config.n_head)
    return {name: np.zeros(shape, np.float32) for name in past_names(config.n_layer)}


def step(sess, input_ids: np.ndarray, past: dict[str, np.ndarray], past_len: int) -> tuple[np.ndarray, dict]:
    """One run of the with-past graph: the logits of `input_ids` after `past_len` cached positions, and the new
    cache (no padding: every position attended)."""
    b, n = input_ids.shape
    feed = {"input_ids": input_ids, "attention_mask": np.ones((b, past_len + n), np.int64),
            "position_ids": np.broadcast_to(np.arange(past_len, past_len + n, dtype=np.int64), (b, n)), **past}
    out = sess.run(None, feed)
    return out[0], dict(zip(past, out[1:], strict=True))


def stepper(sess, config, with_past: bool = True):
    """`shared.decode_loop`'s step over the graph of `sess`: with past key/values, the tokens not yet in the cache
    run against it; without (an older effkit's export), the whole prefix is recomputed."""
    past: dict[str, np.ndarray] = {}

    def run(ids: np.ndarray, done: int) -> np.ndarray:
        nonlocal past
        if not with_past:
            return sess.run(None, {"input_ids": ids})[0][:, -1, :]
        logits, past = step(sess, np.ascontiguousarray(ids[:, done:]),
                            past if done else empty_past(config, ids.shape[0]), done)
        return logits[:, -1, :]
    return run


def verifier(sess, config):
    """`speculative.speculative_row`'s verify over the graph of `sess`, for one row with its own cache: the cache
    rolled back to its first `cached` positions (the drafts the target rejected dropped), then `tokens` run after
    them."""
    past = empty_past(config, 1)

    def verify(tokens: np.ndarray, cached: int) -> np.ndarray:
        nonlocal past
        if next(iter(past.values())).shape[2] > cached:
            past = {n: np.ascontiguousarray(v[:, :, :cached]) for n, v in past.items()}
        logits, past = step(sess, tokens[None], past, cached)
        return logits[0]
    return verify


def session(path: Path):
    """An ONNX Runtime CPU session with as many intra-op threads as torch uses, configured as ONNX Runtime's users
    get it: its idle threads spin-wait between runs (turning that off makes batch-1 decoding markedly slower, so a
    session without it would not be what users run; docs/benchmarks.md); interleaved timing leaves the machine idle
    for `SETTLE_S` after it (`timing.settle_time`), so the spinning does not slow whichever model is timed next."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")  # ONNX Runtime's default, said explicitly
    with load_or_fail(f"ONNX Runtime cannot open {path}", "export the parent again"):
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class OnnxCausalLM(EngineModel):
    """An ONNX artifact behind the interface effkit's measurement code uses: `model(ids).logits` (a torch tensor),
    `generate(...)` (greedy or top-k sampling, with the KV cache), `config`, `eval()`. It holds no PyTorch
    parameters: `n_params` gives the parent's parameter count."""

    compilable = False  # torch.compile has nothing to do: ONNX Runtime optimizes the graph
    settle_s = SETTLE_S  # its spinning threads keep the cores for a while after a run (`timing.SETTLE_S`)

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import GPT2Config

        path = Path(path)
        require_onnx()
        try:
            self.description = json.loads((path / ONNX_DESC).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise EffkitError(f"{path / ONNX_DESC} is unreadable ({type(e).__name__}); export the parent again") \
                from None
        if not (path / ONNX_FILE).is_file():
            raise EffkitError(f"{path} has no {ONNX_FILE}; export the parent again")
        self.config = GPT2Config.from_pretrained(path)
        self.n_params = int(self.description.get("params", 0))
        self.session = session(path / ONNX_FILE)
        self.path = path
        self.with_past = "past_key_values.0.key" in {i.name for i in self.session.get_inputs()}
        self.generation_note = None if self.with_past else GENERATION_NOTE
        self.speculative = speculative.read_settings(path)  # a measured draft and k, or None
        self.speculative_stats: speculative.SpecStats | None = None  # of the last speculative generate

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        check_length(input_ids.shape[-1], self.config.n_positions)
        ids = input_ids.detach().cpu().long().numpy()
        if self.with_past:
            logits, _ = step(self.session, ids, empty_past(self.config, ids.shape[0]), 0)
        else:
            logits = self.session.run(None, {"input_ids": ids})[0]
        return SimpleNamespace(logits=torch.from_numpy(logits))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **kwargs: Any) -> torch.Tensor:
        """Exactly `max_new_tokens` new tokens (never stops early), with the KV cache (the prefix recomputed each
        step for an artifact without past inputs), by `shared.decode_loop`: end-of-text is never picked among the
        first `min_new_tokens`; sampling draws from torch's global generator (seed it first); greedy steps pick
        tokens in numpy, since a torch operation large enough to run on torch's threads would wait for a core that
        ONNX Runtime's spinning threads hold. Greedy decoding is speculative (`speculative.speculative_loop`, the
        same tokens) with transformers' `prompt_lookup_num_tokens=k` or `assistant_model=` (a draft) and
        `num_assistant_tokens=k`, or at batch 1 where the artifact records a k (`prompt_lookup_num_tokens=0`: plain);
        its statistics land in `speculative_stats`."""
        ids = input_ids.cpu().long().numpy()
        check_length(ids.shape[1], self.config.n_positions, max_new_tokens)
        if (spec := self._draft(kwargs, ids.shape[0], do_sample)) is not None:
            out, self.speculative_stats = speculative.speculative_loop(
                lambda: verifier(self.session, self.config), ids, max_new_tokens, *spec, self.config.eos_token_id,
                min_new_tokens, streamer)
            return torch.from_numpy(out)
        run = stepper(self.session, self.config, self.with_past)
        return torch.from_numpy(decode_loop(run, ids, max_new_tokens, self.config.eos_token_id, min_new_tokens,
                                            do_sample, top_k, temperature, streamer))

    def _draft(self, kwargs: dict[str, Any], batch: int, do_sample: bool) -> tuple[Any, int] | None:
        """The draft and k of a `generate` call: its own keywords, else the artifact's recorded ones at batch 1."""
        asked = speculative.draft_of(kwargs)
        if asked is not None and (do_sample or not self.with_past):
            raise EffkitError("effkit's speculative decoding in ONNX Runtime is greedy, with the KV cache: "
                              "drop --temperature, or export the parent again" if self.with_past else
                              "this ONNX artifact has no KV cache; export the parent again")
        if asked is None and self.speculative and batch == 1 and not do_sample and self.with_past \
                and "prompt_lookup_num_tokens" not in kwargs:  # an explicit 0 asks for plain decoding
            return speculative.draft_of(speculative.generate_kwargs(self.speculative["draft"], self.speculative["k"]))
        return asked

def quantized_layers(model: OnnxCausalLM) -> int:
    """The quantized operators of a reloaded ONNX artifact's graph (`int8_layers` of its `int8_counts`)."""
    return int8_layers(int8_counts(model.path / ONNX_FILE))
