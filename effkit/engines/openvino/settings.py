"""What an OpenVINO artifact runs with, and where each setting travels so that what ships runs as it was measured.

Every setting an effkit artifact is timed with is recorded in `openvino.json` and travels where plain OpenVINO reads
it: the model's rt_info `runtime_options` for what the CPU plug-in reads from there (`CPU_READS_FROM_MODEL`: the KV
cache's precision and group sizes, the dynamic quantization group size), the load command
(`OpenVINOEngine.load_command`) for the rest. The CPU plug-in ignores an `INFERENCE_PRECISION_HINT` or
`INFERENCE_NUM_THREADS` in rt_info, and LLMPipeline reads no rt_info at all (its `ATTENTION_BACKEND` is a constructor
property), so the inference precision (stored in rt_info too, as a record), the thread count and the attention
backend are named in the load command. The precision `default` is pinned when written: the one the plug-in picked
on the machine that measured it.

optimum-intel itself cannot be a dependency (2.2 pins transformers < 5.6 and pulls another torch); what its
`optimum-cli export openvino` writes for a model of this size is reproduced and named as such: weights in fp32 (it
compresses to int8 by default only above a billion parameters), and in the model's `runtime_options`
`KV_CACHE_PRECISION=f16` for unquantized weights and `ACTIVATIONS_SCALE_FACTOR=8.0`
(`optimum/exporters/openvino/convert.py`, `_set_runtime_options`). OpenVINO's CPU plug-in then picks bf16 inference
wherever the CPU reports AVX-512 BF16 (its `INFERENCE_PRECISION_HINT` default), f32 elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from effkit.errors import EffkitError

OV_DESC = "openvino.json"
OV_MODEL = "openvino_model.xml"
PORTABILITY = ("portable: plain OpenVINO loads the folder (openvino_genai.LLMPipeline(path, 'CPU', ...) with the "
               "properties its load line names, optimum.intel.OVModelForCausalLM.from_pretrained(path), or "
               "openvino.Core().read_model)")
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
REWRITE = "write the artifact again (effkit export --format openvino, or effkit quantize --backend openvino)"
MODEL_FILE = "the model's rt_info runtime_options (the CPU plug-in reads it there)"
LOAD_COMMAND = "the load command"


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


def property_name(value: Any) -> str:
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
    return {k: property_name(compiled.get_property(k))
            for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS")}



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

