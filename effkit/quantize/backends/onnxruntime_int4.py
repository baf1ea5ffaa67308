"""`onnxruntime-int4`: weight-only 4-bit (or 8-bit) of the with-past ONNX export through ONNX Runtime's
`MatMulNBitsQuantizer`, the tied token embedding read from the quantized LM head
(`effkit.engines.onnxruntime.quantize_int4`). Batch-1 decoding reads every weight once per token, so halving the
bytes of int8 is what can speed it up; `auto` keeps it only within its loss budget.

How the weights are rounded (`--int4-algorithm`): `rtn` (the default; ONNX Runtime's own round-to-nearest,
symmetric, no zero points), `hqq` (Half-Quadratic Quantization: each block's scale and a float zero point fitted to
its weights, no data; ONNX Runtime computes float zero points in fp32 at any accuracy level, so HQQ runs level 1
only, its embedding read by standard operators, since `GatherBlockQuantized` takes no float zero point; and ONNX
Runtime's CPU kernel runs float zero points on a slow path: one (1x256)x(256x8192) MatMulNBits took 1908 us against
113 without zero points, and the quickstart model's HQQ graph decoded about 15x slower than `rtn`'s) or
`gptq` (GPTQ: the rounding error of each input row compensated on the rows not yet rounded, weighted by the
activations of `GPTQ_CALIBRATION_BLOCKS` blocks of the run's TRAINING split, evenly spaced over it: never the
held-out blocks the loss is then measured on; asymmetric, uint8 zero points: ONNX Runtime re-quantizes GPTQ's
result with a fresh scale, which keeps GPTQ's grid for asymmetric blocks only). `auto` writes all three and judges
them as it judges block sizes: loss first, then speed. `--int4-bits 8` writes MatMulNBits' 8-bit form (`rtn`
only: ONNX Runtime's GPTQ writes MatMulNBits for 4 bits only, and its CPU kernel takes no 8-bit weights with HQQ's
float zero points); the embedding reads it through `GatherBlockQuantized` with bits=8.

Two settings of MatMulNBits decide its speed and its loss, and both travel in the graph as the operator's
attributes: `block_size` (weights per fp32 scale: 32 stores 0.625 bytes per weight, 128 0.53) and
`accuracy_level` (1: fp32 compute over the dequantized weights, what ONNX Runtime's default 0 runs on a CPU; 4:
the activations quantized to int8 per block for the int8 kernels the 4-bit format is built for, which also costs
some loss). `--int4-block-size auto` and `--accuracy-level auto` (the defaults) measure them on this CPU: every
combination left is written and reloaded, its held-out loss paired with the parent's on the same blocks, those whose
loss delta's 95% interval ends within +0.2% of the parent (`INT4_LOSS_BUDGET`, stricter than the stage's
AUTO_LOSS_BUDGET: a setting is not worth any loss) are timed at the run's `--optimize-for` under the decision rule
(`effkit.measure.choice.choose`), a tie within the precision going to the smaller file, then to fp32 compute;
when none reaches +0.2%, the lowest loss is taken without timing. The loss was measured inside the backend, not
left to the stage, because accuracy level 4 quantizes activations: a choice by speed alone could ship a setting
that the stage would only find too lossy afterwards. A graph is quantized once per algorithm, bits and block size;
its other accuracy level is the same weights with the attribute changed.

Mixed graphs (`--int4-share`): the layers least sensitive per weight in 4 bits, the rest in MatMulNBits' 8 bits
(round-to-nearest, the same block size and accuracy level), so that a model whose every-layer 4-bit graph loses too
much keeps most of the saving. Each Linear's sensitivity is the loss increase on `SENSITIVITY_BLOCKS` TRAINING
blocks (never the held-out ones) with its weight alone rounded to 4 bits as MatMulNBits stores it (PyTorch, no
graph written per layer); layers go to 4 bits in order of loss per weight until the share is filled. `auto` tries
the shares of `AUTO_SHARES` in turn, at the block size and accuracy level of the all-4-bit setting with the lowest
loss, only where no all-4-bit setting is within +0.2%, and stops at the first within it.

The decision (every setting's loss and status, the choice's `to_dict()` with its raw samples), the algorithm, the
settings read back from the written graph (bits, block size, accuracy level, zero points), GPTQ's calibration (its
split, blocks and their indices), and the weight bytes a decoded token reads (with the memory-bandwidth bound they
imply, measured in the same run, and the share of it batch-1 decoding reached) are in `onnx.json` (`int4`), which
`quantization.json` holds as `onnx`."""

