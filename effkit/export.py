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

from effkit import artifacts, engines, stageplan, workloads
from effkit.artifacts.loader import engine_of, is_quantized, quantized_layers, trainable
from effkit.config import DataConfig, ExportConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import evaluation, generation, hardware, memory
from effkit.measure.compare import bf16_not_run, compare_with_parent, generate_sample
from effkit.model import load_model
from effkit.registry import ENGINES
from effkit.report import StageReport, stamp, write_stage_report


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
    if not trainable(source):
        what = "int8" if is_quantized(source) else engine_of(source).label
        raise EffkitError(f"{source} is a {meta['stage']} artifact ({what}); export a dense or pruned PyTorch "
                          f"artifact (its parent: {meta.get('parent')}), with --int8 for int8")
    if cfg.what.fuse and not engine.fuses:
        fusing = [f"--format {e.format} ({e.label}'s fusions)" for _, e in ENGINES.items() if e.fuses]
        raise EffkitError(f"--fuse applies to {' or '.join(fusing)}")
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
                                                    parent_bf16, q, label, artifact=tmp,
                                                    prompts=generation.reference_prompts(source, tokenizer,
                                                                                         cfg.what.data))
        quantized = cfg.what.int8 or cfg.what.type  # a stored type may be quantized (gguf q8_0)
        m.update(params=desc["params"], int8_layers_reloaded=quantized_layers(tmp, model) if quantized else 0,
                 portability=engine.portability)
        m.update(engine.exported(desc, tmp, cfg.what.int8)[1])
        if "parity" in desc:
            protocol["export_check"] = (f"parity gate before writing: {desc['parity']['how']}; max |logit "
                                        f"difference| {desc['parity']['max_abs_logit_diff']:.1e}")
        meta_out = artifacts.write_meta(tmp, "export", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={cfg.what.format: desc})
    report = StageReport(
        stage="export", tag=tag, parent=str(source), run=run_dir.name, artifact=str(artifact),
        config=cfg.to_dict(), metrics=m, verdicts=verdicts,
        what_ran={"device": hardware.describe_device(device), "format": cfg.what.format, **ran, "world_size": 1,
                  "source_model": str(source), "data": data_section["source"],
                  "tokenizer": prepared.tokenizer_source,
                  "parallel": "none", "amp_dtype": "fp32 activations" + (
                      f", {cfg.what.type} weights" if cfg.what.type else ", int8 weights" if cfg.what.int8 else ""),
                  "cpu_flags": " ".join(hardware.cpu_flags())},
        protocol=protocol, **stamp(meta_out),
        extras={"load_command": engine.load_command(artifact),  # the engine's own way, outside effkit
                "memory": memory_of() if memory_of else None},  # the plan made before, beside the peak measured
    )
    write_stage_report(Path(cfg.folders.reports_dir) / run_dir.name, report)
    return report.as_dict()


# ------------------------------------------------------------------------------------------------ the memory plan
# What each part weighs is measured per engine (`Engine.memory_line`) and for the stage (`engines.memory_figure`):
# effkit/engines/memory_calibration.json says how. A part that grows with the model is a line in the parent's fp32
# bytes through two measured exports.
MIB = 2**20
CONVERSION_PEAK, CONVERSION, TIMING = "export_conversion_peak", "export_conversion", "export_timing"
# an engine that maps its weights file (clean pages, reclaimable), at the conversion's peak and after it
MAPPED_AT_PEAK, MAPPED_AFTER = "export_mapped_at_peak", "export_mapped_after"
CALIBRATION_BATCH = 12  # the calibration exports' largest timed prefill batch


def _calibrated() -> list[Any]:
    """The export engines whose memory was measured (`Engine.memory_line`)."""
    return [e for _, e in ENGINES.items() if e.format and e.memory_line(CONVERSION)]


def _parent_parts(cfg: ExportConfig, source: Path, engine, p: int, mapped: int) -> tuple[dict[str, int], int, int]:
    """(what is alive at both of the export's largest moments, block, vocabulary): the process and its libraries,
    the parent in fp32 and its mapped weights' file, what its evaluations left."""
    from effkit.measure.compare import bf16_not_run

    mc = json.loads((source / "config.json").read_text())
    data = DataConfig.from_dict(artifacts.data_section(source, cfg.what.data))
    block = min(data.block_size, int(mc.get("n_positions", data.block_size)))
    vocab = int(mc["vocab_size"])
    eval_batch = min(cfg.measure.batch_size, data.eval_blocks)
    parent = {f"the process: Python, torch, transformers, {engine.label}; the tokenizer, the held-out blocks":
              int(engines.memory_figure("export", "process")),
              "parent: fp32 model": p,
              "the parent's weights' file, mapped (clean pages)": mapped,
              f"the parent's evaluations: logits {eval_batch} x {block} x {vocab} (fp32), kept by the allocator":
              int(engines.memory_figure("export", "eval_logit_copies")) * eval_batch * block * vocab * 4}
    if bf16_not_run(torch.device("cpu")) is None:
        parent["the parent under bf16 autocast: its weights' bf16 copies"] = p // 2
    return parent, block, vocab


