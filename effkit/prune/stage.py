"""`effkit prune`: iterative pruning to a target, fine-tuning between rounds with the one training loop,
one artifact per round, and a report with the whole curve (loss, sparsity, FLOPs, measured latency)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, metrics
from effkit.config import PruneConfig, TrainConfig
from effkit.errors import EffkitError
from effkit.model import count_params, load_model
from effkit.prune.row import prune_mlp_channels
from effkit.prune.weight import apply_masks, compute_masks, prunable_linears, sparsity
from effkit.report import atomic_write_text, write_rows_csv

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
    device = next(model.parameters()).device
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
        m[f"latency_b{b}"] = metrics.measure_latency(model, b, block, device, repeats=repeats)
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


def run_prune(cfg: PruneConfig, progress: bool = True) -> dict[str, Any]:
    cfg.validate()
    source = artifacts.resolve_artifact(cfg.source, cfg.runs_dir)
    meta = _check_source(source)
    parent_cfg = TrainConfig.from_dict(meta["config"])
    run_name = source.parent.name
    block = parent_cfg.block_size
    torch.manual_seed(cfg.seed)

    model = load_model(str(source))
    dense = stage_metrics(model, block, cfg.latency_repeats, None)
    dense_eval = meta["metrics"].get("eval_loss")
    n_inner0 = dense["n_inner"]
    masks: dict[str, torch.Tensor] | None = None
    calib = None
    if cfg.importance == "wanda":
        from effkit.train import prepare_data

        _, _, _, data = prepare_data(replace(parent_cfg, model=str(source)))
        g = torch.Generator().manual_seed(cfg.seed)
        idx = torch.randperm(len(data.train), generator=g)[: cfg.calib_batches * cfg.batch_size]
        calib = list(data.train[idx].split(cfg.batch_size))

    from effkit.train import train

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
        tag = f"prune-{cfg.mode}-r{r}"
        ft = replace(parent_cfg, model=str(source), max_steps=cfg.finetune_steps, max_tokens=0, time_budget=0.0,
                     lr=cfg.lr, min_lr=cfg.lr / 10, warmup_steps=cfg.warmup_steps, batch_size=cfg.batch_size,
                     grad_accum=1, eval_interval=0, checkpoint_interval=0, run_name=run_name,
                     runs_dir=cfg.runs_dir, reports_dir=cfg.reports_dir, parallel="none", nproc=0, resume=False,
                     activation_checkpointing=False, seed=cfg.seed + r)
        extra = (lambda mdl, f=fraction, r=r: {"prune": {"mode": cfg.mode, "round": r, "target": f,
                                                    "final_target": cfg.target, "importance": cfg.importance,
                                                    "scope": cfg.scope if cfg.mode == "weight" else None},
                                          **stage_metrics(mdl, block, cfg.latency_repeats, dense)})
        report = train(ft, progress=progress, model=model, stage="prune", tag=tag, parent=parent,
                       after_step=after_step, extra_metrics=extra)
        m = report["metrics"]
        rows.append({"round": r, "target": fraction, "achieved_sparsity": m["achieved_sparsity"],
                     "eval_loss": m["eval_loss"], "params": m["params"],
                     "flops_per_token": m["flops_per_token_dense" if cfg.mode == "row" else "flops_per_token_nonzero"],
                     "latency_b1_s": m["latency_b1"]["p50_s"], "latency_b12_s": m["latency_b12"]["p50_s"],
                     "speedup_measured_b12": m["speedup_measured_b12"],
                     "speedup_projected": m["speedup_projected_from_flops"], "artifact": report["artifact"]})
        parent = report["artifact"]

    return write_prune_report(cfg, run_name, rows, dense, meta)


def write_prune_report(cfg: PruneConfig, run_name: str, rows: list[dict[str, Any]], dense: dict[str, Any],
                       meta: dict[str, Any]) -> dict[str, Any]:
    import json

    out = Path(cfg.reports_dir) / run_name
    out.mkdir(parents=True, exist_ok=True)
    verdicts = []
    last = rows[-1]
    if cfg.mode == "weight" and last["speedup_measured_b12"] < 1.1:
        verdicts.append("pruning reduced FLOPs (counting non-zeros) but not latency: dense kernels still multiply "
                        "the zeros; the gain is in compressibility, not speed")
    if dense.get("eval_loss") and last["eval_loss"] > 1.03 * rows[0]["eval_loss"]:
        verdicts.append(f"eval loss rose {last['eval_loss'] / rows[0]['eval_loss'] - 1:.1%} over dense")
    report = {
        "stage": "prune", "tag": f"prune-{cfg.mode}", "run": run_name, "artifact": last["artifact"],
        "config": asdict(cfg), "curve": rows, "dense": dense, "verdicts": verdicts,
        "protocol": {"eval_loss": metrics.EVAL_PROTOCOL,
                     "latency": metrics.LATENCY_PROTOCOL.format(warmup=3, repeats=cfg.latency_repeats)
                     + f"; p50 reported; device {metrics.describe_device(torch.device('cpu'))}",
                     "sparsity": "counted zeros over the Linear weights of the transformer blocks",
                     "flops": "forward FLOPs/token = 2 x (block Linear weights + LM head) + 4*L*d*T; weight mode "
                              "counts non-zero weights (what sparse kernels could skip)"},
        "versions": artifacts.versions(), "git_commit": artifacts.git_commit(),
    }
    atomic_write_text(out / f"prune-{cfg.mode}.json", json.dumps(report, indent=2, default=str))
    write_rows_csv(out / f"prune-{cfg.mode}.csv", rows)
    plot_prune_curves(out)
    return report


def plot_prune_curves(out: Path) -> list[Path]:
    """Eval loss against sparsity and latency against sparsity, one line per pruning mode found."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for p in sorted(out.glob("prune-*.json")):
        data = json.loads(p.read_text())
        if "curve" in data:
            curves[data["config"]["mode"]] = data["curve"]
    paths = []
    for key, ylabel, fname in (("eval_loss", "held-out loss (nats/token)", "prune_loss.png"),
                               ("latency_b12_s", "forward latency, batch 12 (ms, p50)", "prune_latency.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for mode, rows in curves.items():
            xs = [r["achieved_sparsity"] for r in rows]
            ys = [(r[key] * 1000 if key.startswith("latency") else r[key]) for r in rows]
            ax.plot(xs, ys, "o-", label=f"{mode} ({'zeroed block weights' if mode == 'weight' else 'MLP removed'})")
        ax.set_xlabel("fraction of prunable weights removed")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    return paths


__all__ = ["forward_flops_per_token", "plot_prune_curves", "run_prune"]
