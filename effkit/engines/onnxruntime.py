"""ONNX artifacts: export with `torch.onnx.export(dynamo=True)` in the layout ONNX Runtime users expect of a
decoder with past key/values; int8 with ONNX Runtime's `quantize_dynamic` (effkit's form, the token embedding read
from the int8 head, and ONNX Runtime's defaults, the peer's form); weight-only 4-bit with its `MatMulNBits`; its
transformer fusions (`--fuse`); `OnnxCausalLM`, which runs an ONNX artifact through an
`onnxruntime.InferenceSession` behind the few methods effkit's measurement code calls on a model
(`model(ids).logits`, `generate` with the KV cache, `config`, `eval`); and the engine (`OnnxRuntimeEngine`).

The graph is the with-past decoder step of `effkit.engines.decoder_step` (`WithPast`, which OpenVINO's conversion
shares): inputs `input_ids` (batch, seq), `attention_mask` (batch, past + seq; 1 = attend), `position_ids` (batch,
seq) and `past_key_values.{i}.key` / `.value` (batch, heads, past, head_dim) for every layer; outputs `logits`
(batch, seq, vocab) and `present.{i}.key` / `.value` (batch, heads, past + seq, head_dim). Batch, seq and past are
dynamic; past may be 0 (prefill). That is the with-past layout optimum's exports use, so plain onnxruntime code
with a ten-line greedy loop runs it. The wrapper calls the model's own modules (embeddings, LayerNorms, the
attention and MLP projections, the MLP activation) and writes out only the attention core: the concatenation with
the past, the causal + padding mask, scaled dot-product (with GPT-2's scaling options). The TorchScript exporter
fails on transformers 5's masking code (`aten::diff`); this wrapper does not go through it.

Nothing is written unless it passes the parity gate (`check_parity`): ONNX Runtime's fp32 logits equal
PyTorch's within 1e-4 of the largest logit's magnitude (fp32 rounding grows with it: a trained model's logits
reach 10 or more) on a probe batch of another shape than the traced one, and its greedy tokens with the
cache equal PyTorch's with its cache and with the full recompute. The LM head is exported as its own
(transposed) weight rather than tied to the token embedding, so that ONNX Runtime quantizes it as an int8
`MatMulInteger` (a tied weight reaches the head through a `Transpose`, which the quantizer leaves in
fp32); after quantization the embedding lookup reads that int8 head (`tie_embedding_to_head`).

An ONNX artifact folder: `model.onnx`, `onnx.json` (what was exported and how), `config.json`, the tokenizer and
`effkit.json`. Artifacts of older effkit versions (no past inputs) still load; generation with them recomputes
the prefix, and reports say so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import Engine, as_exported, kept_export
from effkit.engines.decoder_step import (
    EXPORT_RTOL,
    PARITY_TOKENS,
    WithPast,
    never_end,
    next_tokens,
    past_names,
    present_names,
    probe_ids,
    quiet_exporter,
)
from effkit.errors import EffkitError
from effkit.measure.memory import give_back_freed
from effkit.measure.timing import SETTLE_S  # idle seconds after timing a spinning thread pool

ONNX_FILE = "model.onnx"
ONNX_DESC = "onnx.json"
OPSET = 23
PORTABILITY = "portable: any ONNX Runtime loads model.onnx (onnxruntime.InferenceSession)"
INT8_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention")
INT4_OPS = ("MatMulNBits", "GatherBlockQuantized")  # ONNX Runtime's block-quantized weight-only operators
INT4_BLOCK = 32
GENERATION_NOTE = ("ONNX artifact of an older effkit, exported without past key/values: generation recomputes the "
                   "whole prefix for every new token (measured as it is); export the parent again for the KV cache")


def onnx_unavailable() -> str | None:
    """None if ONNX export and ONNX Runtime can run here, else the reason."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"{type(e).__name__}: {str(e)[:100]}; pip install onnx onnxruntime onnxscript (effkit[quant])"
    return None


def require_onnx() -> None:
    if reason := onnx_unavailable():
        raise EffkitError(f"ONNX export needs onnx, onnxruntime and onnxscript: {reason}")


def is_onnx(path: str | Path) -> bool:
    return (Path(path) / ONNX_DESC).is_file()


def empty_past(config, batch: int) -> dict[str, np.ndarray]:
    shape = (batch, config.n_head, 0, config.n_embd // config.n_head)
    return {name: np.zeros(shape, np.float32) for name in past_names(config.n_layer)}


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
    try:
        with quiet_exporter():
            program = torch.onnx.export(
                wrapper, (ids, mask, pos, *past), dynamo=True, optimize=True, verbose=False, opset_version=OPSET,
                input_names=["input_ids", "attention_mask", "position_ids", *past_names(c.n_layer)],
                output_names=["logits", *present_names(c.n_layer)],
                dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
                                "position_ids": {0: batch, 1: seq},
                                "past": tuple({0: batch, 2: past_len} for _ in past)})
            program.save(str(out))
    except EffkitError:
        raise
    except Exception as e:  # noqa: BLE001 - the exporter raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise EffkitError(f"ONNX cannot represent this model: {type(e).__name__}: {first[:200]}") from None
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


