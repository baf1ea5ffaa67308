"""ONNX Runtime's weight-only block quantization (`MatMulNBits`) of an exported graph: `quantize_int4` writes every
MatMul with a constant weight, the LM head included, in 4 bits (or 8 with round-to-nearest) in blocks along the
input, and the tied token embedding then reads the quantized head (`_tie_embedding_to_nbits_head`), so the weight
is stored once. How the weights are rounded (`INT4_ALGORITHMS`): `rtn`, ONNX Runtime's own round-to-nearest
(symmetric, no zero points); `hqq`, Half-Quadratic Quantization (a scale and a float zero point fitted to each
block, no data; ONNX Runtime computes float zero points in fp32 at any accuracy level and runs them on a slow path,
and `GatherBlockQuantized` takes none, so the embedding reads them through standard operators); `gptq`, GPTQ over
calibration feeds of training blocks (`calibration_feeds`; asymmetric: ONNX Runtime re-quantizes GPTQ's result
with a fresh scale, which keeps GPTQ's grid for asymmetric blocks only).

Two settings of MatMulNBits decide its speed and its loss, and both travel in the graph as the operator's
attributes: `block_size` (weights per fp32 scale) and `accuracy_level` (1: fp32 compute over the dequantized
weights, what ONNX Runtime's default 0 runs on a CPU; 4: the activations quantized to int8 per block for the int8
kernels the format is built for, which also costs some loss). `candidates` lists the settings a backend's options
ask for that run here; a graph quantized once is re-stamped for another level (`with_accuracy_level`).

Mixed graphs: the layers least sensitive per weight in 4 bits, the rest in MatMulNBits' 8 bits (round-to-nearest,
the same block size and level). Each Linear's sensitivity is the loss increase with its weight alone rounded to 4
bits as MatMulNBits stores it (`rtn4`, in PyTorch: no graph written per layer); `eight_bit_layers` fills the 4-bit
share in order of loss per weight, and `onnx_nodes` finds each Linear's MatMul in the graph."""

from __future__ import annotations

import platform
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines.decoder_step import quiet_exporter
from effkit.engines.onnxruntime.graph import INT4_ALGORITHMS, INT4_BLOCK, int8_counts, refused_combination
from effkit.engines.onnxruntime.runtime import empty_past
from effkit.errors import EffkitError

BLOCK_SIZES = (32, 128, 256)  # auto's candidates: ONNX Runtime's default 128; 32, whose finer scales lose less;
# 256, fewer scales to apply (its speed against 128's: docs/benchmarks.md)
ACCURACY_LEVELS = (1, 4)  # fp32 compute (ONNX Runtime's default 0 runs the same kernels on a CPU), int8 compute
GPTQ_CALIBRATION_BLOCKS = 32  # training blocks GPTQ's Hessians are measured on (evenly spaced over the split)
SENSITIVITY_BLOCKS = 16  # training blocks each layer's 4-bit sensitivity is measured on (evenly spaced over the split)
AUTO_SHARES = (0.75, 0.5)  # auto's mixed graphs, tried in turn when no all-4-bit setting is within the loss budget

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


def int8_compute_unavailable() -> str | None:
    """Why accuracy level 4 would not run int8 here (ONNX Runtime falls back to fp32 without a word), or None.
    MLAS's x86 int8 kernels for MatMulNBits start at AVX2 (AVX-512 VNNI has its own)."""
    from effkit.measure import hardware

    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86") and "avx2" not in hardware.cpu_flags():
        return "no AVX2 on this CPU: ONNX Runtime's int8-compute MatMulNBits kernels need it (level 4 would run fp32)"
    return None


