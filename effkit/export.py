"""`effkit export --format onnx [--int8]`: a dense or pruned artifact as an ONNX artifact (`effkit.onnx_export`),
reloaded from its folder alone and measured against its PyTorch parent with quantize's protocol (held-out loss
per block, interleaved latency at batch 1 and 12, generation), so `bench`, `generate` and any ONNX Runtime can
use it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, metrics, onnx_export
from effkit.config import DataConfig, ExportConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.model import load_model
from effkit.quantize import PORTABILITY, compare_with_parent, generate_sample, int8_layer_count, is_quantized
from effkit.report import write_stage_report


def export_tag(cfg: ExportConfig, source: Path) -> str:
    """`onnx` / `onnx-int8` for the dense model, `prune-row-r2+onnx-int8` for a pruned one."""
    tag = "onnx-int8" if cfg.int8 else "onnx"
    return f"{source.name}+{tag}" if artifacts.read_meta(source)["stage"] == "prune" else tag


def run_export(cfg: ExportConfig) -> dict[str, Any]:
    cfg = cfg.validate()
    onnx_export.require_onnx()
    source = artifacts.resolve_artifact(cfg.source, cfg.runs_dir)
    meta = artifacts.read_meta(source)
    if is_quantized(source) or onnx_export.is_onnx(source):
        kind = "ONNX" if onnx_export.is_onnx(source) else "int8"
        raise EffkitError(f"{source} is a {meta['stage']} artifact ({kind}); export a dense or pruned PyTorch "
                          f"artifact (its parent: {meta.get('parent')}), with --int8 for ONNX Runtime int8")
    run_dir = Path(cfg.runs_dir) / artifacts.run_of(source)
    with artifacts.run_lock(run_dir):
        return _export(cfg, source, run_dir)


def _export(cfg: ExportConfig, source: Path, run_dir: Path) -> dict[str, Any]:
    device = torch.device("cpu")  # ONNX Runtime's CPU provider; the parent is timed on the same device
    data_section = artifacts.data_section(source)
    data_cfg = DataConfig.from_dict(data_section)
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    tokenizer, eval_blocks, block, n_bytes = (prepared.tokenizer, prepared.blocks.eval, data_cfg.block_size,
                                              prepared.blocks.eval_bytes)
    parent = load_model(str(source)).eval()
    parent_fp32 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
    parent_bf16 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, torch.bfloat16, eval_bytes=n_bytes)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)
    tag = export_tag(cfg, source)
    label = f"ONNX Runtime {'int8' if cfg.int8 else 'fp32'}"
    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        desc = onnx_export.write_artifact(tmp, copy.deepcopy(parent), tokenizer, int8=cfg.int8, fused=cfg.fuse)
        model = onnx_export.OnnxCausalLM(tmp)  # what is measured: the artifact as its folder alone reloads it
        q = metrics.evaluate(model, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
        q["generation"] = generate_sample(model, tokenizer, cfg.gen_tokens)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m, verdicts, protocol = compare_with_parent(cfg, device, parent, model, tokenizer, block, parent_fp32,
                                                    parent_bf16, q, label)
        m.update(params=desc["params"], int8_layers_reloaded=int8_layer_count(model) if cfg.int8 else 0,
                 max_abs_logit_diff_vs_pytorch=desc["max_abs_logit_diff_vs_pytorch"],
                 portability=PORTABILITY["onnxruntime"])
        meta_out = artifacts.write_meta(tmp, "export", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={"onnx": desc})
    protocol["export_check"] = (f"ONNX Runtime logits vs PyTorch's on a (3, 24) probe batch (another shape than "
                                f"the traced one): max |difference| {desc['max_abs_logit_diff_vs_pytorch']:.1e} "
                                f"(refused above {onnx_export.EXPORT_ATOL})")
    report = {
        "stage": "export", "tag": tag, "parent": str(source), "run": run_dir.name, "artifact": str(artifact),
        "time": meta_out["time"], "config": cfg.to_dict(), "metrics": m, "verdicts": verdicts,
        "what_ran": {"device": metrics.describe_device(device), "format": "onnx", "precision": desc["precision"],
                     "runtime": desc["runtime"], "exporter": desc["exporter"], "opset": desc["opset"],
                     "fused_operators": desc.get("fused_operators", "not applied (--fuse to apply)"),
                     "int8_operators": desc.get("int8", {}), "world_size": 1, "parallel": "none",
                     "amp_dtype": "fp32 activations" + (", int8 weights" if cfg.int8 else ""),
                     "cpu_flags": " ".join(metrics.cpu_flags())},
        "versions": meta_out["versions"], "git_commit": meta_out["git_commit"],
        "protocol": protocol,
    }
    write_stage_report(Path(cfg.reports_dir) / run_dir.name, report)
    return report