def step(sess, input_ids: np.ndarray, past: dict[str, np.ndarray], past_len: int) -> tuple[np.ndarray, dict]:
    """One run of the with-past graph: the logits of `input_ids` after `past_len` cached positions, and the new
    cache (no padding: every position attended)."""
    b, n = input_ids.shape
    feed = {"input_ids": input_ids, "attention_mask": np.ones((b, past_len + n), np.int64),
            "position_ids": np.broadcast_to(np.arange(past_len, past_len + n, dtype=np.int64), (b, n)), **past}
    out = sess.run(None, feed)
    return out[0], dict(zip(past, out[1:], strict=True))


def greedy_with_past(sess, config, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy decoding through the with-past graph: prefill, then one token per run with the cache; end-of-text
    never picked (as PyTorch's `min_new_tokens` decoding it is compared with)."""
    logits, past = step(sess, prompt, empty_past(config, prompt.shape[0]), 0)
    ids = [prompt]
    for k in range(new_tokens):
        nxt = never_end(logits[:, -1], config.eos_token_id).argmax(-1)[:, None].astype(np.int64)
        ids.append(nxt)
        if k + 1 < new_tokens:
            logits, past = step(sess, nxt, past, prompt.shape[1] + k)
    return np.concatenate(ids, axis=1)


@torch.no_grad()
def check_parity(model: nn.Module, sess) -> dict[str, Any]:
    """The export's gate: ONNX Runtime's logits within EXPORT_RTOL x max(1, max |logit|) of PyTorch's on a (3, 24)
    probe batch (a shape the export did not trace), and its greedy tokens with the cache equal to PyTorch's with
    its cache and with the full recompute (PARITY_TOKENS new tokens, capped by the context). A one-line error
    otherwise."""
    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    logits, _ = step(sess, probe.numpy(), empty_past(c, 3), 0)
    reference = model(probe).logits
    diff = float((torch.from_numpy(logits) - reference).abs().max())
    allowed = EXPORT_RTOL * max(1.0, float(reference.abs().max()))
    if not diff <= allowed:
        raise EffkitError(f"the exported ONNX graph does not reproduce the model (max logit difference {diff:.2e} > "
                          f"{allowed:.2e}, {EXPORT_RTOL} of the largest logit); this model cannot be exported "
                          "faithfully")
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    onnx_ids = torch.from_numpy(greedy_with_past(sess, c, prompt.numpy(), new))
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(prompt, use_cache=True, **kw)
    recomputed = model.generate(prompt, use_cache=False, **kw)
    if not (torch.equal(onnx_ids, cached) and torch.equal(cached, recomputed)):
        raise EffkitError(f"the exported ONNX graph's greedy tokens with its KV cache differ from PyTorch's (with "
                          f"its cache: {torch.equal(onnx_ids, cached)}, PyTorch cached vs recomputed: "
                          f"{torch.equal(cached, recomputed)}); this model cannot be exported faithfully")
    return {"max_abs_logit_diff": diff, "greedy_tokens_equal": new,
            "max_abs_logit_diff_allowed": allowed,
            "how": f"logits of a (3, {probe.shape[1]}) probe batch within {allowed:.2e} of PyTorch's ({EXPORT_RTOL} "
                   f"of the largest logit's magnitude); {new} greedy "
                   "tokens from the with-past graph equal PyTorch's with its KV cache and with the full recompute"}


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


SHAPE_DATA_BYTES = 2**16  # initializers up to this size keep their values for shape inference (Reshape's shapes)


def infer_shapes_in_place(model):
    """ONNX Runtime's `save_and_reload_model_with_shape_infer` without the copies: it deep-copies the graph, saves
    the copy and reloads it to run ONNX's shape inference past protobuf's 2 GB limit. Shape inference reads the
    initializers' types and dims (and the values of the small ones: a Reshape's target shape), never the weights:
    here it runs on a copy of the graph with every initializer above SHAPE_DATA_BYTES reduced to its name, type and
    dims, and its value_info goes back into `model`, which is returned itself."""
    import onnx
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    light = onnx.ModelProto()
    for f in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        setattr(light, f, getattr(model, f))
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, lg = model.graph, light.graph
    lg.name = g.name
    lg.node.extend(g.node)
    lg.input.extend(g.input)
    lg.output.extend(g.output)
    lg.value_info.extend(g.value_info)
    stripped = []
    for t in g.initializer:
        if t.ByteSize() <= SHAPE_DATA_BYTES:
            lg.initializer.append(t)
        else:
            lg.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
            stripped.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    inferred = onnx.shape_inference.infer_shapes(light)
    known = {v.name for v in inferred.graph.value_info}
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    # the types of the weights themselves, which inference over the full graph also lists (the quantizer looks there)
    model.graph.value_info.extend(v for v in stripped if v.name not in known)
    add_infer_metadata(model)
    return model


def quantize_dynamic(src: Path, dst: Path, per_channel: bool, op_types: list[str]) -> None:
    """`onnxruntime.quantization.quantize_dynamic(src, dst, per_channel=per_channel, weight_type=QInt8,
    op_types_to_quantize=op_types)`, its steps in its order, with one fp32 copy of the graph alive where it has three:
    it keeps the graph it loaded in a local while its quantizer deep-copies it, saves the copy and reloads it for
    shape inference (8.2 GiB over a 2.7 GiB gpt2-large graph at that moment; docs/benchmarks.md, session 22). Here
    the loaded graph goes straight into the quantizer, whose shape inference runs without the weights
    (`infer_shapes_in_place`). Where ONNX Runtime's internals differ (another version), its public call."""
    from onnxruntime.quantization import QuantType

    try:
        from onnxruntime.quantization import onnx_quantizer
        from onnxruntime.quantization.quant_utils import QuantizationMode, load_model_with_shape_infer
        from onnxruntime.quantization.quantize import update_opset_version

        own = onnx_quantizer.save_and_reload_model_with_shape_infer  # the step replaced below
    except (ImportError, AttributeError):
        from onnxruntime.quantization import quantize_dynamic as public

        public(str(src), str(dst), per_channel=per_channel, weight_type=QuantType.QInt8,
               op_types_to_quantize=op_types)
        return
    onnx_quantizer.save_and_reload_model_with_shape_infer = infer_shapes_in_place
    try:
        quantizer = onnx_quantizer.ONNXQuantizer(
            update_opset_version(load_model_with_shape_infer(Path(src)), QuantType.QInt8), per_channel, False,
            QuantizationMode.IntegerOps, False, QuantType.QInt8, QuantType.QUInt8, None, [], [], list(op_types),
            {"MatMulConstBOnly": True})
    finally:
        onnx_quantizer.save_and_reload_model_with_shape_infer = own
    quantizer.quantize_model()
    give_back_freed()  # the fp32 weights it replaced
    quantizer.model.save_model_to_file(str(dst), False)
    del quantizer
    give_back_freed()


def quantize_int8(src: Path, dst: Path, per_channel: bool = False) -> dict[str, Any]:
    """ONNX Runtime dynamic int8: weights int8 for MatMul and Gather (one scale per tensor, or per output channel
    with `per_channel`), activations quantized at run time. Then the token embedding is re-tied to the int8 LM head
    (`tie_embedding_to_head`). Per tensor is the default: ONNX Runtime's fused int8 matmul decodes faster with one
    scale per tensor than per channel, and the held-out loss that costs is within the noise of a paired comparison
    (the figures: docs/benchmarks.md)."""
    with quiet_exporter():
        # the weight-bearing ops only: left to itself the quantizer turns ONNX `Attention` into com.microsoft's
        # `QAttention`, which rejects the `is_causal` attribute (an invalid graph)
        quantize_dynamic(src, dst, per_channel, ["MatMul", "Gemm", "Gather"])
    tied = tie_embedding_to_head(dst)
    return {"quantizer": f"onnxruntime.quantization.quantize_dynamic(per_channel={per_channel}, weight_type=QInt8, "
                         "op_types_to_quantize=[MatMul, Gemm, Gather])",
            "weights": "one scale per output channel" if per_channel else "one scale per tensor",
            "token_embedding": tied, "int8": int8_counts(dst)}


def tie_embedding_to_head(path: Path) -> str:
    """Make the token-embedding lookup read the int8 LM head (`head_quantized`, (n_embd, vocab), with the head's
    scale and zero point: one per token when the head is quantized per channel, one in all otherwise) instead of
    its own int8 table, and drop that table: the tied weight is stored once, as in the PyTorch model. In place;
    returns what was done."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    head = {k: inits.get(f"head_{k}") for k in ("quantized", "scale", "zero_point")}
    if any(v is None for v in head.values()):
        return "own int8 table (the LM head was not quantized)"
    n_embd, vocab = head["quantized"].dims
    lookup = next((n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and list(inits[n.input[0]].dims) == [vocab, n_embd]), None)
    dequant = next((n for n in graph.node if lookup is not None and n.op_type == "DequantizeLinear"
                    and n.input[0] == lookup.output[0]), None)
    if dequant is None:
        return "own int8 table (no int8 token-embedding lookup found)"
    ids, out = lookup.input[1], dequant.output[0]
    p = "effkit_tied_embedding"
    per_token = len(head["scale"].dims) > 0 and int(np.prod(head["scale"].dims)) > 1
    new_nodes = [
        helper.make_node("Gather", ["head_quantized", ids], [f"{p}_q"], axis=1),  # (n_embd, B, T)
        helper.make_node("Transpose", [f"{p}_q"], [f"{p}_qt"], perm=[1, 2, 0]),  # (B, T, n_embd)
        helper.make_node("Cast", [f"{p}_qt"], [f"{p}_f"], to=onnx.TensorProto.FLOAT),
    ]
    if per_token:  # one scale and zero point per token: gathered with the ids, broadcast over n_embd
        graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{p}_axes"))
        new_nodes += [
            helper.make_node("Gather", ["head_zero_point", ids], [f"{p}_zp"], axis=0),  # (B, T)
            helper.make_node("Cast", [f"{p}_zp"], [f"{p}_zpf"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Unsqueeze", [f"{p}_zpf", f"{p}_axes"], [f"{p}_zpu"]),
            helper.make_node("Sub", [f"{p}_f", f"{p}_zpu"], [f"{p}_c"]),
            helper.make_node("Gather", ["head_scale", ids], [f"{p}_s"], axis=0),
            helper.make_node("Unsqueeze", [f"{p}_s", f"{p}_axes"], [f"{p}_su"]),
            helper.make_node("Mul", [f"{p}_c", f"{p}_su"], [out]),
        ]
    else:  # the head's one scale and zero point
        new_nodes += [
            helper.make_node("Cast", ["head_zero_point"], [f"{p}_zpf"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Sub", [f"{p}_f", f"{p}_zpf"], [f"{p}_c"]),
            helper.make_node("Mul", [f"{p}_c", "head_scale"], [out]),
        ]
    nodes = list(graph.node)
    at = nodes.index(lookup)
    nodes = nodes[:at] + new_nodes + [n for n in nodes[at:] if n is not lookup and n is not dequant]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    for name in (lookup.input[0], *dequant.input[1:]):
        if name not in used and name in inits:
            graph.initializer.remove(inits[name])
    onnx.save(model, str(path))
    return ("read from the int8 LM head (stored once, " + ("one scale per token" if per_token else
            "the head's scale") + "), as the PyTorch model ties them")


def graph_digest(path: Path) -> str:
    """sha256 over what ONNX Runtime runs of `path/model.onnx`: the opsets, every node's operator, domain, inputs,
    outputs and attributes in order, the graph's inputs and outputs, and every initializer's name, type, shape
    and bytes; node names, doc strings and metadata (which differ between two exports of the same model) are
    left out."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(Path(path) / ONNX_FILE))
    h = hashlib.sha256()
    for o in m.opset_import:
        h.update(f"opset {o.domain} {o.version}\n".encode())
    for n in m.graph.node:
        h.update(f"node {n.domain} {n.op_type} {list(n.input)} {list(n.output)}\n".encode())
        for a in sorted(n.attribute, key=lambda a: a.name):
            h.update(a.SerializeToString(deterministic=True))
    for v in (*m.graph.input, *m.graph.output):
        h.update(f"io {v.name} ".encode() + v.type.SerializeToString(deterministic=True))
    for t in sorted(m.graph.initializer, key=lambda t: t.name):
        a = numpy_helper.to_array(t)
        h.update(f"init {t.name} {a.dtype} {a.shape}\n".encode() + a.tobytes())
    return h.hexdigest()


def int8_counts(path: Path) -> dict[str, int]:
    """The int8 operators of an ONNX graph, read back from the file: integer matmuls, and lookups (Gather) whose
    table is an int8 initializer."""
    import onnx

    graph = onnx.load(str(path)).graph
    int8_inits = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT8}
    counts = Counter(n.op_type for n in graph.node if n.op_type in INT8_OPS + INT4_OPS)
    counts["Gather (int8 table)"] = sum(1 for n in graph.node if n.op_type == "Gather" and n.input[0] in int8_inits)
    counts["int8 initializers"] = len(int8_inits)
    counts["fp32 matrices"] = sum(1 for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                                  and len(i.dims) == 2 and min(i.dims) > 1)
    return {k: v for k, v in counts.items() if v}


def int8_layers(counts: dict[str, int]) -> int:
    """Weight-bearing quantized operators (integer matmuls, int8 lookups, 4-bit matmuls and lookups) in
    `int8_counts`."""
    return sum(v for k, v in counts.items() if k in INT8_OPS + INT4_OPS or k.startswith("Gather"))


def quantized_layers(model: OnnxCausalLM) -> int:
    """The quantized operators of a reloaded ONNX artifact's graph (`int8_layers` of its `int8_counts`)."""
    return int8_layers(int8_counts(model.path / ONNX_FILE))


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
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise EffkitError(f"ONNX Runtime cannot open {path}: {type(e).__name__}: {str(e)[:160]}; export the "
                          "parent again") from None


class OnnxCausalLM(nn.Module):
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

    def _check_length(self, n: int) -> None:
        if n > self.config.n_positions:
            raise EffkitError(f"{n} tokens exceed the model's context ({self.config.n_positions})")

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        self._check_length(input_ids.shape[-1])
        ids = input_ids.detach().cpu().long().numpy()
        if self.with_past:
            logits, _ = step(self.session, ids, empty_past(self.config, ids.shape[0]), 0)
        else:
            logits = self.session.run(None, {"input_ids": ids})[0]
        return SimpleNamespace(logits=torch.from_numpy(logits))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **_: Any) -> torch.Tensor:
        """Exactly `max_new_tokens` new tokens (never stops early), with the KV cache (the prefix recomputed each
        step for an artifact without past inputs); end-of-text is never picked among the first `min_new_tokens`,
        as transformers' `min_new_tokens` does for PyTorch (so the texts, not only the token counts, match);
        sampling draws from torch's global generator (seed it first). Greedy steps pick tokens in numpy: a torch
        operation large enough to run on torch's threads (an argmax over 12 x vocabulary) would wait for a core
        that ONNX Runtime's spinning threads hold."""
        ids = input_ids.cpu().long().numpy()
        self._check_length(ids.shape[1] + max_new_tokens - 1)  # the last new token is not fed back
        if streamer is not None:
            streamer.put(torch.from_numpy(ids))
        past, done = (empty_past(self.config, ids.shape[0]), 0) if self.with_past else (None, 0)
        todo = ids
        eos = self.config.eos_token_id
        for k in range(max_new_tokens):
            if self.with_past:
                logits, past = step(self.session, todo, past, done)
                done += todo.shape[1]
                logits = logits[:, -1, :]
            else:
                logits = self.session.run(None, {"input_ids": ids})[0][:, -1, :]
            nxt = next_tokens(never_end(logits, eos) if k < min_new_tokens else logits, do_sample, top_k,
                              temperature)
            ids, todo = np.concatenate([ids, nxt], axis=1), nxt
            if streamer is not None:
                streamer.put(torch.from_numpy(nxt))
        if streamer is not None:
            streamer.end()
        return torch.from_numpy(ids)


