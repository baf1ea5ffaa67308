"""ONNX Runtime's dynamic int8 of an exported graph, in two forms: effkit's (`quantize_int8`: every MatMul and the
lookups, the token embedding then read from the int8 LM head, `tie_embedding_to_head`, so the tied weight is stored
once) and ONNX Runtime's defaults (`quantize_standard`: the form a user of ONNX Runtime gets, the peer row's).
Both go through `quantize_dynamic`, which runs ONNX Runtime's quantizer with one fp32 copy of the graph alive
(its shape inference replaced by `infer_shapes_in_place`, which leaves the weights out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effkit.engines.decoder_step import quiet_exporter
from effkit.engines.onnxruntime.graph import int8_counts
from effkit.measure.memory import give_back_freed

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
    shape inference (the peak it reaches: docs/benchmarks.md). Here the loaded graph goes straight into the
    quantizer, whose shape inference runs without the weights (`infer_shapes_in_place`). Where ONNX Runtime's
    internals differ (another version), its public call."""
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


def quantize_standard(src: Path, dst: Path) -> dict[str, Any]:
    """ONNX Runtime's `quantize_dynamic` as a user who exported the graph would run it (QInt8 weights, per tensor),
    limited to MatMul and Gemm (left to every op type it knows it turns ONNX `Attention` into an invalid
    `QAttention`); no effkit edits: the peer row effkit's own int8 is judged against."""
    with quiet_exporter():
        quantize_dynamic(src, dst, False, ["MatMul", "Gemm"])
    return {"quantizer": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, op_types_to_quantize=[MatMul, "
                         "Gemm]), its defaults otherwise (per tensor)", "int8": int8_counts(dst)}


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
