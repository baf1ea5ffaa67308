"""llama.cpp artifacts: one GGUF file written by effkit's own converter (gguf-py's `GGUFWriter`, the tensors named
and laid out as llama.cpp's `convert_hf_to_gguf.py` writes a GPT-2, the byte-level BPE tokenizer with its merges
inside), stored as f16, Q8_0 or Q4_0 (`gguf.quants`), and `LlamaCppCausalLM`, which runs one through llama.cpp's
server (`xllamacpp.Server`, prebuilt CPU wheels of llama.cpp with its server API) behind the few methods effkit's
measurement code calls on a model (`model(ids).logits`, `generate`, `config`, `eval`).

The layout (llama.cpp `src/models/gpt2.cpp`): `token_embd`, `position_embd`, `output_norm` (weight, bias), and per
block `attn_norm`, `attn_qkv`, `attn_output`, `ffn_norm`, `ffn_up`, `ffn_down`, each with its bias; `output.weight`
only where the LM head is not tied to the token embedding (llama.cpp reuses the embedding otherwise). GGUF stores a
matrix as (rows of the input dimension) x (output dimension): the numpy layout of a `torch.nn.Linear` weight, which
is effkit's layout in memory (Hugging Face's GPT-2 keeps Conv1D weights transposed; `load_model` turns them into
Linear). `gpt2.feed_forward_length` is the model's real MLP width (llama.cpp's converter writes 4 x n_embd, which a
row-pruned model is not). Norms, biases and the position embedding stay f32, as the converter keeps them.

Quantized types store each row in blocks of 32 values (Q8_0: 32 int8 and one f16 scale; Q4_0: 32 4-bit values
and one scale): a model whose widths are not multiples of 32 is refused in one line naming the fix. In Q4_0 the
tied embedding / LM head (and an untied `output.weight`) is stored Q6_K, as llama-quantize stores it: 6-bit values
in super-blocks of 256 (`QK_K`), quantized by llama.cpp's own quantizer (`ggml_quantize_chunk` in the ggml that
xllamacpp's library carries, called through ctypes; gguf-py only dequantizes K-quants). Where n_embd is not a
multiple of 256, or that quantizer cannot be reached, the tensor is stored Q8_0 instead (llama-quantize's own
fallback for Q6_K), the reason said on stderr in one line and recorded in `gguf.json` (`head`, `quantizer`).

What llama.cpp computes, and how effkit reads it through xllamacpp (which exposes llama.cpp's server, not its C
API): greedy and sampled decoding is the server's completion route (`Server.handle_completions`, the OpenAI-style
`/v1/completions`), several prompts in one request running as parallel sequences in one batch per step (continuous
batching, as `llama-server -np 12` runs them); the generated ids come back in its log-probabilities. The server
returns no logits of the prompt positions, so the held-out loss reads llama.cpp's final hidden states (after the last
LayerNorm: its `/embeddings` route with pooling `none`, on the server's own loopback port) and multiplies them by the
LM head as the GGUF stores it, dequantized by gguf-py, in numpy. Prefill is the completion route with one new token
(the prompts' forward and the first token: what llama.cpp computes, logits of the last position only).

Nothing is written unless it passes a parity gate: the same model written as f32 GGUF, run with an f32 KV cache,
reproduces PyTorch's logits within `GGUF_RTOL` of the largest logit (ONNX's rule, widened for what ggml's CPU kernels
round) and PARITY_TOKENS greedy tokens with llama.cpp's KV cache, and llama.cpp's tokenizer cuts a probe text into
the tokenizer's ids; an f16 file must then decode PyTorch's greedy tokens itself, with llama.cpp's default f16 cache.
Q8_0 and Q4_0 change the numbers by design (the rule of effkit's other int8 exports: the unquantized conversion is
gated, the quantized file's loss is measured by the stage that writes it and by the bench); how far their greedy
tokens follow PyTorch's is recorded.

An artifact folder: `model.gguf` (all llama.cpp needs), `gguf.json` (how it was written, its parity, what it runs
with), the Hugging Face `config.json` and tokenizer files (effkit's tokenizer and context), `effkit.json`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import Engine, as_exported
from effkit.engines.decoder_step import PARITY_TOKENS, probe_ids
from effkit.errors import EffkitError

GGUF_DESC = "gguf.json"
GGUF_FILE = "model.gguf"
TYPES = ("f16", "q8_0", "q4_0")  # what `--type` stores the matrices in
BLOCK = 32  # values per quantization block of Q8_0 and Q4_0 (a row must be a multiple of it)
DECODE_SLOTS = 12  # the server's parallel sequences at least: the largest batch of the built-in workloads
PORTABILITY = ("portable: llama.cpp loads model.gguf alone, tokenizer included (llama-cli -m, llama-server -m, "
               "xllamacpp.Server)")
REWRITE = "write it again (effkit export --format gguf)"
QUANTIZED = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
HEAD_NAMES = ("token_embd.weight", "output.weight")  # the tied embedding / LM head, and an untied head
QK_K = 256  # values per Q6_K super-block (ggml's QK_K): a Q6_K row is a multiple of it
Q6_K_BYTES = 210  # bytes per Q6_K super-block: 128 low 4-bit halves, 64 high 2-bit pairs, 16 int8 scales, f16 scale
# max |logit difference| allowed between llama.cpp running the f32 GGUF and PyTorch, relative to max(1, max |PyTorch
# logit|): ten times the ONNX export's EXPORT_RTOL (`decoder_step`), because ggml's CPU kernels round inside an f32
# graph (its GELU reads a table indexed by the f16 input, GGML_GELU_FP16 in ggml-cpu's vec.h; its flash attention
# converts to f16), while a layout error (a transposed matrix, a wrong position, epsilon or attention scale) moves
# logits by a tenth or more
GGUF_RTOL = 1e-3
# the same bound for the f16 file run as llama.cpp runs it: f16 weights keep 11 significant bits and its default KV
# cache holds f16, an order of magnitude more rounding than the f32 graph, and still far below a wrong tensor's
F16_RTOL = 1e-2


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


# ------------------------------------------------------------------------------ writing

def tokenizer_fields(tokenizer, vocab_size: int) -> dict[str, Any]:
    """What GGUF's `gpt2` tokenizer holds, read from a fast tokenizer's own JSON: tokens by id (padded to the model's
    vocabulary as llama.cpp's converter pads), their types (special tokens are control tokens), the merges (llama.cpp
    refuses a BPE vocabulary without them) and the end-of-text / beginning ids the tokenizer itself names."""
    import gguf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EffkitError(f"llama.cpp's GPT-2 tokenizer needs a byte-level BPE (a fast tokenizer); this one is a "
                          f"{type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or not model.get("merges"):
        raise EffkitError(f"llama.cpp's GPT-2 tokenizer needs a BPE vocabulary with its merges; this tokenizer's "
                          f"model is {model.get('type')!r} with {len(model.get('merges') or [])} merges")
    kinds = [pre.get("type"), *[p.get("type") for p in pre.get("pretokenizers", []) or []]]
    if "ByteLevel" not in kinds:
        raise EffkitError(f"llama.cpp's GPT-2 tokenizer splits text as GPT-2's byte-level BPE does; this tokenizer's "
                          f"pre-tokenizer is {pre.get('type')!r}")
    tokens: list[str | None] = [None] * vocab_size
    types = [gguf.TokenType.NORMAL] * vocab_size
    entries = [(t, i, None) for t, i in model["vocab"].items()]
    entries += [(a["content"], a["id"], a.get("special", False)) for a in spec.get("added_tokens", [])]
    for text, i, special in entries:
        if not 0 <= i < vocab_size:
            raise EffkitError(f"the tokenizer's token {text!r} has id {i}, beyond the model's vocabulary "
                              f"({vocab_size})")
        tokens[i] = text
        if special is not None:
            types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:  # ids the tokenizer never produces (a vocabulary padded for speed)
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    merges = [" ".join(m) if isinstance(m, list | tuple) else str(m) for m in model["merges"]]
    eos = tokenizer.eos_token_id
    if eos is None:
        raise EffkitError("the tokenizer has no end-of-text token, which llama.cpp needs to know; add one")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    return {"tokens": tokens, "types": types, "merges": merges, "bos": int(bos), "eos": int(eos)}


def check_model(model) -> None:
    """What llama.cpp's GPT-2 graph computes, and this model must too (one line for what it does not)."""
    c = model.config
    act = getattr(c, "activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise EffkitError(f"this GPT-2 uses activation {act!r}; llama.cpp's GPT-2 computes the tanh GELU (gelu_new)")
    for flag, wrong in (("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                        ("scale_attn_weights", False)):
        if bool(getattr(c, flag, not wrong)) == wrong:
            raise EffkitError(f"this GPT-2 sets {flag}={wrong}, which llama.cpp's GPT-2 graph does not compute")
    if getattr(model.lm_head, "bias", None) is not None:
        raise EffkitError("this model's LM head has a bias, which llama.cpp's GPT-2 graph does not add")


def tensors(model) -> list[tuple[str, Any, bool]]:
    """(GGUF name, float32 array in the numpy layout GGUF stores, whether it is a matrix a type may quantize), in
    the order llama.cpp's converter writes them."""
    t = model.transformer

    def a(x) -> Any:
        return x.detach().float().cpu().numpy()

    out = [("token_embd.weight", a(t.wte.weight), True), ("position_embd.weight", a(t.wpe.weight), False)]
    if model.lm_head.weight.data_ptr() != t.wte.weight.data_ptr():  # untied: llama.cpp reads its own head
        out.append(("output.weight", a(model.lm_head.weight), True))
    out += [("output_norm.weight", a(t.ln_f.weight), False), ("output_norm.bias", a(t.ln_f.bias), False)]
    for i, b in enumerate(t.h):
        p = f"blk.{i}."
        for name, module in (("attn_norm", b.ln_1), ("attn_qkv", b.attn.c_attn), ("attn_output", b.attn.c_proj),
                             ("ffn_norm", b.ln_2), ("ffn_up", b.mlp.c_fc), ("ffn_down", b.mlp.c_proj)):
            weight = module.weight
            if weight.dim() == 2 and not isinstance(module, torch.nn.Linear):  # a Conv1D: stored (in, out)
                weight = weight.t()
            out += [(p + name + ".weight", a(weight), weight.dim() == 2), (p + name + ".bias", a(module.bias), False)]
    return out


def refuse_shape(model, wtype: str) -> None:
    """A quantized type stores rows in blocks of BLOCK values: a one-line refusal naming the first width that is not
    a multiple of it, and the fix."""
    if wtype not in QUANTIZED:
        return
    c = model.config
    widths = {"the residual width n_embd": c.n_embd,
              "the MLP width n_inner": c.n_inner or 4 * c.n_embd}
    for what, n in widths.items():
        if n % BLOCK:
            raise EffkitError(f"--type {wtype} stores each weight row in blocks of {BLOCK} values, and {what} is {n}; "
                              f"export it as f16 (--type f16), or prune with widths rounded to {BLOCK}")


_GGML: dict[str, Any] = {}  # llama.cpp's quantizer, once found: {"lib": the CDLL} or {"why": why not}


def ggml_quantizer() -> tuple[Any, str | None]:
    """llama.cpp's own quantizer: the ggml inside xllamacpp's library (`xllamacpp.abi3.so`), its
    `ggml_quantize_chunk` and type-size functions given their C signatures through ctypes, and checked to describe
    Q6_K as gguf-py does (enum value 14, 256 values in 210 bytes per block) before anything is quantized (a wrong
    call aborts in ggml's asserts). (library, None), or (None, the reason in one line)."""
    if not _GGML:
        import ctypes

        try:
            import gguf
            import xllamacpp

            where = Path(xllamacpp.__file__).parent / "xllamacpp.abi3.so"
            lib = ctypes.CDLL(str(where))
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_blck_size.argtypes = lib.ggml_type_size.argtypes = [ctypes.c_int]
            lib.ggml_blck_size.restype = ctypes.c_int64
            lib.ggml_type_size.restype = ctypes.c_size_t
            q6_k = int(gguf.GGMLQuantizationType.Q6_K)
            theirs = (int(lib.ggml_blck_size(q6_k)), int(lib.ggml_type_size(q6_k)))
            if theirs != (QK_K, Q6_K_BYTES) or tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K]) != theirs:
                _GGML["why"] = (f"llama.cpp's ggml type {q6_k} holds {theirs[0]} values in {theirs[1]} bytes, not "
                                f"Q6_K's {QK_K} in {Q6_K_BYTES}")
            else:
                _GGML["lib"] = lib
        except Exception as e:  # noqa: BLE001 - a missing wheel, library or symbol: Q8_0 then, said why
            _GGML["why"] = (f"llama.cpp's quantizer (ggml_quantize_chunk in xllamacpp's library) cannot be reached "
                            f"({type(e).__name__}: {str(e)[:100]})")
    return _GGML.get("lib"), _GGML.get("why")


def q6_k_unavailable(width: int) -> str | None:
    """None if rows of `width` values can be stored Q6_K here, else why not in one line."""
    if width % QK_K:
        return f"n_embd {width} is not a multiple of {QK_K} (Q6_K's super-block)"
    return ggml_quantizer()[1]


def quantize_q6_k(array: Any) -> Any:
    """A float32 (rows, width) matrix as Q6_K by llama.cpp's own quantizer (`ggml_quantize_chunk`, no importance
    matrix: what llama-quantize does without one), row blocks on torch's threads (ctypes lets go of the GIL): uint8
    (rows, width / 256 x 210), the bytes GGUF stores, as gguf-py's quantizers return them. EffkitError where
    `q6_k_unavailable` says why."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf

    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim != 2:
        raise EffkitError(f"Q6_K quantizes a matrix; this array has shape {x.shape}")
    rows, width = x.shape
    if reason := q6_k_unavailable(width):
        raise EffkitError(f"cannot store Q6_K: {reason}")
    lib, _ = ggml_quantizer()
    row_bytes = width // QK_K * Q6_K_BYTES
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    q6_k = int(gguf.GGMLQuantizationType.Q6_K)
    step = max(1, -(-rows // max(1, torch.get_num_threads())))

    def chunk(first: int) -> int:  # ggml writes rows [first, first + n) at their own offset in `out`
        n = min(step, rows - first)
        return int(lib.ggml_quantize_chunk(q6_k, x.ctypes.data, out.ctypes.data, first * width, n, width, None))

    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        written = sum(pool.map(chunk, range(0, rows, step)))
    if written != out.nbytes:
        raise EffkitError(f"llama.cpp's Q6_K quantizer wrote {written} bytes for a ({rows}, {width}) matrix, not "
                          f"{out.nbytes}")
    return out


def head_storage(width: int, wtype: str) -> tuple[str | None, str]:
    """How a `wtype` file stores the tied embedding / LM head of a model `width` wide: (the GGUF type name where it
    differs from the other matrices', else None; one line saying how, and why where Q6_K could not be used)."""
    if wtype != "q4_0":
        return None, ""
    if reason := q6_k_unavailable(width):
        return "Q8_0", (f"the tied embedding / LM head in Q8_0, not llama-quantize's Q6_K: {reason} "
                        "(llama-quantize's own fallback)")
    return "Q6_K", ("the tied embedding / LM head in Q6_K (super-blocks of 256) by llama.cpp's own quantizer "
                    "(ggml_quantize_chunk, no importance matrix), as llama-quantize stores it")


def write_gguf(path: Path, model, tokenizer, wtype: str, record: dict[str, str] | None = None,
               via_f16: bool = False) -> dict[str, int]:
    """Write `model` (effkit's Linear form) and its tokenizer to the GGUF file `path`, matrices as `wtype` (f32 for the
    gate, f16, q8_0 or q4_0; in q4_0 the tied embedding / LM head as `head_storage` says: Q6_K, else Q8_0, the
    reason on stderr in one line). `via_f16`: quantize the f16-rounded weights, as llama-quantize does with an f16
    file. `record`: effkit's own keys (`effkit.*`, which llama.cpp ignores). Returns the tensors written, counted by
    GGUF type."""
    import gguf

    Q = gguf.GGMLQuantizationType
    types = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    check_model(model)
    refuse_shape(model, wtype)
    c = model.config
    tok = tokenizer_fields(tokenizer, c.vocab_size)
    head, how = head_storage(c.n_embd, wtype)
    if head == "Q8_0":
        import sys

        print(f"effkit: note: {how}", file=sys.stderr)
    w = gguf.GGUFWriter(str(path), "gpt2")
    try:
        w.add_name(Path(getattr(c, "_name_or_path", "") or "effkit").name or "effkit")
        w.add_context_length(c.n_positions)
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(c.n_inner or 4 * c.n_embd)
        w.add_block_count(c.n_layer)
        w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
        w.add_file_type(int(file_types[wtype]))
        if wtype in QUANTIZED:
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(tok["bos"])
        w.add_eos_token_id(tok["eos"])
        w.add_add_bos_token(False)  # GPT-2 prepends nothing to a prompt
        for key, value in (record or {}).items():
            w.add_string(f"effkit.{key}", str(value))
        counts: dict[str, int] = {}
        for name, array, matrix in tensors(model):
            qtype = types[wtype] if matrix else Q.F32
            if head and name in HEAD_NAMES:
                qtype = Q[head]  # the LM head at a higher precision, as llama-quantize keeps it
            if via_f16 and matrix:
                array = array.astype(np.float16).astype(np.float32)
            data = quantize_q6_k(array) if qtype == Q.Q6_K else gguf.quants.quantize(array, qtype)
            if qtype in (Q.F32, Q.F16):
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return counts


def tensor_types(path: Path) -> dict[str, int]:
    """The matrices of a GGUF file counted by stored type, read back from the file."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) == 2 and min(int(d) for d in t.shape) > 1:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# ------------------------------------------------------------------------------ running

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
        try:
            self.server = xllamacpp.Server(p)
        except Exception as e:  # noqa: BLE001 - a file llama.cpp cannot load: it says no more than that
            raise EffkitError(f"llama.cpp cannot load {gguf_path} ({type(e).__name__}: {str(e)[:120]}); "
                              f"{REWRITE}") from None

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


class LlamaCppCausalLM(nn.Module):
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
        self.generation_note = None
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

    def _check_length(self, n: int) -> None:
        if n > self.config.n_positions:
            raise EffkitError(f"{n} tokens exceed the model's context ({self.config.n_positions})")

    def hidden(self, rows: list[list[int]]) -> Any:
        """llama.cpp's final hidden states of every position of every row: (rows, tokens, n_embd) float32."""
        out = self.server("logits").post("/embeddings", {"content": rows})
        if not isinstance(out, list) or len(out) != len(rows):
            raise EffkitError(f"llama.cpp's /embeddings answered {str(out)[:120]} for {len(rows)} sequences")
        out = sorted(out, key=lambda r: r["index"])
        return np.asarray([r["embedding"] for r in out], dtype=np.float32)

    def forward(self, input_ids, **_: Any) -> SimpleNamespace:
        self._check_length(input_ids.shape[-1])
        rows = input_ids.detach().cpu().long().tolist()
        logits = self.hidden(rows) @ self.head().T
        return SimpleNamespace(logits=torch.from_numpy(logits))

    def complete(self, rows: list[list[int]], new_tokens: int, body: dict[str, Any] | None = None,
                 ids: bool = False) -> list[list[int]] | dict[str, Any]:
        """`new_tokens` from each row, all rows as parallel sequences of one request; with `ids`, the new token ids
        of each row (read from the log-probabilities), else the server's answer."""
        self._check_length(max(len(r) for r in rows) + new_tokens - 1)  # the last new token is not fed back
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
        if streamer is not None:  # llama.cpp decodes the whole request at once: the text is streamed after
            streamer.put(ids)
            for k in range(new.shape[1]):
                streamer.put(new[:, k:k + 1])
            streamer.end()
        return torch.cat([ids, new], dim=1)


# ------------------------------------------------------------------------------ the gate and the artifact

def _prompt(tokenizer) -> list[int]:
    from effkit.measure import generation

    return tokenizer(generation.GENERATION_PROMPT).input_ids


@torch.no_grad()
def greedy_agreement(gguf_model: LlamaCppCausalLM, model, prompt, cached: list[int]) -> dict[str, Any]:
    """How far llama.cpp's greedy tokens from `prompt` follow PyTorch's (`cached`), and how far its logits along
    PyTorch's tokens are from PyTorch's: {"equal": the tokens equal before the first difference, "error": the largest
    logit difference, "scale": max(1, the largest PyTorch logit), and where the tokens differ, "gap": PyTorch's margin
    for its own token over llama.cpp's there and "near_tie": whether the gap is within what the error can move (2 x
    error: each of the two logits moves by at most it)}. A near tie is only a tie if the error itself is within the
    caller's bound."""
    tokens = gguf_model.complete(prompt.tolist(), len(cached), ids=True)[0]
    seq = torch.tensor([prompt[0].tolist() + cached])
    at = slice(prompt.shape[1] - 1, seq.shape[1] - 1)  # the logits that chose each new token
    ref, ours = model(seq).logits[0, at], gguf_model(seq).logits[0, at]
    out = {"equal": first_difference(tokens, cached), "error": float((ours - ref).abs().max()),
           "scale": max(1.0, float(ref.abs().max()))}
    if (k := out["equal"]) < len(cached):
        out["gap"] = float(ref[k, cached[k]] - ref[k, tokens[k]]) if k < len(tokens) else float("inf")
        out["near_tie"] = out["gap"] <= 2 * out["error"]
    return out


def agreement_line(a: dict[str, Any], new: int) -> str:
    if a["equal"] == new:
        return f"its {new} greedy tokens equal PyTorch's (largest logit difference along them {a['error']:.1e})"
    return (f"its greedy tokens equal PyTorch's for the first {a['equal']} of {new}; there PyTorch's top two logits "
            f"are {a['gap']:.1e} apart, " + ("within" if a["near_tie"] else "beyond") + " twice the file's largest "
            f"logit difference ({a['error']:.1e})" + (": a near tie its rounding can flip" if a["near_tie"] else ""))


@torch.no_grad()
def check_parity(model, tokenizer, folder: Path, wtype: str, threads: int) -> dict[str, Any]:
    """The gate (see the module doc): the model written as f32 GGUF (a scratch file in `folder`, removed after)
    reproduces PyTorch's logits and greedy tokens in llama.cpp, and llama.cpp tokenizes like `tokenizer`; then the
    `wtype` file `folder/model.gguf` decodes PyTorch's greedy tokens (required for f16, recorded for Q8_0 / Q4_0).
    Greedy tokens may part only at a near tie (`greedy_agreement`: PyTorch's top two logits closer than the file's
    own logit error can move them), which no conversion can settle. A one-line error otherwise."""
    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    reference = model(probe).logits
    cached = model.generate(prompt, use_cache=True, **kw)[0, prompt.shape[1]:].tolist()
    scratch = folder / ".gate-f32.gguf"
    try:
        write_gguf(scratch, model, tokenizer, "f32")
        exact = LlamaCppCausalLM(scratch, c, threads=threads, exact=True)
        diff = float((exact(probe).logits - reference).abs().max())
        allowed = GGUF_RTOL * max(1.0, float(reference.abs().max()))
        if not diff <= allowed:
            raise EffkitError(f"llama.cpp does not reproduce the model from its f32 GGUF (max logit difference "
                              f"{diff:.2e} > {allowed:.2e}, {GGUF_RTOL} of the largest logit); this model cannot be "
                              "converted faithfully")
        f32 = greedy_agreement(exact, model, prompt, cached)
        if f32["error"] > GGUF_RTOL * f32["scale"]:
            raise EffkitError(f"llama.cpp does not reproduce the model from its f32 GGUF along PyTorch's greedy "
                              f"tokens (max logit difference {f32['error']:.2e} > {GGUF_RTOL * f32['scale']:.2e}); "
                              "this model cannot be converted faithfully")
        if f32["equal"] < new and not f32["near_tie"]:
            raise EffkitError(f"llama.cpp's greedy tokens from the f32 GGUF differ from PyTorch's "
                              f"({agreement_line(f32, new)}); this model cannot be converted faithfully")
        text = "The state of the Union is strong, and 2026's budget: 1,234.5 million"
        theirs = exact.server().post("/tokenize", {"content": text, "add_special": False}).get("tokens")
        ours = tokenizer(text).input_ids
        if theirs != ours:
            raise EffkitError(f"llama.cpp tokenizes text differently from the tokenizer written into the GGUF (from "
                              f"token {first_difference(theirs or [], ours)}); this tokenizer cannot be converted")
        del exact
    finally:
        scratch.unlink(missing_ok=True)
    stored = greedy_agreement(LlamaCppCausalLM(folder / GGUF_FILE, c, threads=threads), model, prompt, cached)
    how = (f"the model written as f32 GGUF, run with an f32 KV cache and no flash attention: logits of a (3, "
           f"{probe.shape[1]}) probe batch within {allowed:.2e} of PyTorch's ({GGUF_RTOL} of the largest logit's "
           f"magnitude), {agreement_line(f32, new)} (PyTorch with its KV cache), llama.cpp's tokens of a probe text "
           "equal the tokenizer's")
    if wtype == "f16":
        bound = F16_RTOL * stored["scale"]
        if stored["error"] > bound:
            raise EffkitError(f"llama.cpp's logits from the f16 GGUF differ from PyTorch's by {stored['error']:.2e} > "
                              f"{bound:.2e} ({F16_RTOL} of the largest logit) along PyTorch's greedy tokens; this "
                              "model cannot be stored in f16 faithfully")
        if stored["equal"] < new and not stored["near_tie"]:
            raise EffkitError(f"llama.cpp's greedy tokens from the f16 GGUF differ from PyTorch's "
                              f"({agreement_line(stored, new)}); this model cannot be stored in f16 faithfully")
        how += (f"; then the f16 file, with llama.cpp's defaults: logits along PyTorch's greedy tokens within "
                f"{bound:.2e} ({F16_RTOL} of the largest logit), {agreement_line(stored, new)}")
    else:
        how += f"; then the {QUANTIZED[wtype]} file (its loss measured, not gated): {agreement_line(stored, new)}"
    return {"max_abs_logit_diff": diff, "max_abs_logit_diff_allowed": allowed, "greedy_tokens_equal": f32["equal"],
            "stored_greedy_tokens_equal": stored["equal"], "greedy": {"f32": f32, wtype: stored}, "how": how}


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where `a` and `b` differ (their common length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def load_line(gguf_path: Path, settings: dict[str, Any]) -> str:
    """The command lines that load `gguf_path` with the settings effkit times it with: llama.cpp's CLI and server,
    and Python (xllamacpp)."""
    s = settings
    return (f"llama-server -m {gguf_path} -t {s['threads']} -tb {s['threads']} -np {s['parallel']} -c {s['ctx']} "
            f"-b {s['batch']} -ub {s['ubatch']} --cache-ram 0 (one prompt: llama-cli -m {gguf_path} -t "
            f"{s['threads']} -tb {s['threads']}); Python: p = xllamacpp.CommonParams(); p.model.path = "
            f"'{gguf_path}'; p.cpuparams.n_threads = p.cpuparams_batch.n_threads = {s['threads']}; p.n_parallel = "
            f"{s['parallel']}; p.n_ctx = {s['ctx']}; p.cache_ram_mib = 0; xllamacpp.Server(p)")


def write_artifact(folder: Path, model, tokenizer, wtype: str = "f16", peer: bool = False) -> dict[str, Any]:
    """Write `model` into `folder` as one GGUF (`wtype`; the peer: f16 first, then Q8_0 from the f16 values, as a
    llama.cpp user converts and quantizes), its config and tokenizer, and `gguf.json`. Refused unless it passes the
    gate (`check_parity`). `model` is read, not copied, where it is on the CPU in fp32 (`engines.as_exported`)."""
    require()
    if wtype not in TYPES:
        raise EffkitError(f"unknown --type {wtype!r}; choose one of {', '.join(TYPES)}")
    with as_exported(model) as m:
        return _write_artifact(folder, m, tokenizer, wtype, peer)


def _write_artifact(folder: Path, model, tokenizer, wtype: str, peer: bool) -> dict[str, Any]:
    check_model(model)
    refuse_shape(model, wtype)
    threads = torch.get_num_threads()
    c = model.config
    settings = {"threads": threads, "parallel": slots(), "ctx": slots() * c.n_positions, "batch": 2048, "ubatch": 512}
    t0 = time.perf_counter()
    weights = write_gguf(folder / GGUF_FILE, model, tokenizer, wtype, via_f16=peer,
                         record={"writer": "effkit", "timed_with": ", ".join(f"{k} {v}" for k, v in settings.items())})
    seconds = time.perf_counter() - t0
    c.use_cache = True  # how a Hugging Face folder is usually saved
    c.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    desc: dict[str, Any] = {
        "format": "gguf", "type": wtype, "weights": weights, "params": sum(p.numel() for p in model.parameters()),
        "converter": f"effkit's GGUFWriter (gguf-py {version('gguf')}): llama.cpp's GPT-2 tensors and keys, the "
                     "byte-level BPE with its merges inside"
                     + (", f16 then Q8_0 from the f16 values (as convert_hf_to_gguf.py --outtype f16 then "
                        "llama-quantize Q8_0)" if peer else ""),
        "quantizer": ("none (f16)" if wtype == "f16" else
                      f"gguf.quants.quantize {QUANTIZED[wtype]} (blocks of {BLOCK}, one f16 scale each)"
                      + (f"; {head_storage(c.n_embd, wtype)[1]}" if wtype == "q4_0" else "")),
        "convert_seconds": seconds, "threads": threads, "settings": settings,
        "runtime": f"llama.cpp (xllamacpp {version('xllamacpp')}): decoding and prefill by its server's completion "
                   f"route, {slots()} parallel sequences in one batch per step; logits for the held-out loss: its "
                   "final hidden states (/embeddings, pooling none) x the stored LM head (gguf-py, numpy)",
        **({"head": head_storage(c.n_embd, wtype)[1]} if wtype == "q4_0" else {}),
        **({"peer": True} if peer else {})}
    desc["parity"] = check_parity(model, tokenizer, folder, "q8_0" if peer else wtype, threads)
    (folder / GGUF_DESC).write_text(json.dumps(desc, indent=2))
    return desc


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(package)
    except PackageNotFoundError:
        return "unknown"


def peer_deviations() -> list[str]:
    """How effkit runs the peer other than with llama.cpp's defaults, one line each."""
    threads, default = torch.get_num_threads(), physical_cores()
    same = " (the same count)" if threads == default else ""
    return [f"-t / -tb {threads}: torch's thread count, so that every engine in the comparison gets the same threads; "
            f"llama.cpp's own default here is {default} (one per physical core){same}",
            f"-np {slots()} -c {slots()} x the model's context: {slots()} parallel sequences, each with "
            "the model's whole context (the server's default is fewer slots sharing one context)",
            "--cache-ram 0 and cache_prompt false per request: every timed call processes its prompts (the prompt "
            "cache would serve a repeated prompt from memory)",
            "greedy requests (temperature 0, top_k 1) with ignore_eos: they decode exactly the tokens every other "
            "engine decodes; the prompts handed over as token ids"]


class LlamaCppEngine(Engine):
    """llama.cpp over effkit's own GGUF writer, run by xllamacpp (llama.cpp's server in-process)."""

    name = "llamacpp"
    marker = GGUF_DESC
    label = "llama.cpp"
    noun = "a llama.cpp"  # "is a llama.cpp artifact"
    summary = "llama.cpp (one GGUF, tokenizer inside; f16, Q8_0 or Q4_0 by gguf-py, Q4_0's head Q6_K by ggml)"
    format = "gguf"
    types = TYPES  # `effkit export --type`
    portability = PORTABILITY
    peer_tag = "peer-llamacpp"

    @property
    def settle_s(self) -> float:  # type: ignore[override]
        return settle_after(torch.get_num_threads())

    @property
    def peer_how(self) -> str:  # type: ignore[override]
        how = ("the reference as a llama.cpp user makes it: GGUF f16 (convert_hf_to_gguf.py's layout, here by effkit's "
               "writer) then llama-quantize Q8_0 from the f16 values, run by llama.cpp's server (xllamacpp.Server), "
               "several prompts as parallel sequences; held-out loss from its final hidden states (/embeddings, "
               "pooling none) x the stored LM head")
        if llamacpp_unavailable():
            return how
        return how + "; deviations from llama.cpp's defaults: " + "; ".join(peer_deviations())

    def available(self, device=None, path: Path | None = None, **options: Any) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs llama.cpp artifacts on the CPU only (xllamacpp's CPU wheels); use --device cpu"
        return llamacpp_unavailable()

    def load(self, path: Path, device) -> LlamaCppCausalLM:
        if device.type != "cpu":
            raise EffkitError(f"{path} is a llama.cpp artifact, which effkit runs on the CPU only; use --device cpu")
        return LlamaCppCausalLM.open(path)

    def convert(self, folder: Path, source: Path, model, tokenizer, int8: bool = False, type: str = "",
                **options: Any) -> dict[str, Any]:
        wtype = type or ("q8_0" if int8 else "f16")
        if int8 and wtype not in QUANTIZED:
            raise EffkitError(f"--int8 with --type {wtype}: give --type q8_0 or q4_0 alone")
        return write_artifact(folder, model, tokenizer, wtype)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"precision": desc["type"], "runtime": desc["runtime"], "exporter": desc["converter"],
                 "quantizer": desc["quantizer"], "weights": tensor_types(folder / GGUF_FILE)},
                {"max_abs_logit_diff_vs_pytorch": desc["parity"]["max_abs_logit_diff"], "parity": desc["parity"]})

    def write_peer(self, folder: Path, reference: Path, model, tokenizer) -> dict[str, Any]:
        desc = write_artifact(folder, model, tokenizer, "q8_0", peer=True)
        desc["deviations"] = peer_deviations()
        (folder / GGUF_DESC).write_text(json.dumps(desc, indent=2))
        return desc

    def prefill(self, model: LlamaCppCausalLM, batch: int, tokens: int):
        """llama.cpp's prefill as its server runs it: `batch` prompts of `tokens` fixed random ids as parallel
        sequences, and their first new token (logits of the last position only, as llama.cpp computes them);
        seconds."""
        from effkit.measure import timing

        rows = timing.random_tokens(model, batch, tokens).tolist()
        rows = [r[:tokens - 1] for r in rows] if tokens >= model.config.n_positions else rows  # + 1 new token

        def once() -> float:
            t = time.perf_counter()
            model.complete(rows, 1)
            return time.perf_counter() - t

        once.settle_s = model.settle_s
        return once

    def decode(self, model: LlamaCppCausalLM, tokenizer, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None):
        """Greedy decoding of `new_tokens` from `batch` copies of the prompt by llama.cpp's server (its own loop: the
        rows as parallel sequences, one batch per step), new tokens per second of all rows; every call checks that
        each row made all its tokens."""
        rows = [_prompt(tokenizer)] * batch

        def once() -> float:
            t = time.perf_counter()
            r = model.complete(rows, new_tokens)
            seconds = time.perf_counter() - t
            # every row ran to its last token (llama.cpp's usage counts one row of a multi-prompt request)
            stopped = [c.get("finish_reason") for c in r["choices"] if c.get("finish_reason") != "length"]
            if stopped or r.get("usage", {}).get("completion_tokens", new_tokens) != new_tokens:
                raise EffkitError(f"llama.cpp stopped decoding before {new_tokens} new tokens "
                                  f"({stopped or r['usage']})")
            return batch * new_tokens / seconds

        once.settle_s = model.settle_s
        return once

    def quantized_layers(self, model, path: Path | None = None) -> int:
        where = Path(path) / GGUF_FILE if path is not None else model.gguf
        return sum(n for k, n in tensor_types(where).items() if k not in ("F32", "F16", "BF16"))

    def load_command(self, path: Path) -> str:
        """llama.cpp's CLI / server line and the Python (xllamacpp) line, with the settings effkit times it with
        (its threads: torch's count here; the server's slots and context for batch 12)."""
        desc = self.describe(path)
        settings = desc.get("settings") or {"threads": torch.get_num_threads(), "parallel": slots(),
                                            "ctx": "<slots x context>", "batch": 2048, "ubatch": 512}
        settings = {**settings, "threads": torch.get_num_threads()}
        return load_line(Path(path) / GGUF_FILE, settings)


ENGINE = LlamaCppEngine()