def quantize_standard(src: Path, dst: Path) -> dict[str, Any]:
    """ONNX Runtime's `quantize_dynamic` as a user who exported the graph would run it (QInt8 weights, per tensor),
    limited to MatMul and Gemm (left to every op type it knows it turns ONNX `Attention` into an invalid
    `QAttention`); no effkit edits: the peer row effkit's own int8 is judged against."""
    with quiet_exporter():
        quantize_dynamic(src, dst, False, ["MatMul", "Gemm"])
    return {"quantizer": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, op_types_to_quantize=[MatMul, "
                         "Gemm]), its defaults otherwise (per tensor)", "int8": int8_counts(dst)}


INT4_ALGORITHMS = ("rtn", "hqq", "gptq")  # MatMulNBitsQuantizer's round-to-nearest default, HQQ, GPTQ


def calibration_feeds(blocks: torch.Tensor, config) -> list[dict[str, np.ndarray]]:
    """GPTQ's calibration inputs: one feed of the with-past graph per token block (batch 1, empty past, every
    position attended), the inputs the graph declares."""
    feeds = []
    for row in blocks[:, :config.n_positions]:
        ids = row[None].cpu().long().numpy()
        feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                      "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None], **empty_past(config, 1)})
    return feeds


class FeedReader:
    """An `onnxruntime.quantization.CalibrationDataReader` (it has `get_next`) over a list of feeds; ONNX Runtime's
    GPTQ deep-copies it and iterates the copy."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds, self.at = list(feeds), 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.at >= len(self.feeds):
            return None
        self.at += 1
        return self.feeds[self.at - 1]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if (feed := self.get_next()) is None:
            raise StopIteration
        return feed

    def __len__(self) -> int:
        return len(self.feeds)


def set_accuracy_level(model, accuracy_level: int | None) -> None:
    """Every MatMulNBits node of `model` (an `onnx.ModelProto`, in place) with `accuracy_level` (none: the
    attribute removed, ONNX Runtime's default 0). HQQ's quantizer writes no level; a graph quantized once is
    re-stamped for another level (the weights do not depend on it)."""
    import onnx

    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            for a in [a for a in n.attribute if a.name == "accuracy_level"]:
                n.attribute.remove(a)
            if accuracy_level:
                n.attribute.append(onnx.helper.make_attribute("accuracy_level", int(accuracy_level)))


def with_accuracy_level(src: Path, dst: Path, desc: dict[str, Any], accuracy_level: int | None) -> dict[str, Any]:
    """`src`, a graph `quantize_int4` wrote (described by `desc`), written to `dst` with another accuracy level;
    its description."""
    import onnx

    model = onnx.load(str(src))
    set_accuracy_level(model, accuracy_level)
    onnx.save(model, str(dst))
    return {**desc, "quantizer": _int4_quantizer(desc["algorithm"], desc["bits"], desc["block_size"],
                                                 accuracy_level, desc["symmetric"], desc.get("calibration"),
                                                 len(desc.get("eight_bit_nodes", ()))),
            "accuracy_level": accuracy_level or 0, "int8": int8_counts(dst)}


def _int4_quantizer(algorithm: str, bits: int, block_size: int, accuracy_level: int | None, symmetric: bool,
                    calibration: dict[str, Any] | None, eight_bit: int = 0) -> str:
    config = {"rtn": "None (DefaultWeightOnlyQuantConfig: round-to-nearest)",
              "hqq": f"HQQWeightOnlyQuantConfig(block_size={block_size}, bits={bits})",
              "gptq": f"GPTQWeightOnlyQuantConfig(calibration_data_reader=<{(calibration or {}).get('feeds', 0)} "
                      "feeds>) (its defaults otherwise: percdamp=0.01, block_size=128, actorder=False, mse=False)",
              }[algorithm]
    line = (f"onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer(bits={bits}, "
            f"block_size={block_size}, is_symmetric={symmetric}, accuracy_level={accuracy_level}, "
            f"algo_config={config}")
    if eight_bit:  # a mixed graph: a second pass over the nodes the first left out
        return (f"{line}, nodes_to_exclude=<{eight_bit} nodes>), then over those: MatMulNBitsQuantizer(bits=8, "
                f"block_size={block_size}, is_symmetric=True, accuracy_level={accuracy_level})")
    return line + ")"


def _tie_embedding_to_nbits_head(model) -> str:
    """Make the fp32 token-embedding lookup of `model` (an `onnx.ModelProto`, in place) read the LM head's
    MatMulNBits weights (one packed row of (N, blocks, bytes) per token), and drop the fp32 table. Integer (or no)
    zero points: `GatherBlockQuantized` over the head's own initializers, viewed as (vocab, ...); HQQ's float zero
    points, which `GatherBlockQuantized` does not take: the row gathered, unpacked and dequantized by standard
    operators, `(q - zero_point) * scale` per block, as MatMulNBits computes it. Returns what was done."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    tables = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims)
              == 2 and inits[n.input[0]].data_type == onnx.TensorProto.FLOAT]
    tables.sort(key=lambda n: n.input[1] != "input_ids")  # the token lookup reads the ids (not the positions)
    heads = {}
    for n in graph.node:
        if n.op_type == "MatMulNBits" and n.input[1] in inits:
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            heads.setdefault((int(a["N"]), int(a["K"])), (n, a))
    lookup = next((n for n in tables if tuple(inits[n.input[0]].dims) in heads), None)
    if lookup is None:
        return "own fp32 table (the LM head was not quantized by MatMulNBits)"
    vocab, n_embd = (int(d) for d in inits[lookup.input[0]].dims)
    head, attrs = heads[(vocab, n_embd)]
    bits, block = int(attrs["bits"]), int(attrs["block_size"])
    data, scales = head.input[1], head.input[2]
    zp = head.input[3] if len(head.input) > 3 and head.input[3] else None
    ids, out, p = lookup.input[1], lookup.output[0], "effkit_tied"
    const = lambda name, value: graph.initializer.append(  # noqa: E731
        numpy_helper.from_array(np.asarray(value), f"{p}_{name}"))
    const("rows", np.array([vocab, -1], dtype=np.int64))
    float_zp = zp is not None and inits[zp].data_type != onnx.TensorProto.UINT8
    if not float_zp:
        new = [helper.make_node("Reshape", [data, f"{p}_rows"], [f"{p}_q"]),
               helper.make_node("Reshape", [scales, f"{p}_rows"], [f"{p}_scales"])]
        if zp is not None:  # packed like the data along a row (low-order bits first)
            new.append(helper.make_node("Reshape", [zp, f"{p}_rows"], [f"{p}_zp"]))
        new.append(helper.make_node(
            "GatherBlockQuantized", [f"{p}_q", ids, f"{p}_scales", *([f"{p}_zp"] if zp is not None else [])], [out],
            domain="com.microsoft", bits=bits, block_size=block, gather_axis=0, quantize_axis=1,
            name=f"{p}_embedding"))
        how = f"GatherBlockQuantized (bits={bits}" + (", the head's uint8 zero points)" if zp else ")")
    else:
        blocks = -(-n_embd // block)
        const("axes", np.array([-1], dtype=np.int64))
        const("block_shape", np.array([0, 0, blocks, block], dtype=np.int64))
        const("out_shape", np.array([0, 0, n_embd], dtype=np.int64))
        new = [helper.make_node("Gather", [data, ids], [f"{p}_packed"], axis=0)]  # (B, T, blocks, bytes)
        if bits == 4:  # two weights a byte, the first in the low-order bits
            const("mask", np.array(15, dtype=np.uint8))
            const("shift", np.array(4, dtype=np.uint8))
            new += [helper.make_node("BitwiseAnd", [f"{p}_packed", f"{p}_mask"], [f"{p}_lo"]),
                    helper.make_node("BitShift", [f"{p}_packed", f"{p}_shift"], [f"{p}_hi"], direction="RIGHT"),
                    helper.make_node("Unsqueeze", [f"{p}_lo", f"{p}_axes"], [f"{p}_lo1"]),
                    helper.make_node("Unsqueeze", [f"{p}_hi", f"{p}_axes"], [f"{p}_hi1"]),
                    helper.make_node("Concat", [f"{p}_lo1", f"{p}_hi1"], [f"{p}_pairs"], axis=-1)]
            unpacked = f"{p}_pairs"
        elif bits == 8:
            unpacked = f"{p}_packed"
        else:
            raise EffkitError(f"the tied embedding cannot read a {bits}-bit head with float zero points")
        new += [helper.make_node("Reshape", [unpacked, f"{p}_block_shape"], [f"{p}_qb"]),  # (B, T, blocks, block)
                helper.make_node("Cast", [f"{p}_qb"], [f"{p}_qf"], to=onnx.TensorProto.FLOAT)]
        for name, src in (("zp", zp), ("scale", scales)):  # one per (token, block), broadcast over the block
            new += [helper.make_node("Reshape", [src, f"{p}_rows"], [f"{p}_{name}_rows"]),
                    helper.make_node("Gather", [f"{p}_{name}_rows", ids], [f"{p}_{name}_g"], axis=0),
                    helper.make_node("Unsqueeze", [f"{p}_{name}_g", f"{p}_axes"], [f"{p}_{name}_u"])]
        new += [helper.make_node("Sub", [f"{p}_qf", f"{p}_zp_u"], [f"{p}_c"]),
                helper.make_node("Mul", [f"{p}_c", f"{p}_scale_u"], [f"{p}_w"]),
                helper.make_node("Reshape", [f"{p}_w", f"{p}_out_shape"], [out])]
        how = "standard operators ((q - zero_point) * scale per block: GatherBlockQuantized takes no float zero points)"
    nodes = []
    for n in graph.node:
        nodes.extend(new if n is lookup else [n])
    del graph.node[:]
    graph.node.extend(nodes)
    table = lookup.input[0]
    if not any(table in n.input for n in graph.node):
        graph.initializer.remove(inits[table])
    return f"read from the {bits}-bit LM head through {how}, stored once, as the PyTorch model ties them"


def quantize_int4(src: Path, dst: Path, block_size: int = INT4_BLOCK, accuracy_level: int | None = None,
                  algorithm: str = "rtn", bits: int = 4, calibration: list[dict[str, np.ndarray]] | None = None,
                  eight_bit: Collection[str] = ()) -> dict[str, Any]:
    """Weight-only block quantization by ONNX Runtime's `MatMulNBitsQuantizer` of every MatMul with a constant
    weight, the LM head included, to `bits` (4, or 8 with `rtn`) in blocks of `block_size` along the input
    dimension; `accuracy_level`, MatMulNBits' attribute: 1 computes in fp32 over the dequantized weights, 4
    quantizes the activations to int8 per block for the int8 kernels, None writes no attribute (ONNX Runtime's
    default 0, fp32 on the CPU). `algorithm`:

    - `rtn`: its default (`DefaultWeightOnlyQuantConfig`): round-to-nearest, symmetric (no zero points);
    - `hqq`: Half-Quadratic Quantization (`HQQWeightOnlyQuantConfig`, torch): scales and float zero points
      fitted to each block without data (asymmetric; ONNX Runtime computes float zero points in fp32 whatever the
      level);
    - `gptq`: GPTQ (`GPTQWeightOnlyQuantConfig`) over `calibration`, feeds of the graph's inputs
      (`calibration_feeds`): the rounding error of each input row compensated on the rows not yet rounded,
      weighted by the activations' Hessian; asymmetric (uint8 zero points): ONNX Runtime re-quantizes GPTQ's
      fake-quantized weights with a fresh scale, which lands on GPTQ's own grid for asymmetric blocks but not for
      symmetric ones (their scale is refitted to the largest level, 16/15 or 14/15 of GPTQ's).

    `eight_bit` (`rtn` at 4 bits only): the names of MatMul nodes written in 8 bits instead (MatMulNBits bits=8,
    the same block size and accuracy level, round-to-nearest): a mixed graph, the rest in 4 bits.

    Then the token-embedding lookup reads that quantized head (`_tie_embedding_to_nbits_head`) and the fp32 table
    is dropped, so the tied weight is stored once. Refused if the file is not smaller than the fp32 graph."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        GPTQWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    if algorithm not in INT4_ALGORITHMS:
        raise EffkitError(f"unknown MatMulNBits algorithm {algorithm!r}; choose one of {', '.join(INT4_ALGORITHMS)}")
    if bits not in (4, 8) or (bits == 8 and algorithm != "rtn"):
        raise EffkitError(f"{algorithm} at {bits} bits: ONNX Runtime's MatMulNBits runs 4 bits, and 8 with rtn only")
    if algorithm == "gptq" and not calibration:
        raise EffkitError("GPTQ needs calibration inputs (calibration_feeds of training blocks)")
    if eight_bit and (algorithm != "rtn" or bits != 4):
        raise EffkitError(f"8-bit layers in a {bits}-bit {algorithm} graph: mixed graphs are 4-bit rtn with some "
                          "layers in 8 bits")
    symmetric = algorithm == "rtn"
    config = (HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits) if algorithm == "hqq" else
              GPTQWeightOnlyQuantConfig(calibration_data_reader=FeedReader(calibration)) if algorithm == "gptq" else
              None)
    with quiet_exporter():
        quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=block_size,
                                         is_symmetric=symmetric, accuracy_level=accuracy_level, algo_config=config,
                                         nodes_to_exclude=list(eight_bit))
        quantizer.process()
        if eight_bit:  # the MatMuls left are exactly those excluded above: the same settings at 8 bits
            quantizer = MatMulNBitsQuantizer(quantizer.model.model, bits=8, block_size=block_size,
                                             is_symmetric=True, accuracy_level=accuracy_level)
            quantizer.process()
        quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)
    model = onnx.load(str(dst))
    set_accuracy_level(model, accuracy_level)  # what was asked, on every node (HQQ's quantizer writes none)
    tied = _tie_embedding_to_nbits_head(model)
    onnx.save(model, str(dst))
    if dst.stat().st_size >= src.stat().st_size:
        raise EffkitError(f"the {bits}-bit graph ({dst.stat().st_size / 2**20:.1f} MiB) is not smaller than the fp32 "
                          f"one ({src.stat().st_size / 2**20:.1f} MiB): something stayed in fp32; use int8")
    calib = {"feeds": len(calibration)} if algorithm == "gptq" else None
    return {"quantizer": _int4_quantizer(algorithm, bits, block_size, accuracy_level, symmetric, calib,
                                         len(eight_bit)),
            "algorithm": algorithm, "bits": bits, "block_size": block_size, "accuracy_level": accuracy_level or 0,
            "symmetric": symmetric,
            "zero_points": ("none (symmetric: the midpoint implied)" if symmetric else
                            "float, one per block (HQQ)" if algorithm == "hqq" else "uint8, one per block"),
            **({"calibration": calib} if calib else {}),
            **({"eight_bit_nodes": sorted(eight_bit)} if eight_bit else {}),
            "token_embedding": tied, "int8": int8_counts(dst)}


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
    model.config.use_cache = True  # how a Hugging Face folder is usually saved (`as_exported` gives it back)
    model.config.save_pretrained(folder)
    model.config.use_cache = False
    tokenizer.save_pretrained(folder)
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


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime over effkit's with-past export (the layout optimum writes)."""

    name = "onnxruntime"
    marker = ONNX_DESC
    label = "ONNX Runtime"
    noun = "an ONNX"  # "is an ONNX artifact"
    summary = "ONNX Runtime, with-past ONNX graph (fp32 or dynamic int8)"
    format = "onnx"
    portability = PORTABILITY
    peer_tag = "peer-onnxruntime-int8"
    peer_how = ("the with-past ONNX export of the reference (the layout optimum writes) + "
                "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, MatMul and Gemm), per tensor")
    settle_s = SETTLE_S

    def available(self, device: torch.device | None = None, path: Path | None = None, **options: Any) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs ONNX artifacts on the CPU only; use --device cpu"
        return onnx_unavailable()

    def load(self, path: Path, device: torch.device) -> OnnxCausalLM:
        if device.type != "cpu":
            raise EffkitError(f"{path} is an ONNX artifact, which effkit runs on the CPU only; use --device cpu")
        return OnnxCausalLM(path)

    def convert(self, folder: Path, source: Path, model: nn.Module, tokenizer, int8: bool = False,
                fuse: bool = False, **options: Any) -> dict[str, Any]:
        return write_artifact(folder, model, tokenizer, int8=int8, fused=fuse)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        ran = {"precision": desc["precision"], "past_key_values": desc["past_key_values"], "runtime": desc["runtime"],
               "exporter": desc["exporter"], "opset": desc["opset"],
               "fused_operators": desc.get("fused_operators", "not applied (--fuse to apply)"),
               "int8_operators": desc.get("int8", {})}
        return ran, {"max_abs_logit_diff_vs_pytorch": desc["max_abs_logit_diff_vs_pytorch"],
                     "parity": desc["parity"]}

    def write_peer(self, folder: Path, reference: Path, model: nn.Module, tokenizer) -> dict[str, Any]:
        return write_artifact(folder, model, tokenizer, int8=True, fused=False, standard_int8=True)

    def quantized_layers(self, model: nn.Module, path: Path | None = None) -> int:
        return quantized_layers(model)

    def computation(self, path: Path) -> str | None:
        return graph_digest(path)

    def load_command(self, path: Path) -> str:
        """With the session options effkit timed it with (`session`): ONNX Runtime's defaults but the thread
        counts, which are written out so that a machine with another default runs what was measured."""
        return (f"so = onnxruntime.SessionOptions(); so.intra_op_num_threads = {torch.get_num_threads()}; "
                f"so.inter_op_num_threads = 1; onnxruntime.InferenceSession('{Path(path) / ONNX_FILE}', so, "
                "providers=['CPUExecutionProvider'])")


ENGINE = OnnxRuntimeEngine()
