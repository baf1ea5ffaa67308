"""The ONNX export: `torch.onnx.export(dynamo=True)` of the with-past decoder step of
`effkit.engines.decoder_step` (`WithPast`, which OpenVINO's conversion shares), in the layout ONNX Runtime users
expect of a decoder with past key/values; ONNX Runtime's transformer fusions (`fuse`); and `write_artifact`, which
writes a whole artifact folder: the fp32 graph, then ONNX Runtime's int8 (`int8.py`) or 4-bit (`int4.py`) of it.

The graph's inputs are `input_ids` (batch, seq), `attention_mask` (batch, past + seq; 1 = attend), `position_ids`
(batch, seq) and `past_key_values.{i}.key` / `.value` (batch, heads, past, head_dim) for every layer; its outputs
`logits` (batch, seq, vocab) and `present.{i}.key` / `.value` (batch, heads, past + seq, head_dim). Batch, seq and
past are dynamic; past may be 0 (prefill). That is the with-past layout optimum's exports use, so plain onnxruntime
code with a ten-line greedy loop runs it. The wrapper calls the model's own modules and writes out only the
attention core, so the exporter never sees transformers' masking code (the TorchScript exporter fails on it).

Nothing is written unless it passes the parity gate (`check_parity`, `shared.parity_gate`): ONNX Runtime's fp32
logits within EXPORT_RTOL of the largest logit's magnitude (fp32 rounding grows with it) on a probe batch of another
shape than the traced one, and its greedy tokens with the cache equal to PyTorch's with its cache and with the full
recompute. The LM head is exported as its own (transposed) weight rather than tied to the token embedding, so that
ONNX Runtime quantizes it (a tied weight reaches the head through a `Transpose`, which the quantizer leaves in
fp32); after quantization the embedding lookup reads the quantized head.

An ONNX artifact folder: `model.onnx`, `onnx.json` (what was exported and how), `config.json`, the tokenizer and
`effkit.json`."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import as_exported, kept_export
from effkit.engines.decoder_step import EXPORT_RTOL, WithPast, past_names, present_names, probe_ids, quiet_exporter
from effkit.engines.onnxruntime.graph import ONNX_DESC, ONNX_FILE, OPSET, int8_layers, require_onnx
from effkit.engines.onnxruntime.int4 import quantize_int4
from effkit.engines.onnxruntime.int8 import quantize_int8, quantize_standard
from effkit.engines.onnxruntime.runtime import empty_past, session, step, stepper
from effkit.engines.shared import decode_loop, load_or_fail, parity_gate, save_config_and_tokenizer
from effkit.errors import EffkitError
from effkit.measure.memory import give_back_freed

KEEP_EXPORT_BYTES = 2**30  # models whose fp32 weights are larger are exported every time, not kept


def _model_digest(model: nn.Module) -> str | None:
    """A digest of what the exporter sees (the model's class, config and every tensor's name, shape, dtype and
    bytes), or None for a model too large to keep its export."""
    state = model.state_dict()
    if sum(t.numel() * t.element_size() for t in state.values()) > KEEP_EXPORT_BYTES:
        return None
    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__} opset {OPSET}".encode())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in state.items():
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def export_fp32(model: nn.Module, out: Path) -> dict[str, Any]:
    """Export `model` (effkit's Linear form, on the CPU, eval mode) with past key/values to `out`, and refuse it
    unless it passes the parity gate (`check_parity`). Inside `engines.exports_kept` (quantize's auto), the same
    model (by `_model_digest`) exported again gets a copy of its first export, parity-checked then; the
    description says so (`reused_export`)."""
    require_onnx()
    model = model.cpu().eval()
    scope = kept_export()
    digest = _model_digest(model) if scope is not None else None
    if digest is not None and f"onnx {digest}" in scope[1]:
        kept, desc = scope[1][f"onnx {digest}"]
        shutil.copyfile(kept, out)
        return {**desc, "reused_export": "a copy of the export of the same model (same class, config and tensors) "
                                         "made for another candidate, which passed the parity gate"}
    desc = _export_fp32(model, out)
    if digest is not None and not list(out.parent.glob(out.name + "?*")):  # one file (no external data): kept
        kept = scope[0] / f"onnx-{digest}.onnx"
        shutil.copyfile(out, kept)
        scope[1][f"onnx {digest}"] = (kept, desc)
    return desc


def _export_fp32(model: nn.Module, out: Path) -> dict[str, Any]:
    c = model.config
    wrapper = WithPast(model).eval()
    b, n, p = 2, min(5, c.n_positions - 3), 3  # sizes other than 0 and 1, which torch.export would specialize
    ids = probe_ids(c.vocab_size, (b, n))
    past = tuple(torch.zeros(b, c.n_head, p, c.n_embd // c.n_head) for _ in past_names(c.n_layer))
    mask = torch.ones(b, p + n, dtype=torch.long)
    pos = torch.arange(p, p + n).expand(b, n)
    batch, seq = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("seq", min=1, max=c.n_positions)
    total = torch.export.Dim("total", min=1, max=c.n_positions)
    past_len = torch.export.Dim("past", min=0, max=c.n_positions)
    t0 = time.perf_counter()
    with load_or_fail("ONNX cannot represent this model"):  # the exporter raises many kinds
        with quiet_exporter():
            program = torch.onnx.export(
                wrapper, (ids, mask, pos, *past), dynamo=True, optimize=True, verbose=False, opset_version=OPSET,
                input_names=["input_ids", "attention_mask", "position_ids", *past_names(c.n_layer)],
                output_names=["logits", *present_names(c.n_layer)],
                dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
                                "position_ids": {0: batch, 1: seq},
                                "past": tuple({0: batch, 2: past_len} for _ in past)})
            program.save(str(out))
    seconds = time.perf_counter() - t0
    del program
    parity = check_parity(model, session(out))
    give_back_freed()  # the checking session's copy of the weights
    return {"exporter": f"torch.onnx.export(dynamo=True, optimize=True, opset_version={OPSET}), torch "
                        f"{torch.__version__}",
            "opset": OPSET, "export_seconds": seconds, "max_abs_logit_diff_vs_pytorch": parity["max_abs_logit_diff"],
            "parity": parity, "past_key_values": True,
            "inputs": "input_ids int64 (batch, seq); attention_mask int64 (batch, past + seq); position_ids int64 "
                      "(batch, seq); past_key_values.{i}.key / .value float32 (batch, heads, past, head_dim); "
                      "batch, seq and past dynamic (past may be 0)",
            "outputs": "logits float32 (batch, seq, vocab); present.{i}.key / .value (batch, heads, past + seq, "
                       "head_dim)",
            "lm_head": "exported as its own transposed weight (not tied to the embedding), so that it quantizes"}


def greedy_with_past(sess, config, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy decoding through the with-past graph (`shared.decode_loop`): prefill, then one token per run with the
    cache; end-of-text never picked (as PyTorch's `min_new_tokens` decoding it is compared with)."""
    return decode_loop(stepper(sess, config), prompt, new_tokens, config.eos_token_id, new_tokens)


def check_parity(model: nn.Module, sess) -> dict[str, Any]:
    """The export's gate (`shared.parity_gate`): ONNX Runtime's logits within EXPORT_RTOL x max(1, max |logit|) of
    PyTorch's on a (3, 24) probe batch (a shape the export did not trace), and its greedy tokens with the cache equal
    to PyTorch's with its cache and with the full recompute (PARITY_TOKENS new tokens, capped by the context). A
    one-line error otherwise."""
    c = model.config
    return parity_gate(model, lambda probe: step(sess, probe.numpy(), empty_past(c, probe.shape[0]), 0)[0],
                       lambda prompt, new: greedy_with_past(sess, c, prompt, new), "the exported ONNX graph",
                       "from the with-past graph equal PyTorch's with its KV cache and with the full recompute",
                       rtol=EXPORT_RTOL, recompute=True)


def fuse(path: Path, config) -> dict[str, Any]:
    """ONNX Runtime's transformer graph fusions (`onnxruntime.transformers.optimizer`, model type gpt2), in place;
    returns the fused operator counts."""
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        with quiet_exporter():
            opt = optimize_model(str(path), model_type="gpt2", num_heads=config.n_head, hidden_size=config.n_embd)
            opt.save_model_to_file(str(path))
    except Exception as e:  # noqa: BLE001
        raise EffkitError(f"ONNX Runtime's transformer optimizer failed on this graph: {type(e).__name__}: "
                          f"{str(e)[:160]}; export without --fuse") from None
    return {k: v for k, v in opt.get_fused_operator_statistics().items() if v}


def write_artifact(folder: Path, model: nn.Module, tokenizer, int8: bool, fused: bool,
                   standard_int8: bool = False, int4: bool = False,
                   int4_quantize: Callable[[Path, Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Export `model` into `folder` (fp32, or ONNX Runtime int8 with `int8`: effkit's int8 (per tensor) with the
    embedding tied to the int8 head, or ONNX Runtime's defaults with `standard_int8`, or weight-only 4-bit with
    `int4`: `quantize_int4`, or `int4_quantize(fp32 graph, model.onnx)`, which returns what `quantize_int4` does (the
    backend's measured choice of its settings); ORT's fusions first with `fused`), with its config and tokenizer;
    returns the description written to `onnx.json`. `model` is read, not copied, where it is on the CPU in fp32
    (`engines.as_exported`)."""
    with as_exported(model) as m:
        return _write_artifact(folder, m, tokenizer, int8, fused, standard_int8, int4, int4_quantize)


def _write_artifact(folder: Path, model: nn.Module, tokenizer, int8: bool, fused: bool, standard_int8: bool,
                    int4: bool, int4_quantize: Callable[[Path, Path], dict[str, Any]] | None) -> dict[str, Any]:
    save_config_and_tokenizer(folder, model, tokenizer)
    fp32 = folder / ("fp32.onnx" if int8 or int4 else ONNX_FILE)
    precision = "int4 (weight-only, blocks of 32)" if int4 else "int8 (dynamic)" if int8 else "fp32"
    desc: dict[str, Any] = {"format": "onnx", "precision": precision,
                            "params": sum(p.numel() for p in model.parameters()), **export_fp32(model, fp32)}
    if fused:
        desc["fused_operators"] = fuse(fp32, model.config)
    if int8 or int4:
        quantize = (int4_quantize or quantize_int4) if int4 else quantize_standard if standard_int8 else quantize_int8
        desc.update(quantize(fp32, folder / ONNX_FILE))
        if int4:  # the settings the quantizer wrote, not the default typed above
            desc["precision"] = (f"int{desc.get('bits', 4)} (weight-only, {desc.get('algorithm', 'rtn')}, blocks "
                                 f"of {desc['block_size']}, MatMulNBits accuracy_level {desc['accuracy_level']})")
        fp32.unlink()
        for extra in fp32.parent.glob(fp32.name + "*"):  # external-data side files, if any
            extra.unlink()
        give_back_freed()  # the quantizer's copies of the graph
        if not int8_layers(desc["int8"]):
            raise EffkitError("ONNX Runtime's quantizer left no int8 operator in the graph; nothing was quantized")
    desc["runtime"] = ("onnxruntime.InferenceSession, CPUExecutionProvider, intra-op threads = torch threads, "
                       "ONNX Runtime's default spin-waiting")
    desc["generation"] = "greedy or sampled decoding with the KV cache (the graph's past/present key/values)"
    (folder / ONNX_DESC).write_text(json.dumps(desc, indent=2))
    return desc
