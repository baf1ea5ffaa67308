"""OpenVINO artifacts: the model converted by OpenVINO's own PyTorch front end (`openvino.convert_model`) into the
stateful layout `optimum-cli export openvino` writes for a decoder, optionally with NNCF's weight compression, and
`OpenVINOCausalLM`, which runs one on the CPU behind the few methods effkit's measurement code calls on a model
(`model(ids).logits`, `generate`, `config`, `eval`).

The converted graph is the with-past step effkit exports to ONNX (`engines.decoder_step.WithPast`: inputs
`input_ids`, `attention_mask`, `position_ids`, the past keys and values; outputs `logits` and the presents),
then made stateful as optimum-intel does for its text-generation exports (`optimum.exporters.openvino.stateful`):
a `beam_idx` input gathers the cache rows, and the keys and values become the model's internal state
(`apply_make_stateful_transformation`), so the inputs are `input_ids`, `attention_mask`, `position_ids`,
`beam_idx` and the output `logits`, which `openvino_genai.LLMPipeline` and `optimum.intel.OVModelForCausalLM`
both run. The folder also holds OpenVINO's tokenizer and detokenizer models (`openvino_tokenizers`, which
LLMPipeline needs), the Hugging Face config, generation config and tokenizer, `openvino.json` (how it was
written, what it runs with, where each of those settings travels) and `effkit.json`.

optimum-intel itself cannot be a dependency (2.2 pins transformers < 5.6 and pulls another torch); what its
`optimum-cli export openvino` writes for a model of this size is reproduced here and named as such: weights in
fp32 (it compresses to int8 by default only above a billion parameters), and in the model's `runtime_options`
`KV_CACHE_PRECISION=f16` for unquantized weights and `ACTIVATIONS_SCALE_FACTOR=8.0`
(`optimum/exporters/openvino/convert.py`, `_set_runtime_options`). OpenVINO's CPU plug-in then picks bf16
inference wherever the CPU reports AVX-512 BF16 (its `INFERENCE_PRECISION_HINT` default), f32 elsewhere.

What ships runs as it was measured. Every setting an effkit artifact is timed with is recorded in `openvino.json`
and travels where plain OpenVINO reads it: the model's rt_info `runtime_options` for what the CPU plug-in reads
from there (`CPU_READS_FROM_MODEL`: the KV cache's precision and group sizes, the dynamic quantization group
size), the load command (`OpenVINOEngine.load_command`) for the rest. The CPU plug-in ignores an
`INFERENCE_PRECISION_HINT` or `INFERENCE_NUM_THREADS` in rt_info, and LLMPipeline reads no rt_info at all (its
`ATTENTION_BACKEND` is a constructor property), so the inference precision (stored in rt_info too, as a record),
the thread count and the attention backend are named in the load command. The precision `default` is pinned
when written: the one the plug-in picked on the machine that measured it.

Speed and quality come from the decoder the user runs: `openvino_genai.LLMPipeline`, with the attention backend
recorded in the artifact. Its greedy tokens are checked, on each timer's first call and on each greedy sample,
against effkit's own loop over the same stateful graph compiled with the same settings: a difference in f32 is an
error, one in bf16 (whose arithmetic differs between LLMPipeline's kernels and the graph's by design) is flagged in
the generation note. The held-out loss comes from a forward of that compiled graph (LLMPipeline returns no logits).
LLMPipeline built with its default attention backend (paged attention, "PA") falls back to SDPA silently when PA
cannot be built, and exposes neither which one it built nor the error; built with an explicit
`ATTENTION_BACKEND="PA"` it raises instead (openvino.genai `llm/pipeline.cpp`, 2026.x). So effkit always builds its
own artifacts' pipelines with an explicit backend, and learns what the default ran (the peer's) by building an
explicit PA beside it.

Nothing is written unless it passes a parity gate: the fp32 graph, compiled with f32 inference, reproduces
PyTorch's logits within `EXPORT_RTOL` of the largest logit on a probe batch and PyTorch's greedy tokens with its
cache (the ONNX export's rule, shared in `effkit.engines.decoder_step`). Compressed weights and bf16 inference
change the numbers by design: their loss is measured by the bench like every other artifact's.

Weight compression (`compress`) is NNCF's: int8 and int4 data-free, or int4-data, NNCF's data-aware int4 (AWQ and
scale estimation) calibrated on blocks of the run's training split handed in by the writer (`calibration_blocks`:
evenly spaced training blocks, each run through the stateful graph as a fresh prompt, `calibration_inputs`); both
int4 forms in groups of the largest of 128, 64, 32 that divides every int4 matrix's rows (`int4_group_size`).
`openvino.json` records under `weight_compression` the mode, group size, ratio, the algorithms asked and what AWQ
changed (NNCF's AWQ patterns match no layer of GPT-2's graph: it is asked, and recorded as having changed none), the
calibration blocks' split, count and indices, and the NNCF version.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import Engine, as_exported
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

OV_DESC = "openvino.json"
OV_MODEL = "openvino_model.xml"
PORTABILITY = ("portable: plain OpenVINO loads the folder (openvino_genai.LLMPipeline(path, 'CPU', ...) with the "
               "properties its load line names, optimum.intel.OVModelForCausalLM.from_pretrained(path), or "
               "openvino.Core().read_model)")
# what NNCF stores the matrices in (int8: asymmetric per channel, as optimum; int4: data-free; int4-data: AWQ and
# scale estimation calibrated on training blocks, `compress`)
WEIGHTS = ("fp32", "int8", "int4", "int4-data")
DATA_AWARE = frozenset({"int4-data"})  # the weight formats calibrated on the run's training split
INT4_GROUPS = (128, 64, 32)  # int4-data's group size: the first that divides every int4 matrix's rows
CALIBRATION_BLOCKS = 64  # training blocks int4-data calibrates on (NNCF's subset_size)
PRECISIONS = ("auto", "bf16", "f32")  # the CPU plugin's inference precision; auto: measured on this CPU
# what `optimum-cli export openvino` stores in an unquantized text-generation model's rt_info
OPTIMUM_RUNTIME_OPTIONS = {"ACTIVATIONS_SCALE_FACTOR": "8.0", "KV_CACHE_PRECISION": "f16"}
# what effkit stores in its own artifacts: an f16 KV cache. The CPU plug-in's default, u8 (per token), rounds the
# cache enough to derail greedy decoding through the stateful graph (a pruned model's text turned into repeated
# newlines, docs/benchmarks.md), where f16 and f32 decode as PyTorch does; LLMPipeline's paged cache is another path
EFFKIT_RUNTIME_OPTIONS = {"KV_CACHE_PRECISION": "f16"}
# the runtime options OpenVINO's CPU plug-in reads from a model's rt_info (`intel_cpu::Config::applyRtInfo`, OpenVINO
# 2026.4): only these travel in the model file. It ignores every other key there (INFERENCE_PRECISION_HINT,
# INFERENCE_NUM_THREADS included), so those travel in the load command
CPU_READS_FROM_MODEL = frozenset({"KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
                                  "KEY_CACHE_GROUP_SIZE", "VALUE_CACHE_GROUP_SIZE", "DYNAMIC_QUANTIZATION_GROUP_SIZE"})
ATTENTION = ("PA", "SDPA")  # LLMPipeline's ATTENTION_BACKEND values; the first is its default (and wins a tie)
# a setting of one artifact (its inference precision, its attention backend) is chosen under the decision rule with
# at most this many seconds of head-to-head looks per open contender: it is one knob of one folder, and the
# stage that writes it measures the folder against its parent afterwards anyway
SETTING_BUDGET_S = 10.0
DECODE_TOKENS = 32  # new tokens per timed call of a setting's choice (within the model's context)
REWRITE = "write the artifact again (effkit export --format openvino, or effkit quantize --backend openvino)"


def ov_unavailable() -> str | None:
    """None if OpenVINO runs here, else the reason in one line."""
    try:
        import openvino as ov

        ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    except Exception as e:  # noqa: BLE001 - any import or plug-in failure means: not available
        return f"openvino does not run here ({type(e).__name__}: {str(e)[:100]}); pip install 'effkit[quant]'"
    return None


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plug-in says this CPU can compute in (`OPTIMIZATION_CAPABILITIES`: FP32, BF16, INT8...)."""
    import openvino as ov

    return [str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def bf16_unavailable() -> str | None:
    """None if OpenVINO computes in bf16 natively on this CPU, else why not (it emulates nothing: it falls back)."""
    caps = cpu_capabilities()
    if "BF16" not in caps:
        return f"this CPU has no native bf16 for OpenVINO (its capabilities: {', '.join(caps)})"
    return None


def _stateful(om, n_layer: int, n_head: int, head_dim: int) -> None:
    """Hide the past keys and values inside `om` as state, as optimum-intel's `patch_stateful_decoder` does: a
    `beam_idx` input gathers the cache's rows, the state starts empty (batch from `input_ids`, length 0)."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation


    past, present = past_names(n_layer), present_names(n_layer)
    for name in past:  # the head dimension static: the state's initial shape is read from the input's
        om.input(name).get_node().set_partial_shape(ov.PartialShape([-1, n_head, -1, head_dim]))
    om.validate_nodes_and_infer_types()
    beam = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam.output(0).get_tensor().add_names({"beam_idx"})
    om.add_parameters([beam])
    for name in past:
        port = om.input(name)
        consumers = port.get_target_inputs()
        gathered = opset13.gather(port, beam, opset13.constant(0))
        for c in consumers:
            c.replace_source_output(gathered.output(0))
    om.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(om, dict(zip(past, present, strict=True)))
    ids = om.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), opset13.constant([0]), opset13.constant(0))
    for op in om.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in list(op.get_output_partial_shape(0))]
            dims[0] = batch
            dims = [opset13.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d for d in dims]
            zeros = opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)),
                                      opset13.concat(dims, axis=0))
            op.set_arguments([zeros])
    om.validate_nodes_and_infer_types()


@torch.no_grad()
def convert(model: nn.Module):
    """`model` (effkit's or Hugging Face's GPT-2, CPU, eval) as a stateful OpenVINO model (fp32 weights)."""
    import openvino as ov

    model = model.cpu().eval()
    c = model.config
    wrapper = WithPast(model).eval()
    b, n, p = 2, min(5, c.n_positions - 3), 3
    head_dim = c.n_embd // c.n_head
    example = (probe_ids(c.vocab_size, (b, n)), torch.ones(b, p + n, dtype=torch.long),
               torch.arange(p, p + n).expand(b, n).contiguous(),
               *(torch.zeros(b, c.n_head, p, head_dim) for _ in past_names(c.n_layer)))
    try:
        with quiet_exporter():
            om = ov.convert_model(wrapper, example_input=example)
        for port, name in zip(om.inputs, ["input_ids", "attention_mask", "position_ids", *past_names(c.n_layer)],
                              strict=True):
            port.get_tensor().set_names({name})
        for port, name in zip(om.outputs, ["logits", *present_names(c.n_layer)], strict=True):
            port.get_tensor().set_names({name})
        _stateful(om, c.n_layer, c.n_head, head_dim)
    except EffkitError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise EffkitError(f"OpenVINO cannot convert this model: {type(e).__name__}: {first[:200]}") from None
    return om


def int4_group_size(model: nn.Module, weights: str = "int4-data") -> int:
    """The int4 group size for `model`: the largest of INT4_GROUPS that divides the input width of every matrix NNCF
    stores in int4 (every linear layer but the LM head; the embeddings and the head stay int8), since NNCF refuses a
    group that does not divide a row. None of them dividing: one line naming the widths and the fix."""
    widths = set()
    for name, m in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            continue
        if isinstance(m, nn.Linear):
            widths.add(m.in_features)
        elif type(m).__name__ == "Conv1D":  # Hugging Face's GPT-2 layout: weight (in, out)
            widths.add(int(m.weight.shape[0]))
    for g in INT4_GROUPS:
        if all(w % g == 0 for w in widths):
            return g
    odd = sorted(w for w in widths if w % INT4_GROUPS[-1])
    raise EffkitError(f"--weight-format {weights}: NNCF's int4 groups of {'/'.join(map(str, INT4_GROUPS))} divide no "
                      f"row of this model's matrices of width {', '.join(map(str, odd))}; prune with "
                      f"--width-multiple {INT4_GROUPS[-1]}, or use --weight-format int8")


def calibration_blocks(train: torch.Tensor, n: int = CALIBRATION_BLOCKS) -> tuple[np.ndarray, list[int]]:
    """`n` blocks of the training split `train` ((blocks, block_size) token ids), evenly spaced over it (all of
    them where it has fewer): the data-aware compression's calibration set, never a held-out block. Returns (the
    blocks as int64, their indices in `train`)."""
    total = int(train.shape[0])
    idx = sorted({int(i) for i in np.linspace(0, total - 1, min(n, total)).round()})
    return train[idx].numpy().astype(np.int64), idx


def calibration_inputs(block: np.ndarray) -> dict[str, np.ndarray]:
    """One calibration block as the stateful graph's inputs (a fresh state: NNCF resets it before each item): the
    whole block as the prompt, batch 1, every position attended."""
    n = int(block.shape[-1])
    return {"input_ids": block.reshape(1, n).astype(np.int64), "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}


def compress(om, weights: str, calibration: np.ndarray | None = None, group_size: int = 128) -> dict[str, Any]:
    """NNCF's weight compression of `om` in place. int8: asymmetric per output channel (optimum-cli's
    `--weight-format int8`), data-free. int4: symmetric in groups of `group_size` (128, or 64 / 32 where 128 does
    not divide a matrix's rows: `int4_group_size`) with the embedding / head in int8 (NNCF's defaults for int4),
    data-free. int4-data: NNCF's data-aware int4: asymmetric (the mode OpenVINO's
    documentation gives for accuracy over speed, and optimum-cli's int4 default) in groups of `group_size`, every
    layer but the embedding / head in int4 (ratio 1.0), AWQ and scale estimation calibrated on the `calibration`
    blocks ((n, block_size) token ids of the training split: `calibration_blocks`). Returns what was done:
    `compression` (a line), `nncf` (its version), `weight_compression` (mode, group size, ratio, the algorithms and
    the scales AWQ inserted)."""
    import logging

    import nncf

    if weights == "int8":
        mode, how = nncf.CompressWeightsMode.INT8_ASYM, "nncf.compress_weights(mode=INT8_ASYM): int8 per channel"
        kwargs: dict[str, Any] = {}
        record: dict[str, Any] = {"mode": "INT8_ASYM", "group_size": None, "ratio": None, "data": None}
    elif weights == "int4":
        mode, how = nncf.CompressWeightsMode.INT4_SYM, (f"nncf.compress_weights(mode=INT4_SYM, group_size="
                                                        f"{group_size}, ratio=1.0): int4 in groups of {group_size}, "
                                                        "data-free")
        kwargs = {"group_size": group_size, "ratio": 1.0}
        record = {"mode": "INT4_SYM", "group_size": group_size, "ratio": 1.0, "awq": False, "scale_estimation": False,
                  "data": None}
    elif weights == "int4-data":
        if calibration is None or not len(calibration):
            raise EffkitError("--weight-format int4-data needs calibration blocks of the training split")
        mode = nncf.CompressWeightsMode.INT4_ASYM
        kwargs = {"group_size": group_size, "ratio": 1.0, "awq": True, "scale_estimation": True,
                  "dataset": nncf.Dataset(list(calibration), calibration_inputs), "subset_size": len(calibration)}
        how = (f"nncf.compress_weights(mode=INT4_ASYM, group_size={group_size}, ratio=1.0, awq=True, "
               f"scale_estimation=True, dataset=<{len(calibration)} training blocks of {calibration.shape[1]} "
               f"tokens>): int4 in groups of {group_size}, data-aware")
        record = {"mode": "INT4_ASYM", "group_size": group_size, "ratio": 1.0, "awq": True, "scale_estimation": True}
    else:
        raise EffkitError(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS[1:])}")
    record["backup"] = "INT8_ASYM per channel: the token and position embeddings and the LM head (NNCF's default)" \
        if weights != "int8" else None
    logging.getLogger("nncf").setLevel(logging.ERROR)
    try:
        with quiet_exporter():  # NNCF draws a progress bar on stdout
            nncf.compress_weights(om, mode=mode, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise EffkitError(f"NNCF could not compress this model's weights to {weights}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if weights == "int4-data":
        # AWQ scales a layer's input channels through a Multiply it inserts after the op feeding it; NNCF 3.4 matches
        # only a MatMul fed by a Multiply or by one of its "atomic" activations (ReLU, SiLU, sigmoid...; not Gelu),
        # and says it skipped AWQ only in its log
        smoothed = sorted(op.get_friendly_name() for op in om.get_ops() if op.get_friendly_name().endswith("/awq_mul"))
        record["awq_scales"] = len(smoothed)  # the Multiply nodes AWQ inserted (one per op feeding smoothed layers)
        if not smoothed:
            record["awq_note"] = ("asked, changed no layer: NNCF's AWQ patterns (a MatMul fed by a Multiply or by an "
                                  "activation among ReLU, SiLU, sigmoid..., Gelu not among them) match no layer of "
                                  "this graph (GPT-2's MLP down-projection follows a Gelu, its other matrices a "
                                  "LayerNorm or the attention)")
    return {"compression": how, "nncf": nncf.__version__, "weight_compression": record}


def weight_types(om) -> dict[str, int]:
    """The model's weight constants (rank >= 2) counted by element type: what the file really stores."""
    counts: dict[str, int] = {}
    for op in om.get_ops():
        if op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) >= 2:
            shape = op.get_output_shape(0)
            if int(np.prod(shape)) >= 256:
                t = op.get_output_element_type(0).get_type_name()
                counts[t] = counts.get(t, 0) + 1
    return counts


