"""`effkit export --format onnx | ctranslate2 | openvino | gguf [--int8]`: a dense or pruned artifact for another
engine (ONNX Runtime, with past key/values; CTranslate2 through its own converter; OpenVINO; llama.cpp: any engine
of `effkit.engines` with a `format`), reloaded from its folder alone and measured against its PyTorch parent with
quantize's protocol (held-out loss per block, interleaved prefill latency at every prefill workload, generation), so
`bench`, `generate` and the engine itself can use it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, stageplan, workloads
from effkit.artifacts.loader import engine_of, kind, quantized_layers
from effkit.config import DataConfig, ExportConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import evaluation, hardware, memory
from effkit.measure.compare import bf16_not_run, compare_with_parent, generate_sample
from effkit.model import load_model
from effkit.registry import ENGINES
from effkit.report import write_stage_report


def export_tag(cfg: ExportConfig, source: Path) -> str:
    """`onnx` / `onnx-int8` / `ctranslate2-int8` for the dense model, `prune-row-r2+onnx-int8` for a pruned one."""
    tag = cfg.what.format + (f"-{cfg.what.type}" if cfg.what.type else "-int8" if cfg.what.int8 else "")
    return f"{source.name}+{tag}" if artifacts.read_meta(source)["stage"] == "prune" else tag


def engine_for(fmt: str):
    """The engine that writes `--format fmt` (an engine's `format`)."""
    found = [e for _, e in ENGINES.items() if e.format == fmt]
    if not found:
        formats = [e.format for _, e in ENGINES.items() if e.format]
        raise EffkitError(f"unknown --format {fmt!r}; choose one of {', '.join(formats)}")
    return found[0]


def write(cfg: ExportConfig, folder: Path, source: Path, parent, tokenizer) -> tuple[dict[str, Any], Any, dict]:
    """Write the export into `folder` and reload it from there: (description, model, what_ran keys)."""
    engine = engine_for(cfg.what.format)
    desc = engine.convert(folder, source, parent, tokenizer, int8=cfg.what.int8, fuse=cfg.what.fuse,
                          **({"type": cfg.what.type} if cfg.what.type else {}))
    ran, _ = engine.exported(desc, folder, cfg.what.int8)
    return desc, engine.load(folder, torch.device("cpu")), ran


def run_export(cfg: ExportConfig) -> dict[str, Any]:
    cfg, source = _checked(cfg)
    plan = export_plan(cfg)  # before the parent is loaded: one that does not fit stops here, unless --force
    stageplan.check(plan, cfg.what.force)
    run_dir = Path(cfg.folders.runs_dir) / artifacts.run_of(source)
    with artifacts.run_lock(run_dir), memory.PeakMemory(torch.device("cpu")) as mem:
        return _export(cfg, source, run_dir, memory_of=lambda: {
            "plan": plan.to_dict(), **mem.record()})


def _checked(cfg: ExportConfig) -> tuple[ExportConfig, Path]:
    """The validated config and its source artifact, or one line saying why this export cannot run."""
    cfg = cfg.validate()
    engine = engine_for(cfg.what.format)
    if reason := engine.available(None, int8=cfg.what.int8):
        raise EffkitError(f"--format {cfg.what.format} cannot run here: {reason}")
    source = artifacts.resolve_artifact(cfg.what.source, cfg.folders.runs_dir)
    meta = artifacts.read_meta(source)
    if kind(source) != "pytorch":
        what = engine_of(source).label if kind(source) != "quantized" else "int8"
        raise EffkitError(f"{source} is a {meta['stage']} artifact ({what}); export a dense or pruned PyTorch "
                          f"artifact (its parent: {meta.get('parent')}), with --int8 for int8")
    if cfg.what.fuse and cfg.what.format != "onnx":
        raise EffkitError("--fuse applies to --format onnx (ONNX Runtime's fusions)")
    if cfg.what.type and cfg.what.type not in (types := getattr(engine, "types", ())):
        with_types = [e.format for _, e in ENGINES.items() if getattr(e, "types", ())]
        raise EffkitError(f"unknown --type {cfg.what.type!r} for --format {cfg.what.format}; choose one of "
                          f"{', '.join(types)}" if types else
                          f"--type applies to --format {' or '.join(with_types)}; --format {cfg.what.format} takes "
                          "--int8")
    return cfg, source


def _export(cfg: ExportConfig, source: Path, run_dir: Path,
            memory_of: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    device = torch.device("cpu")  # the engines' CPU paths; the parent is timed on the same device
    data_section = artifacts.data_section(source, cfg.what.data)
    data_cfg = DataConfig.from_dict(data_section)
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    tokenizer, eval_blocks, block, n_bytes = (prepared.tokenizer, prepared.blocks.eval, data_cfg.block_size,
                                              prepared.blocks.eval_bytes)
    docs = prepared.blocks.eval_docs
    parent = load_model(str(source)).eval()
    parent_fp32 = evaluation.evaluate(parent, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes, docs=docs)
    parent_bf16 = None if bf16_not_run(device) else evaluation.evaluate(  # not on a CPU without native bf16
        parent, eval_blocks, cfg.measure.batch_size, torch.bfloat16, eval_bytes=n_bytes, docs=docs)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.measure.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)
    tag = export_tag(cfg, source)
    engine = engine_for(cfg.what.format)
    default = (getattr(engine, "types", ()) or ("fp32",))[0]  # an engine with several weight types: its default
    label = f"{engine.label} {cfg.what.type or ('int8' if cfg.what.int8 else default)}"
    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        desc, model, ran = write(cfg, tmp, source, parent, tokenizer)  # measured as its folder alone reloads it
        q = evaluation.evaluate(model, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes, docs=docs)
        q["generation"] = generate_sample(model, tokenizer, cfg.measure.gen_tokens)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m, verdicts, protocol = compare_with_parent(cfg.measure, device, parent, model, tokenizer, block, parent_fp32,
                                                    parent_bf16, q, label, artifact=tmp)
        quantized = cfg.what.int8 or cfg.what.type  # a stored type may be quantized (gguf q8_0)
        m.update(params=desc["params"], int8_layers_reloaded=quantized_layers(tmp, model) if quantized else 0,
                 portability=engine.portability)
        m.update(engine.exported(desc, tmp, cfg.what.int8)[1])
        if "parity" in desc:
            protocol["export_check"] = (f"parity gate before writing: {desc['parity']['how']}; max |logit "
                                        f"difference| {desc['parity']['max_abs_logit_diff']:.1e}")
        meta_out = artifacts.write_meta(tmp, "export", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={cfg.what.format: desc})
    report = {
        "stage": "export", "tag": tag, "parent": str(source), "run": run_dir.name, "artifact": str(artifact),
        "load_command": engine.load_command(artifact),  # the engine's own way, outside effkit
        "time": meta_out["time"], "config": cfg.to_dict(), "metrics": m, "verdicts": verdicts,
        "what_ran": {"device": hardware.describe_device(device), "format": cfg.what.format, **ran, "world_size": 1,
                     "source_model": str(source), "data": data_section["source"],
                     "tokenizer": prepared.tokenizer_source,
                     "parallel": "none", "amp_dtype": "fp32 activations" + (
                         f", {cfg.what.type} weights" if cfg.what.type else ", int8 weights" if cfg.what.int8 else ""),
                     "cpu_flags": " ".join(hardware.cpu_flags())},
        "versions": meta_out["versions"], "git_commit": meta_out["git_commit"],
        "protocol": protocol,
        "memory": memory_of() if memory_of else None,  # the plan made before the stage, beside the peak it measured
    }
    write_stage_report(Path(cfg.folders.reports_dir) / run_dir.name, report)
    return report


# ------------------------------------------------------------------------------------------ the memory plan (#47)
MIB = 2**20
# How much each part weighs, from one calibration: `effkit export --from <run>/train --format F --fixed-rounds
# --latency-rounds 2 --latency-repeats 1` (F: onnx, openvino, ctranslate2, gguf) of two random-init artifacts, gpt2
# (92.1M parameters, 351.5 MiB in fp32) and gpt2-mini (13.9M, 53.0 MiB), both with 8,192 tokens and blocks of 128,
# the process' RSS sampled every 5 ms around each step of `_export`; on a 2-core x86-64 with AVX512-BF16 (bf16
# evaluated) and 24 GiB, torch 2.13 CPU, onnxruntime 1.32, OpenVINO 2026.4, CTranslate2 4.8.5, xllamacpp 2026.10
# (issue #47). A part that grows with the model is a + b x P (P: the parent's fp32 bytes), the line through the two
# measurements.
EXPORT_PROCESS = 480 * MIB  # the RSS before the parent loads, 319-400 MiB, + transformers' own objects of a load
# beyond its tensors and its mapped file, 48-112 MiB
# the parent's evaluations leave 31-110 MiB beyond its bf16 copies, with logits of 16 MiB (batch 4 x 128 x 8,192):
# counted as three copies of one batch's logits
EVAL_LOGIT_COPIES = 3
# the conversion at its own peak (`write`: the converter, its parity check, the export loaded to check it): the peak
# during `write` less the RSS before it, gpt2 / gpt2-mini: onnx 1,089 / 283 MiB, openvino 1,968 / 343 (with
# record_attention's pipelines), ctranslate2 669 / 169 (with its thread choice), gguf 2,820 / 328 (its line would
# go below zero at the origin: the one through gpt2's and the origin, 97 MiB above gpt2-mini's)
CONVERSION_PEAK = {"onnx": (139.9 * MIB, 2.700), "openvino": (159.0 * MIB, 0.548),
                   "ctranslate2": (80.2 * MIB, 1.675), "gguf": (0.0, 8.023)}
# the conversion's residue (kept by the allocator) with the export loaded in its engine: the RSS after `write`
# less before it, gpt2 / gpt2-mini: onnx 954 / 238 MiB, openvino 719 / 143, ctranslate2 518 / 36 (its line would
# go below zero: the one through gpt2's and the origin, 42 MiB above gpt2-mini's), gguf 347 / 126
CONVERSION = {"onnx": (110.9 * MIB, 2.399), "openvino": (143.0 * MIB, 0.585), "ctranslate2": (0.0, 1.474),
              "gguf": (86.8 * MIB, 0.740)}
# the export's evaluation, its greedy sample and the interleaved timing beside the parent (peak: prefill at
# batch 12): the peak after `write` less the RSS after it, gpt2 / gpt2-mini: onnx 695 / 357 MiB, openvino 1,548 /
# 454 (its sample builds openvino_genai's LLMPipeline: 494 / 41), ctranslate2 539 / 272, gguf 1,413 / 382 (llama.cpp
# loads the export on its first evaluation); openvino's constant 100 MiB above its line: a held-out model between
# the two (29.9M parameters, d 512, 8 blocks) peaked 69 MiB above it
TIMING = {"onnx": (297.0 * MIB, 1.132), "openvino": (366.0 * MIB, 0.631), "ctranslate2": (225.0 * MIB, 0.894),
          "gguf": (198.9 * MIB, 3.454)}
# of TIMING's constant, this many batch-12 logits (batch 12 x block x vocabulary, fp32): both calibration models
# had one vocabulary and one block, so its share is not measured; counted as the logits of one forward and a copy
TIMING_LOGIT_COPIES = 2
# OpenVINO maps its IR's weights file (the .bin: the parent's fp32 weights) where the other engines read theirs: its
# pages are file-backed and clean, and the kernel drops them when memory runs short, as it drops the parent's mapped
# safetensors. So openvino's three lines above count the anonymous part of the resident set alone (its high-water
# mark less its file-backed pages), and EXPORT_FILE_MAPS the .bin's mapped pages at the conversion's peak and after
# it, in copies of the parent's fp32 bytes (one per load of the IR alive: the parity check's, the export's own,
# LLMPipeline's), a reclaimable part of the plan. Measured on gpt2 and gpt2-large (2,746 MiB of fp32 weights), the
# rest as above, the parent exported in place (session 22), gpt2 / gpt2-large in MiB: the conversion's peak 351 /
# 1,664, its residue with the export loaded 348 / 1,748, the evaluation and timing 587 / 2,099 (anonymous); the .bin's
# pages 1.84x / 2.00x the fp32 bytes at the conversion's peak, 2.17x / 2.02x after it (the larger kept). Before,
# openvino's lines had counted those pages as memory that must fit: 5.44x, 1.93x and 3.67x the fp32 bytes
EXPORT_FILE_MAPS = {"openvino": (2.00, 2.17)}
CALIBRATION_BLOCK, CALIBRATION_VOCAB = 128, 8192  # the calibration models' block and vocabulary
CALIBRATION_BATCH = 12  # the calibration exports' largest timed prefill batch


def safetensors_bytes(folder: Path) -> tuple[int, int]:
    """(the model's fp32 bytes, its weight files' bytes) of a PyTorch artifact, from the safetensors headers alone
    (each tensor's shape; no weight read). A tied LM head is stored once and held once."""
    import math
    import struct

    fp32 = files = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        files += f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        fp32 += 4 * sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return fp32, files


def _line(ab: tuple[float, float], p: int) -> int:
    return int(ab[0] + ab[1] * p)


def export_plan(cfg: ExportConfig, tricks: bool = True) -> stageplan.StagePlan:
    """The memory plan of `effkit export` with `cfg`, from the parent's shapes alone (its safetensors headers,
    config.json and data section; no weight read): the peak of the export's one process, at the larger of its two
    largest moments. Alive at both: the process and its libraries; the parent in fp32 (loaded once, kept to compare
    with) and its weights' file, mapped; what its evaluations left (their logits, and the bf16 copies of its weights
    where bf16 runs). Then either the conversion at its own peak (the converter's working memory and its parity
    check), or, after it, what stays resident of it (kept by the allocator) with the export loaded in its engine (an
    ONNX Runtime session, OpenVINO's compiled model, CTranslate2's generators, llama.cpp's model) and the export's
    own evaluation and timing beside its parent (batch-12 KV caches, logits, the engine's work buffers; the engines'
    generation pipelines). The parts that grow with the model are lines through two measured exports (see
    `CONVERSION`, `CONVERSION_PEAK`, `TIMING`). `tricks`: where it does not fit, name the calibrated formats that
    would."""
    from effkit import memplan
    from effkit.measure.compare import bf16_not_run

    cfg, source = _checked(cfg)
    engine = engine_for(cfg.what.format)
    p, mapped = safetensors_bytes(source)
    mc = json.loads((source / "config.json").read_text())
    data = DataConfig.from_dict(artifacts.data_section(source, cfg.what.data))
    block = min(data.block_size, int(mc.get("n_positions", data.block_size)))
    vocab = int(mc["vocab_size"])
    eval_batch = min(cfg.measure.batch_size, data.eval_blocks)
    device = torch.device("cpu")
    skipped = bf16_not_run(device)
    fmt = cfg.what.format
    measured = fmt in CONVERSION
    # an engine not calibrated: counted as the calibrated one whose residue and timing lines together are steepest
    like = fmt if measured else max(CONVERSION, key=lambda f: CONVERSION[f][1] + TIMING[f][1])
    # the largest prefill `compare_with_parent` times (one per prefill workload): its logits
    batch, tokens = max(((w.batch, w.tokens or block) for w in workloads.of_kind("prefill")), key=lambda w: w[0] * w[1])
    logits12 = batch * tokens * vocab * 4
    calibrated_logits = TIMING_LOGIT_COPIES * CALIBRATION_BATCH * CALIBRATION_BLOCK * CALIBRATION_VOCAB * 4
    parent = {f"the process: Python, torch, transformers, {engine.label}; the tokenizer, the held-out blocks":
              EXPORT_PROCESS,
              "parent: fp32 model": p,
              "the parent's weights' file, mapped (clean pages)": mapped,
              f"the parent's evaluations: logits {eval_batch} x {block} x {vocab} (fp32), kept by the allocator":
              EVAL_LOGIT_COPIES * eval_batch * block * vocab * 4}
    if skipped is None:
        parent["the parent under bf16 autocast: its weights' bf16 copies"] = p // 2
    steepest = max(CONVERSION_PEAK, key=lambda f: CONVERSION_PEAK[f][1])  # an engine not calibrated: the largest
    during = {**parent, f"{engine.label} conversion at its peak: the converter's working memory, its parity check":
              _line(CONVERSION_PEAK[fmt if measured else steepest], p)}
    after = {**parent,
             f"{engine.label} conversion: its residue (kept by the allocator) and the export loaded in its engine":
             _line(CONVERSION[like], p),
             f"the export's evaluation and timing beside its parent, batch {batch} x {tokens}: KV caches, "
             f"logits {batch} x {tokens} x {vocab}, {engine.label}'s work buffers":
             max(0, _line(TIMING[like], p) - calibrated_logits) + TIMING_LOGIT_COPIES * logits12}
    mapped_export = f"the export's weights' file, mapped by {engine.label}'s loads (clean pages)"
    if like in EXPORT_FILE_MAPS:
        during[mapped_export] = int(EXPORT_FILE_MAPS[like][0] * p)
        after[mapped_export] = int(EXPORT_FILE_MAPS[like][1] * p)
    reclaimable = {"the parent's weights' file, mapped (clean pages)", mapped_export}
    moments = {"the conversion, at its own peak": during,
               f"the export evaluated and timed beside its parent (batch {batch}), after the conversion":
               after}
    totals = {m: sum(v for k, v in parts.items() if k not in reclaimable) for m, parts in moments.items()}
    peak = max(totals, key=totals.get)  # by what must fit
    notes = [f"the largest moment: {peak}; must fit " + "; ".join(f"{m}: {t / 2**30:.2f} GiB"
                                                                 for m, t in totals.items()),
             f"parent {p / MIB:,.0f} MiB in fp32 ({p // 4:,} parameters), from its safetensors headers"]
    if skipped is not None:
        notes.append(f"the parent under bf16 autocast: {skipped}")
    if not measured:
        notes.append(f"--format {fmt}: not calibrated; counted as {like}'s after the conversion (the steepest "
                     f"measured lines there) and as the largest measured conversion ({steepest}'s) during it")
    if cfg.what.int8 or cfg.what.type or cfg.what.fuse:
        notes.append("int8, --type and --fuse exports: counted as the fp32 (gguf: f16) export of the format "
                     "(calibrated on those only)")
    name, available = memplan.device_memory(device)
    plan = stageplan.StagePlan("export", moments[peak], name, available, notes, [], EXPORT_METHOD,
                               reclaimable=reclaimable)
    if plan.fits is False and tricks:
        plan.tricks = _smaller_formats(cfg)
    return plan


EXPORT_METHOD = ("the parts alive at the export's largest moment (the conversion at its own peak, or the export "
                 "evaluated and timed beside its parent after it), from the parent's shapes alone (safetensors "
                 "headers, config.json; no weights read): the parent and its mapped file, what its evaluations left, "
                 "and per format the conversion's peak, or its residue with the export in its engine and the "
                 "export's evaluation and timing, each a line in the parent's fp32 bytes through two measured "
                 "exports (gpt2 and gpt2-mini, one CPU; OpenVINO's through gpt2 and gpt2-large, its anonymous memory "
                 "apart from the pages of its mapped weights' file)")


def _smaller_formats(cfg: ExportConfig) -> list[str]:
    """The other calibrated formats whose plan fits, the smallest first: `--format F (N GiB)`."""
    out = []
    for fmt in CONVERSION:
        if fmt == cfg.what.format or engine_for(fmt).available(None, int8=cfg.what.int8):
            continue
        other = export_plan(cfg.replace(format=fmt, fuse=False, type=""), tricks=False)
        if other.fits:
            out.append((other.total_bytes, f"--format {fmt} ({other.total_bytes / 2**30:.1f} GiB)"))
    return [t for _, t in sorted(out)]