def candidates(o: Any, n_embd: int, widths: tuple[int, ...] = ()
               ) -> tuple[list[tuple[str, int, int, int]], dict[str, str]]:
    """The (algorithm, bits, block_size, accuracy_level) settings to write for the options `o` (the backend's:
    `int4_block_size`, `accuracy_level`, `int4_algorithm`, `int4_bits`), and those ruled out
    by the CPU, the model's shape or ONNX Runtime: a block must divide the width, since the token embedding reads
    the LM head's packed rows (one padded block would give it a row wider than the model); GPTQ's zero points need
    an even number of blocks in every matmul's input width (`widths`, the width itself at least: ONNX Runtime's
    GPTQ packs them two a byte over the whole matrix, across rows)."""
    sizes = BLOCK_SIZES if o.int4_block_size == "auto" else (int(o.int4_block_size),)
    levels = ACCURACY_LEVELS if o.accuracy_level == "auto" else (int(o.accuracy_level),)
    algorithms = INT4_ALGORITHMS if o.int4_algorithm == "auto" else (o.int4_algorithm,)
    bits = int(o.int4_bits)
    skipped: dict[str, str] = {}
    for b in [b for b in sizes if n_embd % b]:
        if o.int4_block_size != "auto":
            raise EffkitError(f"--int4-block-size {b} does not divide this model's width ({n_embd}); choose a "
                              "divisor of it (16, 32, 64, ...) or auto")
        skipped.update({variant_name(a, bits, b, lv): f"not run: blocks of {b} do not divide the model's width "
                        f"({n_embd})" for a in algorithms for lv in levels})
    sizes = tuple(b for b in sizes if not n_embd % b)
    if o.accuracy_level == "auto" and (reason := int8_compute_unavailable()):
        levels = tuple(lv for lv in levels if lv != 4)
        skipped.update({variant_name(a, bits, b, 4): f"not run: {reason}" for a in algorithms for b in sizes})
    todo = []
    for a in algorithms:
        for b in sizes:
            odd = sorted({w for w in (n_embd, *widths) if -(-w // b) % 2})
            packs = (f"ONNX Runtime's GPTQ packs zero points two a byte across rows, and an input width of {odd[0]} "
                     f"holds an odd number of blocks of {b}") if a == "gptq" and odd else None
            if packs and o.int4_block_size != "auto" and o.int4_algorithm != "auto":
                raise EffkitError(f"--int4-algorithm gptq --int4-block-size {b}: {packs}; choose a smaller block")
            for lv in levels:
                if why := refused_combination(a, bits, lv) or packs:
                    skipped[variant_name(a, bits, b, lv)] = f"not run: {why}"
                else:
                    todo.append((a, bits, b, lv))
    if not todo:
        raise EffkitError("no MatMulNBits setting of these options runs here: "
                          + next(iter(skipped.values()), "none asked").removeprefix("not run: "))
    return todo, skipped


def variant_name(algorithm: str, bits: int, block_size: int, accuracy_level: int, share: float = 1.0) -> str:
    """`block32-level1` for 4-bit round-to-nearest (the default), else prefixed: `gptq-block32-level4`,
    `8bit-block32-level1`; a mixed graph suffixed with its 4-bit share: `block32-level4-share75`."""
    return "-".join([*([algorithm] if algorithm != "rtn" else []), *([f"{bits}bit"] if bits != 4 else []),
                     f"block{block_size}", f"level{accuracy_level}", *([f"share{round(share * 100)}"]
                                                                      if share < 1 else [])])


def rtn4(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """`weight` (out, in) rounded to 4 bits as MatMulNBits' symmetric round-to-nearest stores it: blocks of
    `block_size` along the input, each scaled so that its largest-magnitude weight lands on -8, rounded and clipped
    to [-8, 7]."""
    out, k = weight.shape
    pad = -k % block_size
    w = torch.nn.functional.pad(weight.float(), (0, pad)).view(out, -1, block_size)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    scale = torch.where(extreme == 0, torch.ones_like(extreme), extreme / -8)
    q = (w / scale).round().clamp(-8, 7)
    return (q * scale).view(out, -1)[:, :k].to(weight.dtype)


def sensitivity(parent: nn.Module, blocks, block_size: int, batch_size: int) -> dict[str, float]:
    """Each Linear's sensitivity to 4 bits: the mean loss on `blocks` (training blocks) with that layer's weight
    alone rounded by `rtn4`, less the parent's. A tied LM head rounds the embedding with it, as the artifact's
    embedding reads the quantized head."""
    from effkit.measure import evaluation

    parent.eval()
    base = evaluation.evaluate(parent, blocks, batch_size)["eval_loss"]
    out = {}
    with torch.no_grad():
        for name, m in parent.named_modules():
            if isinstance(m, nn.Linear):
                kept = m.weight.detach().clone()
                m.weight.copy_(rtn4(kept, block_size))
                try:
                    out[name] = evaluation.evaluate(parent, blocks, batch_size)["eval_loss"] - base
                finally:
                    m.weight.copy_(kept)
    return out


def onnx_nodes(src: Path, parent: nn.Module) -> dict[str, str]:
    """The exported graph's MatMul node that computes each Linear of `parent` (`{linear name: node name}`): the
    node whose constant weight holds that Linear's weight transposed, as the export writes it."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(src)).graph
    inits = {i.name: i for i in graph.initializer}
    linears = {n: m.weight.detach().cpu().numpy() for n, m in parent.named_modules() if isinstance(m, nn.Linear)}
    found: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or len(inits[node.input[1]].dims) != 2:
            continue
        k, n = (int(d) for d in inits[node.input[1]].dims)
        corner = numpy_helper.to_array(inits[node.input[1]])[:4, :4]
        for name, w in linears.items():
            if name not in found and w.shape == (n, k) and (w[:4, :4].T == corner).all():
                found[name] = node.name
                break
    missing = sorted(set(linears) - set(found))
    if missing:
        raise EffkitError(f"no MatMul of the exported graph holds the weight of {', '.join(missing[:3])}: cannot "
                          "place 8-bit layers; use --int4-share 1")
    return found


def eight_bit_layers(sens: dict[str, float], sizes: dict[str, int], share: float) -> tuple[list[str], float]:
    """The layers left in 8 bits so that at most `share` of the weights are in 4 bits: the layers that lose least
    per weight go to 4 bits first (a knapsack filled greedily by loss per weight). Returns them and the share of
    the weights in 4 bits."""
    total = sum(sizes.values())
    four, used = [], 0
    for name in sorted(sens, key=lambda n: sens[n] / sizes[n]):
        if used + sizes[name] <= share * total:
            four.append(name)
            used += sizes[name]
    return sorted(set(sens) - set(four)), used / total


def matmulnbits_unavailable() -> str | None:
    """Why this ONNX Runtime cannot write MatMulNBits (an older one has no `MatMulNBitsQuantizer`), or None."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an older ONNX Runtime
        return f"this ONNX Runtime has no MatMulNBitsQuantizer ({type(e).__name__}); pip install -U onnxruntime"
    return None
