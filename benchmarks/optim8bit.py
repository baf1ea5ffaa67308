"""AdamW against 8-bit AdamW on the quickstart's training: the same recipe, seed and data order twice, the only
difference the optimizer's moments (fp32 vs bitsandbytes' block-wise 8-bit). About 13 minutes on 2 cores, alone
on the machine.

    python benchmarks/optim8bit.py [--recipe recipes/quickstart.toml] [--steps N] [--out reports/benchmarks/optim8bit]

Writes OUT/optim8bit.md and .json (final held-out loss of each, the paired per-block delta of 8-bit against AdamW
with its 95% interval and verdict, the measured peak memory over the training steps and the memory plan's
model-state bytes per parameter), and OUT/optim8bit.png (the two loss curves side by side, and their difference).
The runs go to OUT/runs and are removed at the end (the reports stay).
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import torch

from effkit import artifacts, memplan
from effkit.config import TrainConfig, build_config
from effkit.data import prepare
from effkit.measure import evaluation, hardware, stats
from effkit.model import load_model
from effkit.quiet import quiet_libraries
from effkit.report import atomic_write_text, pyplot
from effkit.train import train

OPTIMS = ("adamw", "adamw8bit")


def rows_of(out: Path, name: str) -> list[dict[str, float]]:
    with (out / "reports" / name / "train_steps.csv").open() as f:
        return [{k: float(v) if v not in ("", "None") else None for k, v in r.items()} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/quickstart.toml")
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the recipe's)")
    ap.add_argument("--out", default="reports/benchmarks/optim8bit")
    a = ap.parse_args()
    quiet_libraries()
    out = Path(a.out)
    runs = out / "runs"
    flags = {"runs_dir": str(runs), "reports_dir": str(out / "reports"), "amp": False}
    if a.steps:
        flags["max_steps"] = a.steps
    reports, plans = {}, {}
    for name in OPTIMS:
        cfg: TrainConfig = build_config(TrainConfig, a.recipe, {**flags, "optim": name, "run_name": name})
        plans[name] = memplan.predict(cfg)
        reports[name] = train(cfg, progress=False)
        print(f"{name}: held-out loss {reports[name]['metrics']['eval_loss']:.4f}, "
              f"{reports[name]['what_ran']['optimizer']}")
    # the same held-out blocks through both final models, paired by block
    data = prepare(cfg.data)
    block_losses = {}
    for name in OPTIMS:
        model = load_model(reports[name]["artifact"]).eval()
        block_losses[name] = evaluation.evaluate(model, data.blocks.eval, cfg.optim.batch_size)["block_losses"]
    delta = stats.paired_delta(block_losses["adamw"], block_losses["adamw8bit"])
    table = []
    for name in OPTIMS:
        m, p = reports[name]["metrics"], plans[name]
        states = sum(p.parts[k] for k in ("parameters", "gradients", "optimizer"))
        table.append({"optim": name, "library": reports[name]["what_ran"]["optimizer"],
                      "eval_loss": m["eval_loss"], "bits_per_byte": m.get("bits_per_byte"),
                      "final_train_loss": m["final_train_loss"], "train_tokens_per_s": m["train_tokens_per_s"],
                      "peak_memory_mib": max(m["peak_memory_bytes_per_rank"]) / 2**20,
                      "plan_model_state_bytes_per_param": states / m["params"],
                      "plan_optimizer_mib": p.parts["optimizer"] / 2**20})
    result = {"recipe": a.recipe, "steps": reports["adamw"]["metrics"]["steps"], "rows": table,
              "eval_loss_delta_8bit_vs_adamw": delta, "delta": stats.fmt_delta(delta),
              "device": hardware.describe_device(torch.device("cpu")), "versions": artifacts.versions(),
              "protocol": ("two trainings of the recipe's [train] section in fp32, same seed and data order, "
                           "differing only in --optim; delta: relative change of the mean held-out loss, paired "
                           f"by block over the same {delta['blocks']} held-out blocks, 95% t-interval; one run "
                           "each (training is deterministic for a seed: a second run repeats it exactly); peak "
                           "memory: RSS increase over the training steps, one run each")}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "optim8bit.json", json.dumps(result, indent=2, default=str))

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    curves = {name: rows_of(out, name) for name in OPTIMS}
    for i, name in enumerate(OPTIMS):
        r = curves[name]
        ax.plot([x["step"] for x in r], [x["loss"] for x in r], color=f"C{i}", lw=0.6, alpha=0.7, label=f"{name} train")
        ev = [x for x in r if x["eval_loss"] is not None]
        ax.plot([x["step"] for x in ev], [x["eval_loss"] for x in ev], "o-", color=f"C{i}", label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("AdamW vs 8-bit AdamW, same seed and data")
    ax.legend(fontsize=8)
    diff = [b["loss"] - a_["loss"] for a_, b in zip(curves["adamw"], curves["adamw8bit"], strict=True)]
    ax2.plot([x["step"] for x in curves["adamw"]], diff, lw=0.6, color="C2")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("8-bit minus AdamW, training loss")
    ax2.set_title(f"final held-out: {stats.fmt_delta(delta)} ({delta['verdict']})")
    fig.tight_layout()
    fig.savefig(out / "optim8bit.png", dpi=120)

    lines = ["# AdamW vs 8-bit AdamW", "", f"{result['device']}; {result['protocol']}", "",
             "![curves](optim8bit.png)", "",
             "| optimizer | library | held-out loss | bits/byte | tokens/s | peak MiB (steps) "
             "| plan: model-state B/param |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['optim']} | {r['library']} | {r['eval_loss']:.4f} | {r['bits_per_byte']:.4f} | "
                     f"{r['train_tokens_per_s']:,.0f} | {r['peak_memory_mib']:,.0f} | "
                     f"{r['plan_model_state_bytes_per_param']:.1f} |")
    lines += ["", f"8-bit AdamW against AdamW, held-out loss: {delta['verdict']}, {stats.fmt_delta(delta)}", ""]
    atomic_write_text(out / "optim8bit.md", "\n".join(lines))
    shutil.rmtree(runs, ignore_errors=True)
    print("\n".join(lines[-2:]))
    print(f"report: {out / 'optim8bit.md'}")


if __name__ == "__main__":
    main()