def compile_config(precision: str, kv_cache: str | None = None) -> dict[str, str]:
    """What effkit passes to `compile_model`: the inference precision (omitted for "default": the plug-in's own
    choice), the KV cache's (None: the plug-in's or the model's runtime_options) and the thread count torch uses
    (every engine in a comparison gets the same threads)."""
    cfg = {"INFERENCE_NUM_THREADS": str(torch.get_num_threads())}
    if precision in ("bf16", "f32"):
        cfg["INFERENCE_PRECISION_HINT"] = precision
    if kv_cache:
        cfg["KV_CACHE_PRECISION"] = kv_cache
    return cfg


def read_description(path: str | Path) -> dict[str, Any]:
    """The artifact's `openvino.json` as a dict, or one line naming the file and the fix."""
    file = Path(path) / OV_DESC
    try:
        desc = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise EffkitError(f"{file} cannot be read ({type(e).__name__}); {REWRITE}") from None
    if not isinstance(desc, dict):
        raise EffkitError(f"{file} holds a JSON {type(desc).__name__}, not an object; {REWRITE}")
    return desc


def _name(value: Any) -> str:
    """A compiled model's property as the string OpenVINO accepts back (`bf16`, not `<Type: 'bfloat16'>`)."""
    return value.get_type_name() if hasattr(value, "get_type_name") else str(value)


