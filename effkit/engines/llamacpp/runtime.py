"""`LlamaCppCausalLM`: a GGUF file run through llama.cpp's server (`xllamacpp.Server`, prebuilt CPU wheels of
llama.cpp with its server API) behind the few methods effkit's measurement code calls on a model
(`model(ids).logits`, `generate`, `config`, `eval`).

What llama.cpp computes, and how effkit reads it through xllamacpp (which exposes llama.cpp's server, not its C
API): greedy and sampled decoding is the server's completion route (`Server.handle_completions`, the OpenAI-style
`/v1/completions`), several prompts in one request running as parallel sequences in one batch per step (continuous
batching, as `llama-server -np 12` runs them); the generated ids come back in its log-probabilities. The server
returns no logits of the prompt positions, so the held-out loss reads llama.cpp's final hidden states (after the last
LayerNorm: its `/embeddings` route with pooling `none`, on the server's own loopback port) and multiplies them by the
LM head as the GGUF stores it, dequantized by gguf-py, in numpy. Prefill is the completion route with one new token
(the prompts' forward and the first token: what llama.cpp computes, logits of the last position only)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from effkit.engines.shared import check_length, load_or_fail, stream_after
from effkit.errors import EffkitError
from effkit.measure.engine_model import EngineModel

GGUF_DESC = "gguf.json"
GGUF_FILE = "model.gguf"
DECODE_SLOTS = 12  # the server's parallel sequences at least: the largest batch of the built-in workloads
PORTABILITY = ("portable: llama.cpp loads model.gguf alone, tokenizer included (llama-cli -m, llama-server -m, "
               "xllamacpp.Server)")
REWRITE = "write it again (effkit export --format gguf)"


def llamacpp_unavailable() -> str | None:
    """None if llama.cpp's bindings (gguf-py to write, xllamacpp to run) import here, else the reason in one line."""
    try:
        import gguf  # noqa: F401
        import xllamacpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure (a missing wheel, a missing libgomp) means: not here
        return (f"llama.cpp's bindings do not import ({type(e).__name__}: {str(e)[:100]}); pip install gguf "
                "xllamacpp (effkit[quant])")
    return None


def require() -> None:
    if reason := llamacpp_unavailable():
        raise EffkitError(f"llama.cpp cannot run here: {reason}")




def physical_cores() -> int:
    """llama.cpp's own default thread count on this machine (`cpu_get_num_math`: one thread per physical core,
    counted from the CPUs' thread siblings, as llama.cpp counts them on Linux)."""
    root = Path("/sys/devices/system/cpu")
    siblings = {p.read_text().strip() for p in root.glob("cpu[0-9]*/topology/thread_siblings") if p.is_file()}
    return len(siblings) or os.cpu_count() or 1


def slots() -> int:
    """The server's parallel sequences: enough for the largest batch of every workload (a plug-in's too), so that a
    batch decodes as one batch per step rather than queueing."""
    from effkit import workloads

    return max([DECODE_SLOTS, *(w.batch for w in workloads.all_())])


def settle_after(threads: int) -> float:
    """The settle rule of every engine: llama.cpp's CPU backend runs its threads under OpenMP, whose idle threads
    spin-wait after a parallel region; with more than one, the machine idles `timing.SETTLE_S` after it is timed."""
    from effkit.measure.timing import SETTLE_S

    return SETTLE_S if threads > 1 else 0.0


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server's loopback port: never a proxy


