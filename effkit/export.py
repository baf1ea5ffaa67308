"""`effkit export --format onnx | ctranslate2 | openvino | gguf [--int8]`: a dense or pruned artifact for another
engine (ONNX Runtime, with past key/values; CTranslate2 through its own converter; OpenVINO; llama.cpp: any engine
of `effkit.engines` with a `format`), reloaded from its folder alone and measured against its PyTorch parent with
quantize's protocol (held-out loss per block, interleaved prefill latency at batch 1 and 12, generation), so
`bench`, `generate` and the engine itself can use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from effkit import artifacts
from effkit.artifacts.loader import engine_of, kind, quantized_layers
from effkit.config import DataConfig, ExportConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import evaluation, hardware
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
    run_dir = Path(cfg.folders.runs_dir) / artifacts.run_of(source)
    with artifacts.run_lock(run_dir):
        return _export(cfg, source, run_dir)


def _export(cfg: ExportConfig, source: Path, run_dir: Path) -> dict[str, Any]:
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
    }
    write_stage_report(Path(cfg.folders.reports_dir) / run_dir.name, report)
    return report