def plain_compile_settings(xml: str | Path | None = None) -> dict[str, str]:
    """What `openvino.Core().compile_model(xml, 'CPU')` with no properties runs with here: inference precision, KV
    cache precision, threads (`xml`: None, a one-operator model: the plug-in's defaults alone)."""
    import openvino as ov

    core = ov.Core()
    if xml is None:
        from openvino import opset13

        x = opset13.parameter([1, 4], ov.Type.f32, name="x")
        source: Any = ov.Model([opset13.relu(x)], [x], "probe")
    else:
        source = str(xml)
    compiled = core.compile_model(source, "CPU")
    return {k: _name(compiled.get_property(k))
            for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS")}


MODEL_FILE = "the model's rt_info runtime_options (the CPU plug-in reads it there)"
LOAD_COMMAND = "the load command"


LOOKUP_CHAIN = ("Convert", "Subtract", "Multiply", "Reshape")  # a compressed table's dequantization on its way


def weight_bytes_per_token(folder: Path) -> dict[str, Any]:
    """Bytes of the IR's constants one decoded token reads at batch 1: every constant in full, but of a table that is
    only looked up (a Gather, through its dequantization: the token and position embeddings) one row. A constant
    the file stores once for two uses (the tied embedding / LM head: the head reads all of it) counts once, as the
    head. The KV cache, which grows with the context, is not a weight and is left out."""
    import openvino as ov

    om = ov.Core().read_model(str(folder / OV_MODEL))

    def consumers(node) -> list:
        return [t.get_node() for o in node.outputs() for t in o.get_target_inputs()]

    def only_looked_up(node, depth: int = 0) -> bool:
        users = consumers(node)
        return bool(users) and all(
            u.get_type_name() == "Gather" or (u.get_type_name() in LOOKUP_CHAIN and depth < 6
                                              and only_looked_up(u, depth + 1)) for u in users)

    full = rows = 0
    for n in om.get_ordered_ops():
        if n.get_type_name() != "Constant":
            continue
        size, shape = int(n.get_byte_size()), list(n.get_output_shape(0))
        if len(shape) >= 2 and shape[0] > 0 and only_looked_up(n):
            rows += size // shape[0]
        else:
            full += size
    return {"bytes_per_token": full + rows, "looked_up_rows_bytes": rows,
            "file_bytes": int((folder / OV_MODEL).with_suffix(".bin").stat().st_size),
            "how": "every constant of the IR in full, but one row of each table only looked up (Gather, through its "
                   "dequantization); the tied table counted once, as the LM head; the KV cache not counted"}


def record(folder: Path, desc: dict[str, Any]) -> dict[str, Any]:
    """Store the settings `desc` says the artifact in `folder` runs with where plain OpenVINO reads them, and write
    `desc` as its `openvino.json`: its runtime options (the pinned inference precision among them, as a record) in
    the model's rt_info (the model is rewritten only when they changed), and under `settings` each setting with
    where it travels: the model file for what the CPU plug-in reads from rt_info, the load command for the rest
    (`load_properties`)."""
    import openvino as ov

    xml = folder / OV_MODEL
    options = {k: str(v) for k, v in (desc.get("runtime_options") or {}).items()}
    precision = desc.get("inference_precision")
    if precision in ("bf16", "f32"):
        options["INFERENCE_PRECISION_HINT"] = precision
    om = ov.Core().read_model(str(xml))
    stored = ({k: str(v.astype(str)) for k, v in om.get_rt_info()["runtime_options"].items()}
              if om.has_rt_info(["runtime_options"]) else {})
    if stored != options:
        for name, value in options.items():
            om.set_rt_info(value, ["runtime_options", name])
        # beside it, then over it: the model read maps its weights file, and writing into a mapped file kills the
        # process (SIGBUS)
        tmp = folder / f".{OV_MODEL}.tmp.xml"
        ov.save_model(om, str(tmp), compress_to_fp16=False)
        tmp.with_suffix(".bin").replace(xml.with_suffix(".bin"))
        tmp.replace(xml)
    del om
    plain = plain_compile_settings(xml)
    settings: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name == "INFERENCE_PRECISION_HINT":
            settings[name] = {"value": value, "travels": LOAD_COMMAND,
                              "why": "the CPU plug-in ignores it in rt_info (stored there too, as a record)"}
        elif name in CPU_READS_FROM_MODEL:
            settings[name] = {"value": value, "travels": MODEL_FILE}
        else:
            settings[name] = {"value": value, "travels": "the model's rt_info, as optimum-cli writes it; the CPU "
                                                         "plug-in does not read it"}
    threads = int(desc.get("threads") or torch.get_num_threads())
    settings["INFERENCE_NUM_THREADS"] = {
        "value": threads, "travels": LOAD_COMMAND,
        "why": f"torch's thread count, which every engine was timed with (the plug-in's default here: "
               f"{plain['INFERENCE_NUM_THREADS']}); rt_info cannot carry it, so a machine with another default "
               "still runs what was measured"}
    if desc.get("peer"):
        settings["INFERENCE_NUM_THREADS"] = {"value": threads, "travels": "set by effkit's bench: a deviation from "
                                                                         "the defaults, listed under deviations"}
    if desc.get("attention"):
        settings["ATTENTION_BACKEND"] = {
            "value": desc["attention"], "travels": LOAD_COMMAND,
            "why": "LLMPipeline reads no rt_info; named, it also refuses to fall back from PA to SDPA silently"}
    desc["runtime_options"] = options  # what the model's rt_info holds
    desc["threads"] = threads
    desc["settings"] = settings
    desc["plain_compile_here"] = plain
    if not desc.get("peer"):
        desc["load_properties"] = {k: s["value"] for k, s in settings.items() if s["travels"] == LOAD_COMMAND}
        from_model = ", ".join(f"{k}={s['value']}" for k, s in settings.items() if s["travels"] == MODEL_FILE)
        desc["runtime"] = ("openvino_genai.LLMPipeline(path, 'CPU'" +
                           "".join(f", {k}={v}" for k, v in desc["load_properties"].items()) + ")" +
                           (f"; from the model's rt_info: {from_model}" if from_model else ""))
    (folder / OV_DESC).write_text(json.dumps(desc, indent=2))
    return desc


def load_properties(desc: dict[str, Any]) -> dict[str, Any]:
    """The properties the load command passes: what the artifact was timed with and the model file cannot carry
    (an artifact written before they were recorded: its pinned precision and attention backend)."""
    if isinstance(desc.get("load_properties"), dict):
        return desc["load_properties"]
    props: dict[str, Any] = {}
    if desc.get("inference_precision") in ("bf16", "f32"):
        props["INFERENCE_PRECISION_HINT"] = desc["inference_precision"]
    if desc.get("attention"):
        props["ATTENTION_BACKEND"] = desc["attention"]
    return props


class OpenVINOCausalLM(nn.Module):
    """An OpenVINO artifact behind effkit's model interface. It holds no PyTorch parameters: `n_params` is the
    source's parameter count. `precision`: the inference precision to compile with (None: the artifact's);
    `kv_cache`: the KV cache's (None: the plug-in's default, u8 on CPUs, or the model's runtime_options).
    Forward (the loss, prefill) runs the compiled stateful graph; `generate` and the bench's decode timers run
    `openvino_genai.LLMPipeline` with the attention backend the artifact records, checked against effkit's own
    loop over the graph (`loop_generate`)."""

    compilable = False  # OpenVINO compiles its own graph

    def __init__(self, path: str | Path, precision: str | None = None, kv_cache: str | None = None):
        super().__init__()
        import openvino as ov
        from transformers import GPT2Config

        path = Path(path)
        if reason := ov_unavailable():
            raise EffkitError(f"{path} is an OpenVINO artifact, which cannot run here: {reason}")
        self.description = read_description(path)
        try:
            self.config = GPT2Config.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise EffkitError(f"{path} is not a complete OpenVINO artifact ({type(e).__name__}); {REWRITE}") \
                from None
        if not (path / OV_MODEL).is_file():
            raise EffkitError(f"{path} has no {OV_MODEL}; {REWRITE}")
        self.precision = precision or self.description.get("inference_precision", "default")
        self.kv_cache = kv_cache
        try:
            core = ov.Core()
            self.compiled = core.compile_model(str(path / OV_MODEL), "CPU",
                                               compile_config(self.precision, kv_cache))
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file, or a plug-in crash on this CPU
            raise EffkitError(f"OpenVINO cannot compile {path / OV_MODEL}: {type(e).__name__}: {str(e)[:160]}; "
                              f"{REWRITE}") from None
        self.request = self.compiled.create_infer_request()
        self._pipelines: dict[str | None, Any] = {}  # by ATTENTION_BACKEND (None: LLMPipeline's default)
        self._pipeline_errors: dict[str | None, str] = {}
        self._decoding: tuple[str | None, str] | None = None
        self.decoder_checks: list[dict[str, Any]] = []  # LLMPipeline's greedy tokens against effkit's loop
        # no idle time after it is timed: its threads do not spin-wait after a call (measured; docs/benchmarks.md)
        self.settle_s = 0.0
        self.inference_precision = _name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.kv_cache_precision = _name(self.compiled.get_property("KV_CACHE_PRECISION"))
        self.n_params = int(self.description.get("params", 0))
        self.path = path
        self.compile_note = (f"OpenVINO {ov.__version__} CPU plug-in: inference precision "
                             f"{self.inference_precision}, KV cache {self.kv_cache_precision}, "
                             f"{self.compiled.get_property('INFERENCE_NUM_THREADS')} threads")

    @property
    def generation_note(self) -> str:
        """How it decodes: the plug-in's settings, the pipeline and its attention backend (once built), and how its
        greedy tokens compared with effkit's loop over the same graph."""
        if self._decoding is None:
            return self.compile_note
        key, how = self._decoding
        if self.pipeline(key) is None:
            return (f"{self.compile_note}; decoding: not run: openvino_genai.LLMPipeline "
                    f"({self.why_no_pipeline(key)}); decoded by effkit's Python loop over the infer request")
        note = f"{self.compile_note}; decoding: openvino_genai.LLMPipeline {_genai_version()}, attention {how}"
        if self.decoder_checks:
            note += ("; its greedy tokens against effkit's loop over the same compiled graph: " +
                     "; ".join(_check_line(c) for c in self.decoder_checks))
        return note

    def pipeline(self, attention: str | None = None):
        """`openvino_genai.LLMPipeline` over this folder (its C++ decoding loop and KV cache manager), compiled with
        this model's settings and `attention` (LLMPipeline's ATTENTION_BACKEND: "PA", paged attention and
        continuous batching, or "SDPA", the stateful graph; None: no ATTENTION_BACKEND, its default, which falls
        back from PA to SDPA silently); None, with the reason in `why_no_pipeline(attention)`, where it cannot be
        built (no tokenizer models, openvino_genai missing, that backend failing)."""
        if attention not in self._pipelines and attention not in self._pipeline_errors:
            try:
                import openvino_genai

                if not (self.path / "openvino_tokenizer.xml").is_file():
                    raise EffkitError("the folder has no openvino_tokenizer.xml")
                extra = {"ATTENTION_BACKEND": attention} if attention else {}
                self._pipelines[attention] = openvino_genai.LLMPipeline(
                    str(self.path), "CPU", **compile_config(self.precision, self.kv_cache), **extra)
            except Exception as e:  # noqa: BLE001 - the reason is reported; the caller decides
                # OpenVINO's messages run over several lines (the check, then why): one line, both kept
                self._pipeline_errors[attention] = f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"
        return self._pipelines.get(attention)

    def why_no_pipeline(self, attention: str | None = None) -> str:
        return self._pipeline_errors.get(attention, "")

    def default_attention(self) -> tuple[str, str]:
        """Which attention backend LLMPipeline built with its default runs here, as (backend, how). It exposes
        neither, and falls back from PA to SDPA silently; built with an explicit ATTENTION_BACKEND="PA" it raises
        instead, so an explicit PA pipeline that builds means the default built PA too (the same code path)."""
        if self.pipeline("PA") is not None:
            return "PA", ("PA (paged attention), LLMPipeline's default: an explicit ATTENTION_BACKEND='PA' builds "
                          "here, so the default did not fall back")
        return "SDPA", (f"SDPA: LLMPipeline's default PA does not build here ({self.why_no_pipeline('PA')}), and "
                        "the default then falls back to SDPA silently")

    def decoding(self) -> tuple[str | None, str]:
        """(what LLMPipeline is built with to decode this artifact: its ATTENTION_BACKEND, None for its default;
        the backend that runs and how it was set, in words). The artifact's recorded backend; the peer's: the
        default, as its users run it, with the backend it falls to; an artifact that records none: the backend
        the default would run, named explicitly."""
        if self._decoding is None:
            d = self.description
            if d.get("attention"):
                self._decoding = d["attention"], d.get("attention_how") or f"{d['attention']}, recorded"
            else:
                ran, how = self.default_attention()
                if d.get("peer"):
                    self._pipelines.pop("PA", None)  # the probe: the peer decodes with the default, as users do
                    self._decoding = None, how
                else:
                    self._decoding = ran, f"{how}; not recorded in the artifact, named explicitly"
        return self._decoding

    def pipeline_generate(self, ids: np.ndarray, new_tokens: int, attention: str | None = None,
                          min_new_tokens: int | None = None,
                          sampling: tuple[int | None, float, int] | None = None) -> np.ndarray:
        """`new_tokens` new tokens by LLMPipeline (end-of-text never ends it, and is never picked among the first
        `min_new_tokens`, default all): greedy, or `sampling` = (top_k, temperature, seed) by its sampler."""
        import openvino as ov
        import openvino_genai

        cfg = openvino_genai.GenerationConfig()
        cfg.max_new_tokens = new_tokens
        cfg.min_new_tokens = new_tokens if min_new_tokens is None else min(min_new_tokens, new_tokens)
        cfg.ignore_eos = True
        if sampling is not None:
            top_k, temperature, seed = sampling
            cfg.do_sample = True
            cfg.temperature = float(temperature)
            cfg.rng_seed = int(seed) % 2**32
            if top_k:
                cfg.top_k = int(top_k)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = self.pipeline(attention).generate(
            openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
        new = np.array(out.tokens, dtype=np.int64)
        if new.shape != (ids.shape[0], new_tokens):
            raise EffkitError(f"LLMPipeline returned {new.shape} tokens, not ({ids.shape[0]}, {new_tokens})")
        return new

    def check_tokens(self, ids: np.ndarray, new: np.ndarray, attention: str | None,
                     min_new_tokens: int | None = None) -> dict[str, Any]:
        """LLMPipeline's greedy tokens `new` for the prompts `ids` against effkit's loop over the same compiled graph
        (`loop_generate`), recorded in `decoder_checks` (and the generation note). A difference in f32 inference is
        an error: the speed measured would not be this model's decoding. In bf16 it is flagged: LLMPipeline's
        kernels and the graph's round differently by design, and greedy decoding amplifies a near tie."""
        n = new.shape[1]
        ref = self.loop_generate(ids, n, n if min_new_tokens is None else min_new_tokens)[:, ids.shape[1]:]
        differ = np.flatnonzero((new != ref).any(axis=0))
        entry = {"attention": attention or "LLMPipeline's default", "batch": int(new.shape[0]), "tokens": int(n),
                 "equal": not len(differ), "first_difference": int(differ[0]) if len(differ) else None,
                 "inference_precision": self.inference_precision}
        self.decoder_checks.append(entry)
        if len(differ) and self.inference_precision == "f32":
            raise EffkitError(f"{self.path}: openvino_genai.LLMPipeline ({entry['attention']}) decodes other greedy "
                              f"tokens than effkit's loop over the same graph in f32 inference (from new token "
                              f"{entry['first_difference']} of {n}, batch {entry['batch']}); its speed would not be "
                              "this model's decoding")
        return entry

    def _check_length(self, n: int) -> None:
        if n > self.config.n_positions:
            raise EffkitError(f"{n} tokens exceed the model's context ({self.config.n_positions})")

    def _step(self, ids: np.ndarray, done: int) -> np.ndarray:
        b, n = ids.shape
        self.request.infer({"input_ids": ids, "attention_mask": np.ones((b, done + n), np.int64),
                            "position_ids": np.broadcast_to(np.arange(done, done + n, dtype=np.int64), (b, n)),
                            "beam_idx": np.arange(b, dtype=np.int32)})
        return self.request.get_tensor("logits").data

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        self._check_length(input_ids.shape[-1])
        self.request.reset_state()
        logits = self._step(input_ids.detach().cpu().long().numpy(), 0)
        return SimpleNamespace(logits=torch.from_numpy(np.array(logits, dtype=np.float32)))

    def loop_generate(self, ids: np.ndarray, max_new_tokens: int, min_new_tokens: int = 0, do_sample: bool = False,
                      top_k: int | None = None, temperature: float = 1.0, streamer=None) -> np.ndarray:
        """Prompts and exactly `max_new_tokens` new tokens by effkit's own loop over the compiled stateful graph and
        its internal KV cache (the ONNX artifact's loop and rules: end-of-text never picked among the first
        `min_new_tokens`; sampling from torch's generator): the reference LLMPipeline is checked against."""
        ids = np.asarray(ids, dtype=np.int64)
        self._check_length(ids.shape[1] + max_new_tokens - 1)
        if streamer is not None:
            streamer.put(torch.from_numpy(ids))
        self.request.reset_state()
        todo, done, eos = ids, 0, self.config.eos_token_id
        for k in range(max_new_tokens):
            logits = self._step(todo, done)[:, -1, :]
            done += todo.shape[1]
            nxt = next_tokens(never_end(logits, eos) if k < min_new_tokens else logits, do_sample, top_k,
                              temperature)
            ids, todo = np.concatenate([ids, nxt], axis=1), nxt
            if streamer is not None:
                streamer.put(torch.from_numpy(nxt))
        if streamer is not None:
            streamer.end()
        return ids

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **_: Any) -> torch.Tensor:
        """Prompts and exactly `max_new_tokens` new tokens by the decoder the artifact's users run: LLMPipeline with
        its recorded attention backend (end-of-text never picked among the first `min_new_tokens`; sampling by its
        sampler, seeded from torch's initial seed). Greedy tokens are checked against effkit's loop
        (`check_tokens`). Where LLMPipeline cannot be built, effkit's loop decodes (the generation note says so)."""
        ids = input_ids.cpu().long().numpy()
        self._check_length(ids.shape[1] + max_new_tokens - 1)
        key, _ = self.decoding()
        if self.pipeline(key) is None:
            return torch.from_numpy(self.loop_generate(ids, max_new_tokens, min_new_tokens, do_sample, top_k,
                                                       temperature, streamer))
        sampling = (top_k, temperature, torch.initial_seed()) if do_sample else None
        new = self.pipeline_generate(ids, max_new_tokens, key, min_new_tokens, sampling)
        if not do_sample:
            self.check_tokens(ids, new, key, min_new_tokens)
        if streamer is not None:  # LLMPipeline streams text, one row only: the tokens are handed over at the end
            streamer.put(torch.from_numpy(ids))
            streamer.put(torch.from_numpy(new))
            streamer.end()
        return torch.from_numpy(np.concatenate([ids, new], axis=1))


def _check_line(c: dict[str, Any]) -> str:
    where = f"batch {c['batch']}, {c['tokens']} tokens, {c['attention']}"
    if c["equal"]:
        return f"equal ({where})"
    return (f"DIFFERENT from new token {c['first_difference']} ({where}; {c['inference_precision']} inference: "
            "flagged, the two round differently)")


def pipeline_timer(model: OpenVINOCausalLM, ids: np.ndarray, new_tokens: int, attention: str | None):
    """A no-argument timer of LLMPipeline's greedy decoding of `new_tokens` from the prompts `ids`, returning new
    tokens per second (all rows). Its first call (every caller's warm-up) also checks the tokens against effkit's
    loop over the same graph (`OpenVINOCausalLM.check_tokens`), outside the timed span."""
    checked: list[bool] = []

    def once() -> float:
        t = time.perf_counter()
        new = model.pipeline_generate(ids, new_tokens, attention)
        seconds = time.perf_counter() - t
        if not checked:
            model.check_tokens(ids, new, attention)
            checked.append(True)
        return ids.shape[0] * new_tokens / seconds

    once.settle_s = model.settle_s
    return once


def _choice_line(decided: dict[str, Any], noun: str) -> str:
    """`Choice.line` of a recorded choice (its `to_dict()`)."""
    from dataclasses import fields

    from effkit.measure import choice

    return choice.Choice(**{f.name: decided[f.name] for f in fields(choice.Choice) if f.name in decided}).line(noun)


def choose_attention(model: OpenVINOCausalLM, tokenizer, workload: str = "decode-b1", rule=None) -> dict[str, Any]:
    """LLMPipeline's attention backend for the artifact `model`, decoding at the batch of `workload`: PA and SDPA,
    each built with an explicit ATTENTION_BACKEND (so neither falls back to the other unseen), timed under the
    decision rule (`effkit.measure.choice.choose`, `rule`: at most SETTING_BUDGET_S of head-to-head looks per open
    contender by default; a tie goes to PA, LLMPipeline's default) and cached per machine, OpenVINO version,
    weights, precision, model size and batch, with the date. A backend that cannot be built is "not run: <reason>"
    and the other is taken untimed. Returns {"attention", "how", "workload", and "decision": the choice's
    `to_dict()`, every call of every sample, where timed}."""
    import openvino

    from effkit import workloads
    from effkit.measure import choice, hardware, machine_cache

    w = workloads.get(workload)
    rule = rule or choice.Rule(budget_s=SETTING_BUDGET_S)
    missing = {a: model.why_no_pipeline(a) for a in ATTENTION if model.pipeline(a) is None}
    if len(missing) == len(ATTENTION):
        return {"attention": None, "workload": w.name,
                "how": "not chosen: " + "; ".join(f"{a}: not run: {why}" for a, why in missing.items())}
    if missing:
        (other, why), = missing.items()
        only = next(a for a in ATTENTION if a not in missing)
        return {"attention": only, "workload": w.name, "not_run": {other: why},
                "how": f"{only}, untimed: {other}: not run: {why}"}
    start = tokenizer(_prompt(), return_tensors="np").input_ids
    new = max(1, min(DECODE_TOKENS, model.config.n_positions - start.shape[1]))
    ids = np.repeat(start, w.batch, axis=0)
    d = model.description
    key = (f"{hardware.describe_device(torch.device('cpu'))}|threads {torch.get_num_threads()}|openvino "
           f"{openvino.__version__}|genai {_genai_version()}|weights {d.get('weights')}|{model.inference_precision}|"
           f"params {d.get('params', 0)}|batch {w.batch}|{new} tokens|{choice.RULE_VERSION}|precision "
           f"{rule.precision}|budget {rule.budget_s}")

    def measure() -> dict[str, Any]:
        timers = {a: pipeline_timer(model, ids, new, a) for a in ATTENTION}
        return choice.choose(timers, True, rule, prefer=ATTENTION.index).to_dict()

    decided, _ = machine_cache.machine_cached("openvino_attention_choice", key, measure)
    return {"attention": decided["picked"], "workload": w.name, "decision": decided,
            "line": f"{_choice_line(decided, '')} at {w.name}, timed when the artifact was written",
            "how": f"{_choice_line(decided, '')} at {w.name} (greedy decoding of {new} new tokens from {w.batch} "
                   f"prompt(s) by LLMPipeline, new tokens/s; each backend named explicitly); a tie goes to PA, "
                   f"LLMPipeline's default; the rule: {rule.describe()}; "
                   f"{machine_cache.cache_note('openvino_attention_choice', key)}"}


def record_attention(folder: Path, tokenizer, workload: str = "decode-b1", rule=None) -> dict[str, Any]:
    """Choose the attention backend of the artifact in `folder` (`choose_attention`) and record it (`record`): its
    description, as written."""
    model = OpenVINOCausalLM(folder)
    chosen = choose_attention(model, tokenizer, workload, rule)
    del model
    desc = read_description(folder)
    desc.update(attention=chosen["attention"], attention_how=chosen.get("line", chosen["how"]), attention_choice=chosen)
    return record(folder, desc)


def _prompt() -> str:
    from effkit.measure import generation

    return generation.GENERATION_PROMPT


@torch.no_grad()
def check_parity(model: nn.Module, folder: Path) -> dict[str, Any]:
    """The gate of an fp32 conversion, compiled with f32 inference and an f32 KV cache: logits within EXPORT_RTOL x
    max(1, max |logit|) of PyTorch's on a (3, 24) probe batch, and PARITY_TOKENS greedy tokens of effkit's loop over
    the stateful graph equal to PyTorch's with its cache."""
    ov_model = OpenVINOCausalLM(folder, precision="f32", kv_cache="f32")  # the conversion, not the u8 cache
    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    reference = model(probe).logits
    diff = float((ov_model(probe).logits - reference).abs().max())
    allowed = EXPORT_RTOL * max(1.0, float(reference.abs().max()))
    if not diff <= allowed:
        raise EffkitError(f"the converted OpenVINO model does not reproduce the model (max logit difference "
                          f"{diff:.2e} > {allowed:.2e}); this model cannot be converted faithfully")
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    ours = torch.from_numpy(ov_model.loop_generate(prompt.numpy(), new, new))
    cached = model.generate(prompt, use_cache=True, **kw)
    if not torch.equal(ours, cached):
        raise EffkitError("the converted OpenVINO model's greedy tokens with its internal KV cache differ from "
                          "PyTorch's; this model cannot be converted faithfully")
    return {"max_abs_logit_diff": diff, "max_abs_logit_diff_allowed": allowed, "greedy_tokens_equal": new,
            "how": f"fp32 weights compiled with f32 inference and an f32 KV cache: logits of a (3, {probe.shape[1]}) "
                   f"probe batch within {allowed:.2e} of PyTorch's ({EXPORT_RTOL} of the largest logit's magnitude); "
                   f"{new} greedy tokens with OpenVINO's internal KV cache equal PyTorch's with its cache"}


def _genai_version() -> str:
    import openvino_genai

    return openvino_genai.__version__


def write_tokenizer_models(folder: Path, tokenizer) -> str:
    """OpenVINO's tokenizer and detokenizer models (what LLMPipeline reads), or why they are missing."""
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer

        tok, detok = convert_tokenizer(tokenizer, with_detokenizer=True)
        ov.save_model(tok, str(folder / "openvino_tokenizer.xml"))
        ov.save_model(detok, str(folder / "openvino_detokenizer.xml"))
    except Exception as e:  # noqa: BLE001 - optional for effkit's own artifacts: the model loads without them
        return f"not written: openvino_tokenizers failed ({type(e).__name__}: {str(e)[:100]})"
    return "openvino_tokenizer.xml, openvino_detokenizer.xml (openvino_tokenizers.convert_tokenizer)"


def write_artifact(folder: Path, model: nn.Module, tokenizer, weights: str = "fp32", precision: str = "default",
                   runtime_options: dict[str, str] | None = None, precision_how: str = "",
                   peer: bool = False, calibration: tuple[np.ndarray, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """Convert `model` into `folder`: the stateful IR (weights as `weights`; `runtime_options` stored in it, effkit's
    own by default), the tokenizer models and files, the configs, and `openvino.json`, which says how it was
    written and what it runs with (`record`). `precision`: bf16, f32, or "default", the CPU plug-in's own choice,
    pinned to what it picks here unless `peer` (the peer runs as its users run it). `calibration`: a data-aware
    format's (training blocks, what to record of them: their split, count, indices). Refused unless the fp32
    conversion passes the parity gate."""
    import openvino as ov

    if weights not in WEIGHTS:
        raise EffkitError(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS)}")
    if (weights in DATA_AWARE) != (calibration is not None):
        raise EffkitError(f"OpenVINO weight format {weights}: calibration blocks are given to the data-aware "
                          f"formats ({', '.join(sorted(DATA_AWARE))}) and to no other")
    group = int4_group_size(model, weights) if weights.startswith("int4") else 128  # before the conversion: one line
    if runtime_options is None:
        runtime_options = EFFKIT_RUNTIME_OPTIONS
    if precision == "default" and not peer:
        precision = plain_compile_settings()["INFERENCE_PRECISION_HINT"]
        precision_how = precision_how or (f"the CPU plug-in's default on the CPU that measured it (OpenVINO "
                                          f"{ov.__version__}), pinned; not chosen by measurement")
    with as_exported(model) as m:  # read, not copied, where it is on the CPU in fp32
        return _write_artifact(folder, m, tokenizer, weights, precision, runtime_options, precision_how, peer,
                               calibration, group)


def _write_artifact(folder: Path, model: nn.Module, tokenizer, weights: str, precision: str,
                    runtime_options: dict[str, str], precision_how: str, peer: bool,
                    calibration: tuple[np.ndarray, dict[str, Any]] | None, group: int) -> dict[str, Any]:
    import openvino as ov

    t0 = time.perf_counter()
    om = convert(model)
    seconds = time.perf_counter() - t0
    stored = dict(runtime_options or {})
    if precision in ("bf16", "f32"):
        stored["INFERENCE_PRECISION_HINT"] = precision
    for name, value in stored.items():
        om.set_rt_info(value, ["runtime_options", name])
    model.config.use_cache = True
    model.config.save_pretrained(folder)
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc: dict[str, Any] = {"format": "openvino", "weights": weights, "inference_precision": precision,
                            "precision_how": precision_how, "params": sum(p.numel() for p in model.parameters()),
                            "converter": f"openvino.convert_model (PyTorch front end), OpenVINO {ov.__version__}, "
                                         "made stateful as optimum-intel's patch_stateful_decoder",
                            "convert_seconds": seconds, "runtime_options": dict(runtime_options or {}),
                            "threads": torch.get_num_threads(), **({"peer": True} if peer else {})}
    (folder / OV_DESC).write_text(json.dumps(desc, indent=2))  # the loader needs it for the gate
    desc["parity"] = check_parity(model, folder)
    if weights != "fp32":
        desc.update(compress(om, weights, calibration[0] if calibration else None, group))
        if calibration:
            desc["weight_compression"]["data"] = calibration[1]
        ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc["weight_types"] = weight_types(om)
    del om
    desc["tokenizer_models"] = write_tokenizer_models(folder, tokenizer)
    return record(folder, desc)


def peer_deviations() -> list[str]:
    """How effkit runs the peer other than with LLMPipeline's and OpenVINO's defaults, one line each."""
    threads, plain = torch.get_num_threads(), plain_compile_settings()["INFERENCE_NUM_THREADS"]
    same = " (the same count)" if str(threads) == plain else ""
    return [f"INFERENCE_NUM_THREADS={threads}: torch's thread count, so that every engine in the comparison gets the "
            f"same threads; OpenVINO's own default here is {plain}{same}",
            "the prompt handed over as token ids (openvino_genai.TokenizedInputs): tokenizing is not timed",
            "a greedy GenerationConfig with min_new_tokens = max_new_tokens and ignore_eos=True: it decodes exactly "
            "the tokens every other engine decodes"]


# the default workload a setting is chosen for where the writer names none (`effkit export`): the project's default
# `optimize_for`
DEFAULT_WORKLOAD = "decode-b1"


class OpenVINOEngine(Engine):
    """OpenVINO through its PyTorch front end, in optimum-intel's stateful layout."""

    name = "openvino"
    marker = OV_DESC
    label = "OpenVINO"
    noun = "an OpenVINO"  # "is an OpenVINO artifact"
    summary = ("OpenVINO (stateful IR as optimum-cli writes it; fp32, int8 or int4 weights, int4 data-free or "
               "data-aware; bf16 or f32 inference)")
    format = "openvino"
    portability = PORTABILITY
    peer_tag = "peer-openvino"

    @property
    def peer_how(self) -> str:  # type: ignore[override]
        how = ("what `optimum-cli export openvino` writes for a model of this size (fp32 weights, stateful, "
               "runtime_options KV_CACHE_PRECISION=f16, ACTIVATIONS_SCALE_FACTOR=8.0), decoded by "
               "openvino_genai.LLMPipeline(path, 'CPU') with OpenVINO's defaults (bf16 inference where the CPU has "
               "AVX-512 BF16; the attention backend its default builds, named in the row's notes); held-out loss "
               "from a forward of the same model compiled with the same settings (LLMPipeline returns no logits), "
               "its greedy tokens checked against effkit's loop over that graph")
        if ov_unavailable():
            return how
        return how + "; deviations from the defaults: " + "; ".join(peer_deviations())

    def available(self, device: torch.device | None = None, path: Path | None = None, **options: Any) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs OpenVINO artifacts on the CPU only; use --device cpu"
        return ov_unavailable()

    def load(self, path: Path, device: torch.device) -> OpenVINOCausalLM:
        if device.type != "cpu":
            raise EffkitError(f"{path} is an OpenVINO artifact, which effkit runs on the CPU only; use --device cpu")
        return OpenVINOCausalLM(path)

    def convert(self, folder: Path, source: Path, model: nn.Module, tokenizer, int8: bool = False,
                weights: str | None = None, precision: str = "default", optimize_for: str | None = None,
                **options: Any) -> dict[str, Any]:
        write_artifact(folder, model, tokenizer, weights or ("int8" if int8 else "fp32"), precision)
        return record_attention(folder, tokenizer, optimize_for or DEFAULT_WORKLOAD)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"precision": f"weights {desc['weights']}, inference {desc['inference_precision']}",
                 "runtime": desc["runtime"], "exporter": desc["converter"], "weights": desc["weight_types"],
                 "attention": desc.get("attention_how", "")},
                {"max_abs_logit_diff_vs_pytorch": desc["parity"]["max_abs_logit_diff"], "parity": desc["parity"]})

    def write_peer(self, folder: Path, reference: Path, model: nn.Module, tokenizer) -> dict[str, Any]:
        """The reference as optimum-cli writes it, run as its users run it: LLMPipeline with its defaults. Refused
        (EffkitError: the bench says "not run: <reason>") where LLMPipeline cannot run it: never a stand-in decoder
        under its name."""
        desc = write_artifact(folder, model, tokenizer, "fp32", "default", OPTIMUM_RUNTIME_OPTIONS, peer=True)
        if desc["tokenizer_models"].startswith("not written"):
            raise EffkitError(f"LLMPipeline, which its users run, needs OpenVINO's tokenizer models: "
                              f"{desc['tokenizer_models']}")
        ov_model = OpenVINOCausalLM(folder)
        if ov_model.pipeline(None) is None:
            raise EffkitError(f"openvino_genai.LLMPipeline(path, 'CPU') cannot be built here "
                              f"({ov_model.why_no_pipeline(None)})")
        ran, how = ov_model.default_attention()
        del ov_model
        desc.update(attention_ran=ran, attention_how=how, deviations=peer_deviations())
        (folder / OV_DESC).write_text(json.dumps(desc, indent=2))
        return desc

    def decode(self, model: OpenVINOCausalLM, tokenizer, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None):
        """Greedy decoding as OpenVINO's users run it: `openvino_genai.LLMPipeline` (its C++ loop) with the attention
        backend the artifact records (the peer: LLMPipeline's default), from `batch` copies of the prompt, its
        tokens checked on the first call (`pipeline_timer`). Where LLMPipeline cannot be built, effkit's Python
        loop over the infer request, said so in the generation note; the peer is refused instead."""
        start = tokenizer(_prompt(), return_tensors="np").input_ids
        key, _ = model.decoding()
        if model.pipeline(key) is None:
            if model.description.get("peer"):
                raise EffkitError(f"the OpenVINO peer cannot decode as its users run it: openvino_genai.LLMPipeline "
                                  f"({model.why_no_pipeline(key)})")
            return super().decode(model, tokenizer, batch, new_tokens, generate_kwargs)
        return pipeline_timer(model, np.repeat(start, batch, axis=0), new_tokens, key)

    def quantized_layers(self, model: nn.Module, path: Path | None = None) -> int:
        desc = getattr(model, "description", {})
        return sum(v for k, v in desc.get("weight_types", {}).items() if k in ("u8", "i8", "u4", "i4"))

    def load_command(self, path: Path) -> str:
        """LLMPipeline with the properties the artifact was timed with that its model file cannot carry (`record`);
        where its tokenizer models are missing, the plain `compile_model` with them (LLMPipeline needs those)."""
        desc = read_description(path)
        props = load_properties(desc)
        if str(desc.get("tokenizer_models", "")).startswith("not written"):
            plain = {k: v for k, v in props.items() if k != "ATTENTION_BACKEND"}
            return f"openvino.Core().compile_model('{Path(path) / OV_MODEL}', 'CPU'" + \
                (f", {plain!r}" if plain else "") + ")"
        return f"openvino_genai.LLMPipeline('{path}', 'CPU'" + "".join(f", {k}={v!r}" for k, v in props.items()) + ")"


ENGINE = OpenVINOEngine()
