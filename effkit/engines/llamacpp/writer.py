"""Writing one GGUF file with effkit's own converter (gguf-py's `GGUFWriter`, the tensors named and laid out as
llama.cpp's `convert_hf_to_gguf.py` writes a GPT-2, the byte-level BPE tokenizer with its merges inside), stored as
f16, Q8_0 or Q4_0 (`gguf.quants`).

The layout (llama.cpp `src/models/gpt2.cpp`): `token_embd`, `position_embd`, `output_norm` (weight, bias), and per
block `attn_norm`, `attn_qkv`, `attn_output`, `ffn_norm`, `ffn_up`, `ffn_down`, each with its bias; `output.weight`
only where the LM head is not tied to the token embedding (llama.cpp reuses the embedding otherwise). GGUF stores a
matrix as (rows of the input dimension) x (output dimension): the numpy layout of a `torch.nn.Linear` weight, which
is effkit's layout in memory (Hugging Face's GPT-2 keeps Conv1D weights transposed; `load_model` turns them into
Linear). `gpt2.feed_forward_length` is the model's real MLP width (llama.cpp's converter writes 4 x n_embd, which a
row-pruned model is not). Norms, biases and the position embedding stay f32, as the converter keeps them.

Quantized types store each row in blocks of 32 values (Q8_0: 32 int8 and one f16 scale; Q4_0: 32 4-bit values and
one scale): a model whose widths are not multiples of 32 is refused in one line naming the fix. In Q4_0 the tied
embedding / LM head is stored Q6_K by llama.cpp's own quantizer (`q6k`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from effkit.engines.llamacpp.q6k import head_storage, quantize_q6_k
from effkit.errors import EffkitError

TYPES = ("f16", "q8_0", "q4_0")  # what `--type` stores the matrices in
BLOCK = 32  # values per quantization block of Q8_0 and Q4_0 (a row must be a multiple of it)
QUANTIZED = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
HEAD_NAMES = ("token_embd.weight", "output.weight")  # the tied embedding / LM head, and an untied head


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

