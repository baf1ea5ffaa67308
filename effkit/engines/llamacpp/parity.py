"""The gate a GGUF file passes before anything is written: the same model written as f32 GGUF, run with an f32 KV
cache, reproduces PyTorch's logits within `GGUF_RTOL` of the largest logit (ONNX's rule, widened for what ggml's CPU
kernels round) and PARITY_TOKENS greedy tokens with llama.cpp's KV cache, and llama.cpp's tokenizer cuts a probe text
into the tokenizer's ids; an f16 file must then decode PyTorch's greedy tokens itself, with llama.cpp's default f16
cache. Q8_0 and Q4_0 change the numbers by design (the rule of effkit's other int8 exports: the unquantized
conversion is gated, the quantized file's loss is measured by the stage that writes it and by the bench); how far
their greedy tokens follow PyTorch's is recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from effkit.engines.llamacpp.runtime import GGUF_FILE, LlamaCppCausalLM
from effkit.engines.llamacpp.writer import QUANTIZED, write_gguf
from effkit.engines.shared import logit_gate, parity_probe
from effkit.errors import EffkitError

# max |logit difference| allowed between llama.cpp running the f32 GGUF and PyTorch, relative to max(1, max |PyTorch
# logit|): ten times the ONNX export's EXPORT_RTOL (`decoder_step`), because ggml's CPU kernels round inside an f32
# graph (its GELU reads a table indexed by the f16 input, GGML_GELU_FP16 in ggml-cpu's vec.h; its flash attention
# converts to f16), while a layout error (a transposed matrix, a wrong position, epsilon or attention scale) moves
# logits by a tenth or more
GGUF_RTOL = 1e-3
# the same bound for the f16 file run as llama.cpp runs it: f16 weights keep 11 significant bits and its default KV
# cache holds f16, an order of magnitude more rounding than the f32 graph, and still far below a wrong tensor's
F16_RTOL = 1e-2


@torch.no_grad()
def greedy_agreement(gguf_model: LlamaCppCausalLM, model, prompt, cached: list[int], what: str,
                     rtol: float | None = None, verb: str = "converted") -> dict[str, Any]:
    """How far llama.cpp's greedy tokens from `prompt` follow PyTorch's (`cached`), and how far its logits along
    PyTorch's tokens are from PyTorch's: {"equal": the tokens equal before the first difference, "error": the largest
    logit difference, "scale": max(1, the largest PyTorch logit), and where the tokens differ, "gap": PyTorch's margin
    for its own token over llama.cpp's there and "near_tie": whether the gap is within what the error can move (2 x
    error: each of the two logits moves by at most it)}. With `rtol`, the error is gated (`shared.logit_gate`, `what`
    and `verb` word its error), and tokens may part only at a near tie; a near tie is only a tie if the error itself
    is within that bound."""
    tokens = gguf_model.complete(prompt.tolist(), len(cached), ids=True)[0]
    seq = torch.tensor([prompt[0].tolist() + cached])
    at = slice(prompt.shape[1] - 1, seq.shape[1] - 1)  # the logits that chose each new token
    ref, ours = model(seq).logits[0, at], gguf_model(seq).logits[0, at]
    out = {"equal": first_difference(tokens, cached), "error": float((ours - ref).abs().max()),
           "scale": max(1.0, float(ref.abs().max()))}
    if (k := out["equal"]) < len(cached):
        out["gap"] = float(ref[k, cached[k]] - ref[k, tokens[k]]) if k < len(tokens) else float("inf")
        out["near_tie"] = out["gap"] <= 2 * out["error"]
    if rtol is not None:
        logit_gate(ours, ref, f"{what} along PyTorch's greedy tokens", rtol, verb)
        if out["equal"] < len(cached) and not out["near_tie"]:
            raise EffkitError(f"{what}'s greedy tokens differ from PyTorch's ({agreement_line(out, len(cached))}); "
                              f"this model cannot be {verb} faithfully")
    return out


def agreement_line(a: dict[str, Any], new: int) -> str:
    if a["equal"] == new:
        return f"its {new} greedy tokens equal PyTorch's (largest logit difference along them {a['error']:.1e})"
    return (f"its greedy tokens equal PyTorch's for the first {a['equal']} of {new}; there PyTorch's top two logits "
            f"are {a['gap']:.1e} apart, " + ("within" if a["near_tie"] else "beyond") + " twice the file's largest "
            f"logit difference ({a['error']:.1e})" + (": a near tie its rounding can flip" if a["near_tie"] else ""))


@torch.no_grad()
def parity_gate(model, tokenizer, folder: Path, wtype: str, threads: int) -> dict[str, Any]:
    """The gate (see the module doc): the model written as f32 GGUF (a scratch file in `folder`, removed after)
    reproduces PyTorch's logits (`shared.parity_probe`, `shared.logit_gate` with GGUF_RTOL) and greedy tokens in
    llama.cpp, and llama.cpp tokenizes like `tokenizer`; then the `wtype` file `folder/model.gguf` decodes PyTorch's
    greedy tokens (required for f16, with F16_RTOL; recorded for Q8_0 / Q4_0). Greedy tokens may part only at a near
    tie (`greedy_agreement`: PyTorch's top two logits closer than the file's own logit error can move them), which no
    conversion can settle. A one-line error otherwise."""
    c = model.config
    probe, reference, prompt, new, cached = parity_probe(model)
    cached = cached[0, prompt.shape[1]:].tolist()
    scratch = folder / ".gate-f32.gguf"
    try:
        write_gguf(scratch, model, tokenizer, "f32")
        exact = LlamaCppCausalLM(scratch, c, threads=threads, exact=True)
        what = "llama.cpp running the f32 GGUF"
        diff, allowed = logit_gate(exact(probe).logits, reference, what, GGUF_RTOL, "converted")
        f32 = greedy_agreement(exact, model, prompt, cached, what, GGUF_RTOL)
        text = "The state of the Union is strong, and 2026's budget: 1,234.5 million"
        theirs = exact.server().post("/tokenize", {"content": text, "add_special": False}).get("tokens")
        ours = tokenizer(text).input_ids
        if theirs != ours:
            raise EffkitError(f"llama.cpp tokenizes text differently from the tokenizer written into the GGUF (from "
                              f"token {first_difference(theirs or [], ours)}); this tokenizer cannot be converted")
        del exact
    finally:
        scratch.unlink(missing_ok=True)
    stored = greedy_agreement(LlamaCppCausalLM(folder / GGUF_FILE, c, threads=threads), model, prompt, cached,
                              "llama.cpp running the f16 GGUF", F16_RTOL if wtype == "f16" else None, "stored in f16")
    how = (f"the model written as f32 GGUF, run with an f32 KV cache and no flash attention: logits of a (3, "
           f"{probe.shape[1]}) probe batch within {allowed:.2e} of PyTorch's ({GGUF_RTOL} of the largest logit's "
           f"magnitude), {agreement_line(f32, new)} (PyTorch with its KV cache), llama.cpp's tokens of a probe text "
           "equal the tokenizer's")
    if wtype == "f16":
        how += (f"; then the f16 file, with llama.cpp's defaults: logits along PyTorch's greedy tokens within "
                f"{F16_RTOL * stored['scale']:.2e} ({F16_RTOL} of the largest logit), {agreement_line(stored, new)}")
    else:
        how += f"; then the {QUANTIZED[wtype]} file (its loss measured, not gated): {agreement_line(stored, new)}"
    return {"max_abs_logit_diff": diff, "max_abs_logit_diff_allowed": allowed, "greedy_tokens_equal": f32["equal"],
            "stored_greedy_tokens_equal": stored["equal"], "greedy": {"f32": f32, wtype: stored}, "how": how}


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where `a` and `b` differ (their common length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

