"""Structured pruning on the quickstart model: row, width and depth at about 25% and 50% of the transformer-block
parameters, each with plain fine-tuning and with distillation from the dense parent (same steps), against the same
dense control. About 15 minutes on 2 cores, alone on the machine.

    python benchmarks/structured.py [DENSE] [--steps 60] [--out reports/benchmarks/structured]

DENSE (default runs/quickstart/train, made by `effkit run`) is copied into OUT/runs/structured/train, so the run's
own prune artifacts are never touched. Writes OUT/reports/structured/structured.md (the table, with the paired
distillation-vs-plain loss delta per mode and level, measured on the same held-out blocks), the prune reports and
plots (prune_loss.png, prune_latency.png: every mode on one axis).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from effkit import artifacts
from effkit.config import DataConfig, PruneConfig
from effkit.data import prepare
from effkit.measure import evaluation, stats, timing
from effkit.model import load_model
from effkit.prune.stage import run_prune
from effkit.quiet import quiet_libraries
from effkit.report import render_run_report

# fractions of each mode's own unit that remove about 25% (round 1) and 50% (round 2) of the block parameters of
# gpt2-micro (n_embd 256, n_inner 1024, 4 blocks): the MLP is 2/3 of a block; width shrinks attention
# quadratically and the MLP linearly
TARGETS = {"row": 0.75, "width": 0.42, "depth": 0.5}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dense", nargs="?", default="runs/quickstart/train")
    ap.add_argument("--steps", type=int, default=60, help="fine-tuning steps per round")
    ap.add_argument("--out", default="reports/benchmarks/structured")
    a = ap.parse_args()
    quiet_libraries()
    out = Path(a.out)
    dense = out / "runs" / "structured" / "train"
    if not dense.is_dir():
        shutil.copytree(a.dense, dense)
    dirs = {"runs_dir": str(out / "runs"), "reports_dir": str(out / "reports")}
    reports = {}
    for mode, target in TARGETS.items():
        for distill in (False, True):
            cfg = PruneConfig.from_flat(source=str(dense), mode=mode, target=target, rounds=2, finetune_steps=a.steps,
                                        distill=distill, latency_rounds=8, latency_repeats=3, **dirs)
            reports[(mode, distill)] = run_prune(cfg)
    render_run_report(out / "reports", "structured")

    data = DataConfig.from_dict(artifacts.data_section(dense))
    blocks = prepare(data, tokenizer_from=str(dense)).blocks.eval
    losses = {}

    def block_losses(path: str):
        if path not in losses:
            losses[path] = evaluation.evaluate(load_model(path).eval(), blocks, 8)["block_losses"]
        return losses[path]

    lines = ["| mode | level | block params removed | fine-tuning | held-out loss | Δ vs dense control | "
             "latency b12 vs dense | distill vs plain (paired) |", "|" + "---|" * 8]
    for mode in TARGETS:
        for rnd in (1, 2):
            plain, kd = (reports[(mode, d)]["curve"][rnd] for d in (False, True))
            vs = stats.paired_delta(block_losses(plain["artifact"]), block_losses(kd["artifact"]))
            for row, name in ((plain, "plain"), (kd, "distill")):
                ctrl = row.get("eval_loss_delta_vs_control")
                lines.append(f"| {mode} | r{rnd} | {row['block_params_removed']:.1%} | {name} | "
                             f"{row['eval_loss']:.4f} | {stats.fmt_delta(ctrl) if ctrl else 'n/a'} | "
                             f"{stats.fmt_ratio(row['latency_ratio_b12'])} | "
                             + (f"{stats.fmt_delta(vs)} ({vs['verdict']})" if name == "distill" else "") + " |")
    md = ("# Structured pruning: plain fine-tuning vs distillation\n\n"
          f"Dense parent: {a.dense}; {a.steps} fine-tuning steps per round, 2 rounds; control: the dense parent "
          "fine-tuned alike. Held-out loss on the same blocks for every row; 'distill vs plain' is the paired "
          "per-block delta of the distilled model against the plain one (negative = distillation better), "
          f"{stats.LOSS_METHOD}. Latency: {timing.INTERLEAVED_PROTOCOL.format(warmup=2, rounds=8, repeats=3)}.\n\n"
          + "\n".join(lines) + "\n\nversions: " + json.dumps(artifacts.versions()) + "\n")
    path = out / "reports" / "structured" / "structured.md"
    path.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