from __future__ import annotations

import platform
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.quantize.backends.onnxruntime import OnnxRuntime, load_variant, time_settings, within_loss
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
onnx_export = lazy_module("effkit.engines.onnxruntime")

BLOCK_SIZES = (32, 128, 256)  # auto's candidates: ONNX Runtime's default 128; 32, whose finer scales lose less;
# 256, fewer scales to apply (gpt2 shape, Zen 4, level 4: 1.75x int8's batch-1 decoding against 128's 1.50x)
ACCURACY_LEVELS = (1, 4)  # fp32 compute (ONNX Runtime's default 0 runs the same kernels on a CPU), int8 compute
ALGORITHMS = ("rtn", "hqq", "gptq")  # auto's candidates (`effkit.engines.onnxruntime.INT4_ALGORITHMS`)
GPTQ_CALIBRATION_BLOCKS = 32  # training blocks GPTQ's Hessians are measured on (evenly spaced over the split)
SENSITIVITY_BLOCKS = 16  # training blocks each layer's 4-bit sensitivity is measured on (evenly spaced over the split)
AUTO_SHARES = (0.75, 0.5)  # auto's mixed graphs, tried in turn when no all-4-bit setting is within the loss budget
INT4_LOSS_BUDGET = 0.002  # a setting is timed only if its paired loss delta's interval ends within +0.2%
DECODE_TOKENS = 32  # new tokens per timed call (within the model's context)
VARIANTS = ".int4-variants"  # scratch inside the artifact folder, removed before the folder is complete


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


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend onnxruntime-int4`'s own options (flags, recipe keys and --help lines come from
    here)."""

    int4_block_size: str = field(default="auto", metadata={
        "help": "onnxruntime-int4: weights per scale in MatMulNBits: auto (32, 128 or 256, measured: loss, then "
                "speed), 16, 32, 64, 128 or 256",
        "choices": ("auto", "16", "32", "64", "128", "256")})
    accuracy_level: str = field(default="auto", metadata={
        "help": "onnxruntime-int4: MatMulNBits compute: auto (measured: loss, then speed), 1 (fp32, what ONNX "
                "Runtime's default 0 runs on a CPU) or 4 (int8 activations)",
        "choices": ("auto", "1", "4")})
    int4_algorithm: str = field(default="rtn", metadata={
        "help": "onnxruntime-int4: how MatMulNBits' weights are rounded: rtn (round-to-nearest, symmetric), hqq "
                "(Half-Quadratic, float zero points, no data), gptq (calibrated on training blocks) or auto (all "
                "three measured: loss, then speed)",
        "choices": ("rtn", "hqq", "gptq", "auto")})
    int4_bits: str = field(default="4", metadata={
        "help": "onnxruntime-int4: bits per MatMulNBits weight: 4, or 8 (rtn only)",
        "choices": ("4", "8")})
    int4_share: str = field(default="auto", metadata={
        "help": "onnxruntime-int4 (rtn, 4 bits): the share of the matrices' weights in 4 bits, the rest in 8, the "
                "layers least sensitive per weight (measured on training blocks) in 4 bits first: auto (1, and "
                "0.75 then 0.5 where no all-4-bit setting is within +0.2% loss), 1, 0.75 or 0.5",
        "choices": ("auto", "1", "0.75", "0.5")})

    def __post_init__(self):
        from effkit.errors import EffkitError

        if self.int4_algorithm not in ALGORITHMS or self.int4_bits not in ("4", "8") or self.accuracy_level not in (
                "auto", "1", "4"):
            return  # auto, or a value outside the choices (refused by name where the choices are checked)
        level = None if self.accuracy_level == "auto" else int(self.accuracy_level)
        if why := refused_combination(self.int4_algorithm, int(self.int4_bits), level):
            asked = f"--int4-bits {self.int4_bits}" if self.int4_bits != "4" else f"--accuracy-level {level}"
            raise EffkitError(f"--int4-algorithm {self.int4_algorithm} {asked}: {why}")
        if self.int4_share not in ("auto", "1") and (self.int4_algorithm != "rtn" or self.int4_bits != "4"):
            raise EffkitError(f"--int4-share {self.int4_share} mixes 4-bit and 8-bit round-to-nearest layers; use it "
                              "with --int4-algorithm rtn --int4-bits 4, or leave it at auto")


def int8_compute_unavailable() -> str | None:
    """Why accuracy level 4 would not run int8 here (ONNX Runtime falls back to fp32 without a word), or None.
    MLAS's x86 int8 kernels for MatMulNBits start at AVX2 (AVX-512 VNNI has its own)."""
    from effkit.measure import hardware

    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86") and "avx2" not in hardware.cpu_flags():
        return "no AVX2 on this CPU: ONNX Runtime's int8-compute MatMulNBits kernels need it (level 4 would run fp32)"
    return None


def candidates(o: Options, n_embd: int, widths: tuple[int, ...] = ()
               ) -> tuple[list[tuple[str, int, int, int]], dict[str, str]]:
    """The (algorithm, bits, block_size, accuracy_level) settings to write for these options, and those ruled out
    by the CPU, the model's shape or ONNX Runtime: a block must divide the width, since the token embedding reads
    the LM head's packed rows (one padded block would give it a row wider than the model); GPTQ's zero points need
    an even number of blocks in every matmul's input width (`widths`, the width itself at least: ONNX Runtime's
    GPTQ packs them two a byte over the whole matrix, across rows)."""
    from effkit.errors import EffkitError

    sizes = BLOCK_SIZES if o.int4_block_size == "auto" else (int(o.int4_block_size),)
    levels = ACCURACY_LEVELS if o.accuracy_level == "auto" else (int(o.accuracy_level),)
    algorithms = ALGORITHMS if o.int4_algorithm == "auto" else (o.int4_algorithm,)
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


def training_blocks(source: Path, cfg, n: int) -> tuple[Any, dict[str, Any]]:
    """`n` blocks of the TRAINING split of the data the stage reads (its data section, its tokenizer), evenly
    spaced over it, never the held-out blocks; and the record of them."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare

    section = artifacts.data_section(source, cfg.inputs.data)
    train = prepare(DataConfig.from_dict(section), tokenizer_from=str(source)).blocks.train
    n = min(n, len(train))
    picks = [(i * len(train)) // n for i in range(n)]
    return train[picks], {"split": "train", "data": section.get("source"), "blocks": n,
                          "tokens_per_block": int(train.shape[1]), "of_train_blocks": int(len(train)),
                          "block_indices": picks}


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
        from effkit.errors import EffkitError

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


def calibration(source: Path, cfg, config) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """GPTQ's calibration feeds: GPTQ_CALIBRATION_BLOCKS blocks of the TRAINING split of the data the stage reads
    (its data section, its tokenizer), evenly spaced over it, never the held-out blocks; and the record of them."""
    blocks, record = training_blocks(source, cfg, GPTQ_CALIBRATION_BLOCKS)
    feeds = onnx_export.calibration_feeds(blocks, config)
    tokens = int(feeds[0]["input_ids"].shape[1])
    n = record["blocks"]
    return feeds, {**record, "tokens_per_block": tokens, "tokens": n * tokens,
                   "how": f"{n} of the training split's {record['of_train_blocks']} blocks, evenly spaced over it "
                          "(never the held-out blocks the loss is measured on), each one feed of batch 1 with an "
                          "empty past"}


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


LOOKUPS = ("Gather", "GatherBlockQuantized")


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


def _time_b1(model, tokenizer, samples: dict[str, list[list[float]]] | None, name: str, w) -> tuple[float, str]:
    """Batch-1 decoding tokens/s of `model`: from the choice's own samples when it was timed at batch-1 decoding,
    else timed here (the median of 5 calls after a warm-up)."""
    from effkit.measure import generation, stats

    if samples and name in samples and w.kind == "decode" and w.batch == 1:
        return stats.median_of_rounds(samples[name]), f"the choice's samples at {w.name} (median of its rounds)"
    new = min(DECODE_TOKENS, generation.generation_budget(model, tokenizer, DECODE_TOKENS)[0])
    timer = generation.generation_timer(model, tokenizer, new, batch=1)
    timer()
    return statistics.median(timer() for _ in range(5)), f"greedy decoding of {new} tokens from 1 prompt, median of " \
                                                          "5 calls after a warm-up"


def _bandwidth(graph: Path, model, tokenizer, samples, name: str, w) -> dict[str, Any]:
    """Weight bytes per decoded token, the memory-bandwidth bound they set on batch-1 decoding (measured now, in
    this run) and the share of it the artifact reached."""
    from effkit.measure import roofline

    per_token = weight_bytes_per_token(graph)
    rate, rate_how = _time_b1(model, tokenizer, samples, name, w)
    bandwidth, bw_how = roofline.memory_bandwidth()
    bound = bandwidth / per_token["bytes_per_token"]
    out = {"weight_bytes_per_token": per_token, "memory_bandwidth_bytes_per_s": bandwidth,
           "memory_bandwidth_how": bw_how, "bandwidth_bound_tokens_per_s": bound,
           "decode_b1_tokens_per_s": rate, "decode_b1_how": rate_how, "share_of_bound": rate / bound}
    if rate > bound:  # tiny models: the weights stay in the caches and DRAM bandwidth does not bind
        out["bound_note"] = (f"above the DRAM bound: {per_token['bytes_per_token'] / 2**20:.2f} MiB of weights "
                             "per token fit in this CPU's caches, so memory bandwidth is not what limits it")
    return out


class OnnxRuntimeInt4(OnnxRuntime):
    name = "onnxruntime-int4"
    options = Options
    summary = ("ONNX Runtime 4-bit (or 8-bit) weight-only (MatMulNBits: rtn, hqq or gptq; block size and compute "
               "measured)")

    def tag(self, cfg) -> str:
        o = cfg.options.of(Options)
        # a setting asked for by hand is its own artifact beside the measured one
        return ("quantize-onnxruntime-int4"
                + {"rtn": "", "auto": "-auto-algorithm"}.get(o.int4_algorithm, f"-{o.int4_algorithm}")
                + ("" if o.int4_bits == "4" else f"-{o.int4_bits}bit")
                + ("" if o.int4_block_size == "auto" else f"-b{o.int4_block_size}")
                + ("" if o.accuracy_level == "auto" else f"-level{o.accuracy_level}")
                + ("" if o.int4_share in ("auto", "1") else f"-share{round(float(o.int4_share) * 100)}"))

    def refuses(self, cfg) -> str | None:
        if cfg.options.accuracy_level == "4" and (reason := int8_compute_unavailable()):
            return f"--accuracy-level 4: {reason}; use 1 or auto"
        return None

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        def measured(src: Path, dst: Path) -> dict[str, Any]:  # write_artifact's 4-bit step: the measured settings
            return self.choose_settings(src, dst, parent, source, tokenizer, cfg)

        onnx = onnx_export.write_artifact(folder, parent, tokenizer, int8=False, fused=False,
                                          int4=True, int4_quantize=measured)
        int4 = onnx["int4"]
        s = int4["settings"]
        bits = (f"{s['bits']}-bit" if isinstance(s["bits"], int) else
                f"4-bit ({int4['int4_share']:.0%} of the matrices' weights) and 8-bit")
        return {"format": self.format, "include_head": True, "layers": sorted(onnx["int8"]), "onnx": onnx,
                "storage": f"ONNX graph with {bits} block-quantized weights (model.onnx): MatMulNBits "
                           f"({int4['algorithm']}, blocks of {s['block_size']}, accuracy_level "
                           f"{s['accuracy_level']}, zero points {s['zero_points']}; {int4['chosen']}) for every "
                           f"MatMul with a constant weight, the LM head included; token embedding: "
                           f"{onnx['token_embedding']}"}

    def choose_settings(self, src: Path, dst: Path, parent: nn.Module, source: Path, tokenizer,
                        cfg) -> dict[str, Any]:
        """Write every candidate setting of the fp32 graph `src`, keep those within INT4_LOSS_BUDGET of the parent,
        time them (see the module's text) and copy the pick to `dst`. Returns `quantize_int4`'s description of the
        pick with `int4`: the record of the decision, and the settings read back from `dst`. One setting asked by
        hand is written as asked, its loss left to the stage, which measures every artifact's."""
        from effkit import workloads

        o = cfg.options.of(Options)
        widths = tuple(sorted({m.in_features for m in parent.modules() if isinstance(m, nn.Linear)}))
        todo, skipped = candidates(o, parent.config.n_embd, widths)
        table: dict[str, dict[str, Any]] = {n: {"status": why} for n, why in skipped.items()}
        w = workloads.get(cfg.method.optimize_for)
        feeds, calib = calibration(source, cfg, parent.config) if any(a == "gptq" for a, *_ in todo) else (None, None)
        scratch = dst.parent / VARIANTS
        scratch.mkdir(exist_ok=True)
        asked_share = 1.0 if o.int4_share in ("auto", "1") else float(o.int4_share)
        mixing: dict[str, Any] = {}  # the sensitivities, measured once a mixed graph is wanted

        def eight_bit(block: int, share: float) -> tuple[list[str], float]:
            if not mixing:
                blocks, record = training_blocks(source, cfg, SENSITIVITY_BLOCKS)
                mixing.update(blocks=blocks, record=record, nodes=onnx_nodes(src, parent), by_block={},
                              sizes={n: m.weight.numel() for n, m in parent.named_modules()
                                     if isinstance(m, nn.Linear)})
            if block not in mixing["by_block"]:
                mixing["by_block"][block] = sensitivity(parent, mixing["blocks"], block, cfg.measure.batch_size)
            return eight_bit_layers(mixing["by_block"][block], mixing["sizes"], share)

        try:
            descs, models, written = {}, {}, {}

            def write(a: str, bits: int, b: int, lv: int, share: float = 1.0) -> str:
                name = variant_name(a, bits, b, lv, share)
                (scratch / name).mkdir()
                path = scratch / name / onnx_export.ONNX_FILE
                if (a, bits, b, share) in written:  # the same weights: only the accuracy level differs
                    first = written[(a, bits, b, share)]
                    descs[name] = onnx_export.with_accuracy_level(scratch / first / onnx_export.ONNX_FILE, path,
                                                                  descs[first], lv)
                    eight, four = table[first]["eight_bit_layers"], table[first]["int4_share"]
                else:
                    eight, four = eight_bit(b, share) if share < 1 else ([], 1.0)
                    descs[name] = onnx_export.quantize_int4(src, path, b, lv, a, bits, feeds if a == "gptq" else None,
                                                            eight_bit=[mixing["nodes"][n] for n in eight])
                    if a == "gptq":
                        descs[name]["calibration"] = calib
                    written[(a, bits, b, share)] = name
                models[name] = load_variant(scratch / name, dst.parent, parent)
                table[name] = {"algorithm": a, "bits": bits, "block_size": b, "accuracy_level": lv,
                               "size_bytes": path.stat().st_size, "int4_share": four, "eight_bit_layers": eight}
                return name

            for a, bits, b, lv in todo:
                write(a, bits, b, lv, asked_share)
            decision, loss_rule = None, "not measured here: one setting, as asked (the stage measures the artifact's)"
            if len(todo) == 1:
                picked = next(iter(models))
                how = "as asked (--int4-algorithm, --int4-block-size, --accuracy-level, --int4-share)"
                chosen = how
            else:
                within, loss_rule = within_loss(models, table, parent, source, cfg, INT4_LOSS_BUDGET)
                rtn = [n for n in models if table[n]["algorithm"] == "rtn" and table[n]["bits"] == 4]
                if not within and o.int4_share == "auto" and rtn:
                    # fewer layers in 4 bits, the least sensitive kept, at the best all-4-bit setting's block and level
                    best = table[min(rtn, key=lambda n: table[n]["eval_loss"])]
                    for share in AUTO_SHARES:
                        name = write("rtn", 4, best["block_size"], best["accuracy_level"], share)
                        within, _ = within_loss({name: models[name]}, table, parent, source, cfg, INT4_LOSS_BUDGET)
                        if within:
                            break
                if len(within) > 1:
                    # a tie within the precision: the smaller file (fewer bytes per token), then fp32 compute
                    # (level 1: no rounding of the activations, the more accurate of two settings that run alike)
                    picked, decision, how = time_settings(
                        within, models, table, tokenizer, parent, cfg, w,
                        prefer=lambda n: (table[n]["size_bytes"], table[n]["accuracy_level"]),
                        what=f"among the settings within +{INT4_LOSS_BUDGET:.1%} of the parent's loss; a tie goes to "
                             "the smaller file, then to fp32 compute")
                    chosen = f"chosen at {w.name} by measurement: {decision['label']}"
                elif within:
                    picked, how = within[0], f"the only setting within +{INT4_LOSS_BUDGET:.1%} of the parent's loss"
                    chosen = how
                else:
                    picked = min(models, key=lambda n: table[n]["eval_loss"])
                    how = (f"no setting within +{INT4_LOSS_BUDGET:.1%} of the parent's loss: the lowest held-out "
                           "loss, not timed")
                    chosen = f"the lowest loss; none within +{INT4_LOSS_BUDGET:.1%}"
            table[picked]["status"] = "picked"
            shutil.copyfile(scratch / picked / onnx_export.ONNX_FILE, dst)
            record = {"picked": picked, "chosen": chosen, "how_chosen": how, "loss_rule": loss_rule,
                      "algorithm": table[picked]["algorithm"],
                      "settings": matmulnbits_settings(dst),  # what travels: read back from the graph written
                      "calibration": descs[picked].get("calibration"),  # GPTQ's (None for the others)
                      "int4_share": table[picked]["int4_share"],
                      "sensitivity": mixing and {
                          **mixing["record"], "by_block_size": mixing["by_block"],
                          "how": "each Linear's weight alone rounded to 4 bits (symmetric round-to-nearest, as "
                                 "MatMulNBits stores it), the mean loss on these training blocks less the "
                                 "parent's; the layers that lose least per weight go to 4 bits first"} or None,
                      "table": table, "decision": decision}
            record.update(_bandwidth(dst, models[picked], tokenizer, decision and decision["samples"], picked, w))
            return {**descs[picked], "int4": record}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def available(self, device: torch.device | None = None) -> str | None:
        if reason := super().available(device):
            return reason
        try:
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an older ONNX Runtime
            return f"this ONNX Runtime has no MatMulNBitsQuantizer ({type(e).__name__}); pip install -U onnxruntime"
        return None

    def memory(self, cfg) -> Memory:
        # its default settings (their candidates written and timed): the write 1,415 and the reload 418 MiB on
        # gpt2, 610 and 219 on gpt2-mini; kept beside the others in auto's order 225 and 119 (how:
        # effkit.quantize.backends.MEASURED)
        return Memory(write=(467, 2.70), loaded=(184, 0.67), beside=(100, 0.36), measured=MEASURED)


BACKEND = OnnxRuntimeInt4()
