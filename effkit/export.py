"""`effkit export --format onnx | ctranslate2 [--int8]`: a dense or pruned artifact for another engine (ONNX
Runtime through `effkit.onnx_export`, with past key/values; CTranslate2 through its own converter,
`effkit.ct2_export`), reloaded from its folder alone and measured against its PyTorch parent with quantize's
protocol (held-out loss per block, interleaved prefill latency at batch 1 and 12, generation), so `bench`,
`generate` and the engine itself can use it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, ct2_export, onnx_export
from effkit.artifacts.loader import kind, quantized_layers
from effkit.config import DataConfig, ExportConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import metrics
from effkit.measure.compare import compare_with_parent, generate_sample
from effkit.model import load_model
from effkit.report import write_stage_report


def export_tag(cfg: ExportConfig, source: Path) -> str:
    """`onnx` / `onnx-int8` / `ctranslate2-int8` for the dense model, `prune-row-r2+onnx-int8` for a pruned one."""
    tag = cfg.what.format + ("-int8" if cfg.what.int8 else "")
    return f"{source.name}+{tag}" if artifacts.read_meta(source)["stage"] == "prune" else tag


def unavailable(cfg: ExportConfig) -> str | None:
    if cfg.what.format == "onnx":
        return onnx_export.onnx_unavailable()
    return ct2_export.ct2_unavailable(None, "int8" if cfg.what.int8 else "float32")


def write(cfg: ExportConfig, folder: Path, source: Path, parent, tokenizer) -> tuple[dict[str, Any], Any, dict]:
    """Write the export into `folder` and reload it from there: (description, model, what_ran keys)."""
    if cfg.what.format == "onnx":
        desc = onnx_export.write_artifact(folder, copy.deepcopy(parent), tokenizer, int8=cfg.what.int8,
                                          fused=cfg.what.fuse)
        return desc, onnx_export.OnnxCausalLM(folder), {
            "precision": desc["precision"], "past_key_values": desc["past_key_values"], "runtime": desc["runtime"],
            "exporter": desc["exporter"], "opset": desc["opset"],
            "fused_operators": desc.get("fused_operators", "not applied (--fuse to apply)"),
            "int8_operators": desc.get("int8", {})}
    compute_type = "int8" if cfg.what.int8 else "float32"
    desc = ct2_export.write_artifact(folder, source, parent.config, tokenizer, compute_type,
                                     sum(p.numel() for p in parent.parameters()))
    model = ct2_export.Ct2CausalLM(folder)
    return desc, model, {"precision": compute_type, "runtime": desc["runtime"], "exporter": desc["converter"],
                         "weights": ct2_export.weight_dtypes(folder)}


def run_export(cfg: ExportConfig) -> dict[str, Any]:
    cfg = cfg.validate()
    if reason := unavailable(cfg):
        raise EffkitError(f"--format {cfg.what.format} cannot run here: {reason}")
    source = artifacts.resolve_artifact(cfg.what.source, cfg.folders.runs_dir)
    meta = artifacts.read_meta(source)
    if kind(source) != "pytorch":
        what = {"onnx": "ONNX", "ctranslate2": "CTranslate2"}.get(kind(source), "int8")
        raise EffkitError(f"{source} is a {meta['stage']} artifact ({what}); export a dense or pruned PyTorch "
                          f"artifact (its parent: {meta.get('parent')}), with --int8 for int8")
    if cfg.what.fuse and cfg.what.format != "onnx":
        raise EffkitError("--fuse applies to --format onnx (ONNX Runtime's fusions)")
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
    parent_fp32 = metrics.evaluate(parent, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes, docs=docs)
    parent_bf16 = metrics.evaluate(parent, eval_blocks, cfg.measure.batch_size, torch.bfloat16, eval_bytes=n_bytes,
                                   docs=docs)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.measure.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)
    tag = export_tag(cfg, source)
    engine = "ONNX Runtime" if cfg.what.format == "onnx" else "CTranslate2"
    label = f"{engine} {'int8' if cfg.what.int8 else 'fp32'}"
    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        desc, model, ran = write(cfg, tmp, source, parent, tokenizer)  # measured as its folder alone reloads it
        q = metrics.evaluate(model, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes, docs=docs)
        q["generation"] = generate_sample(model, tokenizer, cfg.measure.gen_tokens)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m, verdicts, protocol = compare_with_parent(cfg.measure, device, parent, model, tokenizer, block, parent_fp32,
                                                    parent_bf16, q, label)
        m.update(params=desc["params"], int8_layers_reloaded=quantized_layers(tmp, model) if cfg.what.int8 else 0,
                 portability=onnx_export.PORTABILITY if cfg.what.format == "onnx" else ct2_export.PORTABILITY)
        if cfg.what.format == "onnx":
            m.update(max_abs_logit_diff_vs_pytorch=desc["max_abs_logit_diff_vs_pytorch"], parity=desc["parity"])
            protocol["export_check"] = (f"parity gate before writing: {desc['parity']['how']}; max |logit "
                                        f"difference| {desc['max_abs_logit_diff_vs_pytorch']:.1e}")
        meta_out = artifacts.write_meta(tmp, "export", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={cfg.what.format: desc})
    report = {
        "stage": "export", "tag": tag, "parent": str(source), "run": run_dir.name, "artifact": str(artifact),
        "time": meta_out["time"], "config": cfg.to_dict(), "metrics": m, "verdicts": verdicts,
        "what_ran": {"device": metrics.describe_device(device), "format": cfg.what.format, **ran, "world_size": 1,
                     "source_model": str(source), "data": data_section["source"],
                     "tokenizer": prepared.tokenizer_source,
                     "parallel": "none", "amp_dtype": "fp32 activations" + (", int8 weights" if cfg.what.int8 else ""),
                     "cpu_flags": " ".join(metrics.cpu_flags())},
        "versions": meta_out["versions"], "git_commit": meta_out["git_commit"],
        "protocol": protocol,
    }
    write_stage_report(Path(cfg.folders.reports_dir) / run_dir.name, report)
    return report
