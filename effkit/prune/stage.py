"""`effkit prune`: iterative pruning to a target, fine-tuning between rounds with the one training loop,
one artifact per round, and a report with the whole curve (loss, sparsity, FLOPs, measured latency)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, metrics
from effkit.artifacts import RunLayout, prune_tag
from effkit.config import DataConfig, ModelConfig, ParallelConfig, PruneConfig, TrainConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.model import count_params, load_model
from effkit.parallel import Runtime, init_runtime
from effkit.prune.row import prune_mlp_channels
from effkit.prune.weight import apply_masks, compute_masks, prunable_linears, sparsity
from effkit.report import atomic_write_text, plot_prune_curves, write_rows_csv
from effkit.train import finetune

LAT_BATCHES = (1, 12)


def forward_flops_per_token(model, seq_len: int, nonzero_only: bool = False) -> float:
    """2 x (matmul weights in the blocks + LM head) + the attention term, per token, forward only.
    With `nonzero_only`, zero weights are not counted (what sparse kernels could skip)."""
    count = (lambda w: int((w != 0).sum())) if nonzero_only else (lambda w: w.numel())
    weights = sum(count(lin.weight) for lin in prunable_linears(model).values()) + model.lm_head.weight.numel()
    attn = 4 * model.config.n_layer * model.config.n_embd * seq_len
    return 2 * weights + attn


def mlp_weights(model) -> int:
    return sum(b.mlp.c_fc.weight.numel() + b.mlp.c_proj.weight.numel() for b in model.transformer.h)


def stage_metrics(model, block: int, repeats: int, dense: dict[str, Any] | None) -> dict[str, Any]:
    """Size, sparsity, FLOPs and measured latency of `model`; speed-ups against `dense` when given.
    `achieved_sparsity`: the fraction of prunable weights removed. Weight mode counts zeros among the block
    Linear weights; row mode counts the MLP weights physically removed (the row-prunable ones)."""
    zeros, total = sparsity(model)
    removed = dense["mlp_weights"] - mlp_weights(model) if dense else 0
    achieved = removed / dense["mlp_weights"] if removed else zeros / total
    m: dict[str, Any] = {
        "prunable_weights": total, "zero_weights": zeros, "mlp_weights": mlp_weights(model),
        "achieved_sparsity": achieved,
        "params": count_params(model), "nonzero_params": sum(int((p != 0).sum()) for p in model.parameters()),
        "n_inner": model.config.n_inner or 4 * model.config.n_embd,
        "flops_per_token_dense": forward_flops_per_token(model, block),
        "flops_per_token_nonzero": forward_flops_per_token(model, block, nonzero_only=True),
    }
    for b in LAT_BATCHES:
        m[f"latency_b{b}"] = metrics.measure_latency(model, b, block, repeats=repeats)
    if dense is not None:
        for b in LAT_BATCHES:
            m[f"speedup_measured_b{b}"] = dense[f"latency_b{b}"]["p50_s"] / m[f"latency_b{b}"]["p50_s"]
        key = "flops_per_token_dense" if model.config.n_inner else "flops_per_token_nonzero"
        m["speedup_projected_from_flops"] = dense["flops_per_token_dense"] / m[key]
    return m


def _check_source(path: Path) -> dict[str, Any]:
    meta = artifacts.read_meta(path)
    if meta["stage"] == "quantize":
        raise EffkitError(f"{path} is a quantized artifact; prune the model it came from "
                          f"({meta.get('parent') or 'its parent'}) and quantize afterwards")
    return meta


def finetune_config(cfg: PruneConfig, source: Path, meta: dict[str, Any], data: DataConfig, round_: int,
                    layout: RunLayout) -> TrainConfig:
    """The fine-tuning of round `round_`: the parent's optimizer settings with the prune options on top,
    single process, no evaluations or checkpoints in between."""
    parent = TrainConfig.from_dict(meta["config"])
    return TrainConfig(
        data=data, model=ModelConfig(name=str(source)),
        optim=parent.optim.replace(max_steps=cfg.finetune_steps, max_tokens=0, time_budget=0.0, lr=cfg.lr,
                                   min_lr=cfg.lr / 10, warmup_steps=cfg.warmup_steps, batch_size=cfg.batch_size,
                                   grad_accum=1, seed=cfg.seed + round_),
        parallel=ParallelConfig(threads=parent.parallel.threads),
        run=parent.run.replace(run_name=layout.name, runs_dir=str(layout.runs_dir),
                               reports_dir=str(layout.reports_dir), resume=False, eval_interval=0,
                               checkpoint_interval=0),
    )


def run_prune(cfg: PruneConfig, progress: bool = True) -> dict[str, Any]:
    cfg = cfg.validate()
    rt = init_runtime(cfg.device)
    source = artifacts.resolve_artifact(cfg.source, cfg.runs_dir)
    meta = _check_source(source)
    data_cfg = DataConfig.from_dict(artifacts.data_section(source))
    layout = RunLayout.of(cfg.runs_dir, cfg.reports_dir, source.parent.name)
    block = data_cfg.block_size
    torch.manual_seed(cfg.seed)

    model = load_model(str(source)).to(rt.device)
    dense = stage_metrics(model, block, cfg.latency_repeats, None)
    dense_eval = meta["metrics"].get("eval_loss")
    n_inner0 = dense["n_inner"]
    masks: dict[str, torch.Tensor] | None = None
    calib = None
    if cfg.importance == "wanda":
        blocks = prepare(data_cfg, tokenizer_from=str(source)).blocks
        g = torch.Generator().manual_seed(cfg.seed)
        idx = torch.randperm(len(blocks.train), generator=g)[: cfg.calib_batches * cfg.batch_size]
        calib = list(blocks.train[idx].split(cfg.batch_size))

    rows: list[dict[str, Any]] = [{"round": 0, "target": 0.0, "achieved_sparsity": dense["achieved_sparsity"],
                                   "eval_loss": dense_eval, "params": dense["params"],
                                   "flops_per_token": dense["flops_per_token_dense"],
                                   "latency_b1_s": dense["latency_b1"]["p50_s"],
                                   "latency_b12_s": dense["latency_b12"]["p50_s"], "artifact": str(source)}]
    parent = str(source)
    for r in range(1, cfg.rounds + 1):
        fraction = cfg.target * r / cfg.rounds
        if cfg.mode == "weight":
            masks = compute_masks(model, fraction, cfg.importance, cfg.scope, calib, previous=masks)
            apply_masks(model, masks)
            after_step = (lambda mdl, m=masks: apply_masks(mdl, m))
        else:
            keep = max(1, round(n_inner0 * (1 - fraction)))
            prune_mlp_channels(model, keep)
            after_step = None
        extra = (lambda mdl, f=fraction, r=r: {"prune": {"mode": cfg.mode, "round": r, "target": f,
                                                    "final_target": cfg.target, "importance": cfg.importance,
                                                    "scope": cfg.scope if cfg.mode == "weight" else None},
                                          **stage_metrics(mdl, block, cfg.latency_repeats, dense)})
        report = finetune(finetune_config(cfg, source, meta, data_cfg, r, layout), model, rt, stage="prune",
                          tag=prune_tag(cfg.mode, r), parent=parent, after_step=after_step, extra_metrics=extra,
                          progress=progress)
        m = report["metrics"]
        rows.append({"round": r, "target": fraction, "achieved_sparsity": m["achieved_sparsity"],
                     "eval_loss": m["eval_loss"], "params": m["params"],
                     "flops_per_token": m["flops_per_token_dense" if cfg.mode == "row" else "flops_per_token_nonzero"],
                     "latency_b1_s": m["latency_b1"]["p50_s"], "latency_b12_s": m["latency_b12"]["p50_s"],
                     "speedup_measured_b12": m["speedup_measured_b12"],
                     "speedup_projected": m["speedup_projected_from_flops"], "artifact": report["artifact"]})
        parent = report["artifact"]

    return write_prune_report(cfg, layout, rows, dense, rt)


def write_prune_report(cfg: PruneConfig, layout: RunLayout, rows: list[dict[str, Any]], dense: dict[str, Any],
                       rt: Runtime) -> dict[str, Any]:
    out = layout.report_dir
    verdicts = []
    last = rows[-1]
    if cfg.mode == "weight" and last["speedup_measured_b12"] < 1.1:
        verdicts.append("pruning reduced FLOPs (counting non-zeros) but not latency: dense kernels still multiply "
                        "the zeros; the gain is in compressibility, not speed")
    if dense.get("eval_loss") and last["eval_loss"] > 1.03 * rows[0]["eval_loss"]:
        verdicts.append(f"eval loss rose {last['eval_loss'] / rows[0]['eval_loss'] - 1:.1%} over dense")
    report = {
        "stage": "prune", "tag": f"prune-{cfg.mode}", "run": layout.name, "artifact": last["artifact"],
        "config": cfg.to_dict(), "curve": rows, "dense": dense, "verdicts": verdicts,
        "protocol": {"eval_loss": metrics.EVAL_PROTOCOL,
                     "latency": metrics.LATENCY_PROTOCOL.format(warmup=3, repeats=cfg.latency_repeats)
                     + f"; p50 reported; device {metrics.describe_device(rt.device)}",
                     "sparsity": "counted zeros over the Linear weights of the transformer blocks",
                     "flops": "forward FLOPs/token = 2 x (block Linear weights + LM head) + 4*L*d*T; weight mode "
                              "counts non-zero weights (what sparse kernels could skip)"},
        "versions": artifacts.versions(), "git_commit": artifacts.git_commit(),
    }
    atomic_write_text(out / f"prune-{cfg.mode}.json", json.dumps(report, indent=2, default=str))
    write_rows_csv(out / f"prune-{cfg.mode}.csv", rows)
    plot_prune_curves(out)
    return report


__all__ = ["forward_flops_per_token", "run_prune"]