def _moments(cfg: ExportConfig, source: Path, engine, p: int, mapped: int,
             notes: list[str]) -> tuple[dict[str, dict[str, int]], set[str]]:
    """The export's two largest moments (the conversion at its own peak; the export evaluated and timed after it),
    each its parts, and the parts the kernel can drop. An engine not calibrated counts as the calibrated one whose
    residue and timing lines together are steepest, and during the conversion as the steepest conversion."""
    parent, block, vocab = _parent_parts(cfg, source, engine, p, mapped)
    known = _calibrated()
    like = engine if engine in known else max(known, key=lambda e: e.memory_line(CONVERSION)[1]
                                              + e.memory_line(TIMING)[1])
    peak = engine if engine in known else max(known, key=lambda e: e.memory_line(CONVERSION_PEAK)[1])
    fig = lambda name: int(engines.memory_figure("export", name))
    calibrated_logits = fig("timing_logit_copies") * CALIBRATION_BATCH * fig("block") * fig("vocab") * 4
    # the largest prefill `compare_with_parent` times (one per prefill workload): its logits
    batch, tokens = max(((w.batch, w.tokens or block) for w in workloads.of_kind("prefill")), key=lambda w: w[0] * w[1])
    during = {**parent, f"{engine.label} conversion at its peak: the converter's working memory, its parity check":
              stageplan.on_line(peak.memory_line(CONVERSION_PEAK), p)}
    after = {**parent,
             f"{engine.label} conversion: its residue (kept by the allocator) and the export loaded in its engine":
             stageplan.on_line(like.memory_line(CONVERSION), p),
             f"the export's evaluation and timing beside its parent, batch {batch} x {tokens}: KV caches, "
             f"logits {batch} x {tokens} x {vocab}, {engine.label}'s work buffers":
             max(0, stageplan.on_line(like.memory_line(TIMING), p) - calibrated_logits)
             + fig("timing_logit_copies") * batch * tokens * vocab * 4}
    mapped_export = f"the export's weights' file, mapped by {engine.label}'s loads (clean pages)"
    if like.memory_line(MAPPED_AT_PEAK):
        during[mapped_export] = stageplan.on_line(like.memory_line(MAPPED_AT_PEAK), p)
        after[mapped_export] = stageplan.on_line(like.memory_line(MAPPED_AFTER), p)
    if engine not in known:
        notes.append(f"--format {cfg.what.format}: not calibrated; counted as {like.format}'s after the conversion "
                     f"(the steepest measured lines there) and as the largest measured conversion ({peak.format}'s) "
                     "during it")
    return ({"the conversion, at its own peak": during,
             f"the export evaluated and timed beside its parent (batch {batch}), after the conversion": after},
            {"the parent's weights' file, mapped (clean pages)", mapped_export})


def export_plan(cfg: ExportConfig, tricks: bool = True) -> stageplan.StagePlan:
    """The memory plan of `effkit export` with `cfg`, from the parent's shapes alone (its safetensors headers,
    config.json and data section; no weight read): the peak of the export's one process, at the larger of its two
    largest moments. Alive at both: the process and its libraries; the parent in fp32 (loaded once, kept to compare
    with) and its weights' file, mapped; what its evaluations left (their logits, and the bf16 copies of its weights
    where bf16 runs). Then either the conversion at its own peak (the converter's working memory and its parity
    check), or, after it, what stays resident of it (kept by the allocator) with the export loaded in its engine (an
    ONNX Runtime session, OpenVINO's compiled model, CTranslate2's generators, llama.cpp's model) and the export's
    own evaluation and timing beside its parent (batch-12 KV caches, logits, the engine's work buffers; the engines'
    generation pipelines). The parts that grow with the model are lines through two measured exports (each engine's
    `memory_line`). `tricks`: where it does not fit, name the calibrated formats that would."""
    from effkit import memplan
    from effkit.measure.compare import bf16_not_run

    cfg, source = _checked(cfg)
    p, mapped = stageplan.weights_of(source)
    notes: list[str] = []
    moments, reclaimable = _moments(cfg, source, engine_for(cfg.what.format), p, mapped, notes)
    totals = {m: sum(v for k, v in parts.items() if k not in reclaimable) for m, parts in moments.items()}
    peak = max(totals, key=totals.get)  # by what must fit
    skipped = bf16_not_run(torch.device("cpu"))
    notes[:0] = [f"the largest moment: {peak}; must fit " + "; ".join(f"{m}: {t / 2**30:.2f} GiB"
                                                                     for m, t in totals.items()),
                 f"parent {p / MIB:,.0f} MiB in fp32 ({p // 4:,} parameters), from its safetensors headers",
                 *([f"the parent under bf16 autocast: {skipped}"] if skipped is not None else [])]
    if cfg.what.int8 or cfg.what.type or cfg.what.fuse:
        notes.append("int8, --type and --fuse exports: counted as the fp32 (gguf: f16) export of the format "
                     "(calibrated on those only)")
    name, available = memplan.device_memory(torch.device("cpu"))
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
    """The other calibrated formats whose plan fits (`stageplan.what_fits`), the smallest first: `--format F (N
    GiB)`."""
    others = [(f"--format {e.format}", e.format) for e in _calibrated()
              if e.format != cfg.what.format and not e.available(None, int8=cfg.what.int8)]
    tried = stageplan.what_fits(others, lambda fmt: export_plan(cfg.replace(format=fmt, fuse=False, type=""),
                                                                tricks=False), first=False)
    return [f"{t.flags} ({t.plan.total_bytes / 2**30:.1f} GiB)"
            for t in sorted((t for t in tried if t.fits), key=lambda t: t.plan.total_bytes)]
