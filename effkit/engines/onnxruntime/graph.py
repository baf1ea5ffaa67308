"""What an ONNX artifact holds, and what is read back from its graph without running it: its files and
operators, the runtime's availability, the int8 and 4-bit operators it holds (`int8_counts`), the MatMulNBits
settings that travel in it, the weight bytes one decoded token reads, and the digest of its computation. Nothing
here imports torch: the backends' options read `refused_combination` while a recipe is checked."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError

ONNX_FILE = "model.onnx"
ONNX_DESC = "onnx.json"
OPSET = 23
PORTABILITY = "portable: any ONNX Runtime loads model.onnx (onnxruntime.InferenceSession)"
INT8_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention")
INT4_OPS = ("MatMulNBits", "GatherBlockQuantized")  # ONNX Runtime's block-quantized weight-only operators
INT4_BLOCK = 32
INT4_ALGORITHMS = ("rtn", "hqq", "gptq")  # MatMulNBitsQuantizer's round-to-nearest default, HQQ, GPTQ
LOOKUPS = ("Gather", "GatherBlockQuantized")


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


def refused_combination(algorithm: str, bits: int, accuracy_level: int | None) -> str | None:
    """Why ONNX Runtime cannot run this algorithm at these bits or this accuracy level as asked, or None."""
    if bits == 8 and algorithm == "hqq":
        return "ONNX Runtime's CPU MatMulNBits takes no 8-bit weights with HQQ's float zero points"
    if bits == 8 and algorithm == "gptq":
        return "ONNX Runtime's GPTQ writes MatMulNBits for 4 bits only (other widths stay fp32)"
    if algorithm == "hqq" and accuracy_level == 4:
        return ("HQQ's float zero points: ONNX Runtime computes those MatMulNBits in fp32 at any accuracy level "
                "(level 4 would run fp32)")
    return None


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


def matmulnbits_settings(path: Path) -> dict[str, Any]:
    """The settings read back from a graph's MatMulNBits nodes (`bits`, `block_size`, `accuracy_level`, 0 where the
    attribute is absent, as ONNX Runtime reads it; `zero_points`: none, uint8 or float, the type of the fourth
    input): one value each when every node agrees, else the sorted list."""
    import onnx

    graph = onnx.load(str(path)).graph
    types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.data_type).name for i in graph.initializer}
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    seen: dict[str, set] = {"bits": set(), "block_size": set(), "accuracy_level": set(), "zero_points": set()}
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        for k in ("bits", "block_size", "accuracy_level"):
            seen[k].add(int(attrs.get(k, 0)))
        seen["zero_points"].add(types.get(n.input[3], "?") if len(n.input) > 3 and n.input[3] else "none")
    return {**{k: (next(iter(v)) if len(v) == 1 else sorted(v)) for k, v in seen.items()}, "nodes": len(nodes)}


def weight_bytes_per_token(path: Path) -> dict[str, Any]:
    """Bytes of the graph's stored tensors (initializers and Constant nodes) that one decoded token reads at batch 1:
    every tensor a compute node consumes, in full (MatMulNBits' packed weights, scales and zero points, int8
    matrices, LayerNorm vectors, the rest), and of a table only looked up (the position embedding; the token
    embedding where it is not the LM head's own weight) one row. The KV cache, which grows with the context, is
    not a weight and is left out."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    tensors = {i.name: i for i in graph.initializer}
    tensors.update({n.output[0]: a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute
                    if a.name == "value"})
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def lookup_axis(name: str) -> int | None:
        """The axis along which `name` is only ever looked up (through Reshapes), or None if anything reads all."""
        axes = set()
        for n in consumers.get(name, []):
            if n.op_type == "Reshape" and n.input[0] == name:
                axis = lookup_axis(n.output[0])
            elif n.op_type in LOOKUPS and n.input[0] == name:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                axis = int(attrs.get("gather_axis" if n.op_type == "GatherBlockQuantized" else "axis", 0))
            else:
                return None
            if axis is None:
                return None
            axes.add(axis)
        return axes.pop() if len(axes) == 1 else None

    full = rows = 0
    matmulnbits = {i for n in graph.node if n.op_type == "MatMulNBits" for i in n.input[1:]}
    nbits_bytes = 0
    for name, t in tensors.items():
        size = len(t.raw_data) if t.raw_data else numpy_helper.to_array(t).nbytes
        axis = lookup_axis(name) if consumers.get(name) else None
        if axis is not None and len(t.dims) > axis and t.dims[axis] > 0:
            rows += size // int(t.dims[axis])  # one row (of the packed layout) per token
        else:
            full += size
            nbits_bytes += size if name in matmulnbits else 0
    total = full + rows
    return {"bytes_per_token": int(total), "matmulnbits_bytes": int(nbits_bytes), "looked_up_rows_bytes": int(rows),
            "other_bytes": int(full - nbits_bytes), "file_bytes": int(Path(path).stat().st_size),
            "how": "every stored tensor a compute node reads, in full, plus one row of each table that is only looked "
                   "up (Gather / GatherBlockQuantized); the KV cache is not counted"}