class LlamaServer:
    """One llama.cpp server in this process (`xllamacpp.Server`): `slots` parallel sequences of `context` tokens
    each, `threads` CPU threads for decoding and for prompts; with `embeddings`, its per-token final hidden states
    are served too (pooling none); with `exact` (the gate's), its KV cache holds f32 and flash attention is off
    (llama.cpp's default f16 cache rounds keys and values, and its CPU flash attention computes in f16). llama.cpp's
    own defaults otherwise, but its prompt cache off (every timed call does its whole work)."""

    def __init__(self, gguf_path: Path, threads: int, slots: int, context: int, embeddings: bool = False,
                 exact: bool = False):
        import xllamacpp

        p = xllamacpp.CommonParams()
        p.model.path = str(gguf_path)
        p.n_parallel = slots
        p.n_ctx = slots * context
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
        p.cache_ram_mib = 0
        p.verbosity = 0  # llama.cpp's log is its errors only
        if exact:  # the conversion, not the f16 arithmetic llama.cpp chooses at run time
            p.cache_type_k = p.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
            p.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if embeddings:
            p.embedding = True
            p.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_NONE
            p.n_batch = p.n_ubatch = max(512, context)  # a sequence's hidden states come from one micro-batch
        self.settings = {"threads": threads, "parallel": slots, "ctx": slots * context, "batch": p.n_batch,
                         "ubatch": p.n_ubatch}
        with load_or_fail(f"llama.cpp cannot load {gguf_path}", REWRITE):  # it says no more than that
            self.server = xllamacpp.Server(p)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request to the completion route, checked: every choice, or a one-line error with llama.cpp's own."""
        r = self.server.handle_completions(body)
        if not isinstance(r, dict) or "error" in r or "choices" not in r:
            err = r.get("error", r) if isinstance(r, dict) else r
            raise EffkitError(f"llama.cpp's server refused the completion: {str(err)[:200]}")
        return r

    def post(self, route: str, body: dict[str, Any]) -> Any:
        """A request to one of the server's own routes on its loopback port (those xllamacpp does not wrap)."""
        req = urllib.request.Request(self.server.listening_address + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with _LOCAL.open(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EffkitError(f"llama.cpp's server refused {route}: {e.read()[:200].decode('utf-8', 'replace')}") \
                from None
        except (urllib.error.URLError, OSError) as e:
            raise EffkitError(f"llama.cpp's server at {self.server.listening_address} cannot be reached for {route} "
                              f"({type(e).__name__}: {str(e)[:100]})") from None


def greedy_body() -> dict[str, Any]:
    """Greedy decoding as a request: the top token, end-of-text never picked (so every engine decodes the same
    number of tokens), the prompt not served from a cache."""
    return {"temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": False}


def sampling_body(top_k: int | None, temperature: float, seed: int) -> dict[str, Any]:
    """Top-k / temperature sampling as PyTorch's generate does it: llama.cpp's top-p (0.95) and min-p (0.05) defaults
    switched off."""
    return {"temperature": max(temperature, 1e-6), "top_k": top_k or 0, "top_p": 1.0, "min_p": 0.0, "seed": seed,
            "cache_prompt": False}


class LlamaCppCausalLM(EngineModel):
    """A GGUF file run by llama.cpp behind effkit's model interface. It holds no PyTorch parameters: `n_params` is
    the source's parameter count. Its two servers start on first use: one decodes and prefills (as llama.cpp's users
    run it), one serves the final hidden states that the held-out loss needs."""

    compilable = False  # llama.cpp runs its own kernels

    def __init__(self, gguf_path: Path, config, description: dict[str, Any] | None = None,
                 threads: int | None = None, exact: bool = False):
        super().__init__()
        require()
        self.gguf = Path(gguf_path)
        self.config = config
        self.description = description or {}
        self.n_params = int(self.description.get("params", 0))
        self.threads = threads or torch.get_num_threads()
        self.slots = slots()
        self.settle_s = settle_after(self.threads)
        self.exact = exact  # an f32 KV cache (the gate's), not llama.cpp's default f16
        self._servers: dict[str, LlamaServer] = {}
        self._head = None

    @classmethod
    def open(cls, path: str | Path) -> LlamaCppCausalLM:
        from transformers import GPT2Config

        path = Path(path)
        require()
        try:
            desc = json.loads((path / GGUF_DESC).read_text())
            config = GPT2Config.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise EffkitError(f"{path} is not a complete llama.cpp artifact ({type(e).__name__}); {REWRITE}") from None
        if not isinstance(desc, dict):
            raise EffkitError(f"{path / GGUF_DESC} is not a JSON object; {REWRITE}")
        if not (path / GGUF_FILE).is_file():
            raise EffkitError(f"{path} has no {GGUF_FILE}; {REWRITE}")
        model = cls(path / GGUF_FILE, config, desc)
        model.path = path
        return model

    def server(self, role: str = "decode") -> LlamaServer:
        if role not in self._servers:
            self._servers[role] = LlamaServer(self.gguf, self.threads, self.slots, self.config.n_positions,
                                              embeddings=role == "logits", exact=self.exact)
        return self._servers[role]

    def settings(self) -> dict[str, Any]:
        """The decoding server's settings (what effkit times it with)."""
        return self.server().settings

    def head(self) -> Any:
        """The LM head as the GGUF stores it (its own `output.weight`, else the tied token embedding), dequantized
        by gguf-py: (vocabulary, n_embd) float32."""
        if self._head is None:
            import gguf

            found = {t.name: t for t in gguf.GGUFReader(str(self.gguf)).tensors
                     if t.name in ("output.weight", "token_embd.weight")}
            t = found.get("output.weight") or found["token_embd.weight"]
            head = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            self._head = np.ascontiguousarray(head.reshape(self.config.vocab_size, self.config.n_embd),
                                              dtype=np.float32)
        return self._head

    def hidden(self, rows: list[list[int]]) -> Any:
        """llama.cpp's final hidden states of every position of every row: (rows, tokens, n_embd) float32."""
        out = self.server("logits").post("/embeddings", {"content": rows})
        if not isinstance(out, list) or len(out) != len(rows):
            raise EffkitError(f"llama.cpp's /embeddings answered {str(out)[:120]} for {len(rows)} sequences")
        out = sorted(out, key=lambda r: r["index"])
        return np.asarray([r["embedding"] for r in out], dtype=np.float32)

    def forward(self, input_ids, **_: Any) -> SimpleNamespace:
        check_length(input_ids.shape[-1], self.config.n_positions)
        rows = input_ids.detach().cpu().long().tolist()
        logits = self.hidden(rows) @ self.head().T
        return SimpleNamespace(logits=torch.from_numpy(logits))

    def complete(self, rows: list[list[int]], new_tokens: int, body: dict[str, Any] | None = None,
                 ids: bool = False) -> list[list[int]] | dict[str, Any]:
        """`new_tokens` from each row, all rows as parallel sequences of one request; with `ids`, the new token ids
        of each row (read from the log-probabilities), else the server's answer."""
        check_length(min(len(r) for r in rows), self.config.n_positions)
        check_length(max(len(r) for r in rows), self.config.n_positions, new_tokens)
        request = {"prompt": rows, "max_tokens": new_tokens, **(body or greedy_body())}
        if ids:
            request["logprobs"] = 1
        r = self.server().complete(request)
        choices = sorted(r["choices"], key=lambda c: c["index"])
        if len(choices) != len(rows):
            raise EffkitError(f"llama.cpp's server answered {len(choices)} completions for {len(rows)} prompts")
        if not ids:
            return r
        return [[int(t["id"]) for t in (c.get("logprobs") or {}).get("content", [])] for c in choices]

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **_: Any):
        """`max_new_tokens` new tokens by llama.cpp (greedy, or top-k / temperature sampling seeded from torch's
        global generator); with `min_new_tokens`, end-of-text is never picked (llama.cpp's `ignore_eos`, as
        transformers' `min_new_tokens` for PyTorch), else a row that ends early is padded with end-of-text."""
        ids = input_ids.cpu().long()
        body = greedy_body()
        if do_sample:
            body = sampling_body(top_k, temperature, int(torch.randint(0, 2**31 - 1, (1,))))
        body["ignore_eos"] = bool(min_new_tokens)
        new = self.complete(ids.tolist(), max_new_tokens, body, ids=True)
        pad = self.config.eos_token_id if self.config.eos_token_id is not None else 0
        new = torch.tensor([r[:max_new_tokens] + [pad] * (max_new_tokens - len(r)) for r in new], dtype=torch.long)
        stream_after(streamer, ids, new)  # llama.cpp decodes the whole request at once: the text is streamed after
        return torch.cat([ids, new], dim=1)

