"""Distributed-training benchmark on this machine, through the real CLI (`effkit train`), side by side:

1. global tokens/s: DDP with 2 processes x 1 thread against 1 process x 1 thread (same global batch)
2. time per step of the gradient-sync strategies: gather-scatter, all-reduce, DDP (2 processes)
3. per-rank peak memory of FSDP against DDP on gpt2-medium for 2 steps
4. per-rank parameter bytes under TP against one full replica

Usage: python benchmarks/parallel.py [--out reports/benchmarks] [--steps 30]
Writes parallel.json and parallel.md; every figure comes from the stage reports of the runs it starts.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(out: Path, name: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "effkit", "train", "--run-name", name, "--runs-dir", str(out / "runs"),
           "--reports-dir", str(out / "reports"), "--eval-interval", "0", "--checkpoint-interval", "0", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    report = json.loads((out / "reports" / name / "train.json").read_text())
    with (out / "reports" / name / "train_steps.csv").open() as f:
        steps = [float(r["step_time_s"]) for r in csv.DictReader(f)]
    report["step_times"] = steps
    report["wall_s"] = time.perf_counter() - t0
    print(f"  {name}: {report['metrics']['train_tokens_per_s']:.0f} tok/s, "
          f"peak/rank {[round(b / 2**20) for b in report['metrics']['peak_memory_bytes_per_rank']]} MiB", flush=True)
    return report


def steady(times: list[float], skip: int = 5) -> dict:
    t = times[skip:] if len(times) > skip else times[1:]
    return {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "n": len(t)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/benchmarks")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-medium", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    common = ["--model", "gpt2-mini", "--max-steps", str(a.steps), "--warmup-steps", "5"]
    res: dict = {}

    print("1. DDP scaling (global batch 8 x 128 tokens)")
    one = run(out, "scale-1x1", *common, "--batch-size", "8", "--threads", "1")
    two = run(out, "scale-ddp-2x1", *common, "--batch-size", "4", "--threads", "1", "--parallel", "ddp", "--nproc", "2")
    res["scaling"] = {"1x1_tokens_per_s": one["metrics"]["train_tokens_per_s"],
                      "ddp_2x1_tokens_per_s": two["metrics"]["train_tokens_per_s"]}
    res["scaling"]["speedup"] = res["scaling"]["ddp_2x1_tokens_per_s"] / res["scaling"]["1x1_tokens_per_s"]
    print("1b. the same with 4 accumulation micro-steps per optimizer step (global batch 32): DDP syncs once per step")
    one_acc = run(out, "scale-1x1-acc4", *common, "--batch-size", "8", "--grad-accum", "4", "--threads", "1")
    two_acc = run(out, "scale-ddp-2x1-acc4", *common, "--batch-size", "4", "--grad-accum", "4", "--threads", "1",
                  "--parallel", "ddp", "--nproc", "2")
    res["scaling_accum4"] = {"1x1_tokens_per_s": one_acc["metrics"]["train_tokens_per_s"],
                             "ddp_2x1_tokens_per_s": two_acc["metrics"]["train_tokens_per_s"]}
    res["scaling_accum4"]["speedup"] = (res["scaling_accum4"]["ddp_2x1_tokens_per_s"]
                                        / res["scaling_accum4"]["1x1_tokens_per_s"])

    print("2. gradient sync strategies (2 processes, batch 4 per rank)")
    res["sync"] = {}
    for sync in ("gather-scatter", "all-reduce", "ddp"):
        r = run(out, f"sync-{sync}", *common, "--batch-size", "4", "--threads", "1", "--parallel", "ddp",
                "--nproc", "2", "--sync", sync)
        res["sync"][sync] = {**steady(r["step_times"]), "final_loss": r["metrics"]["final_train_loss"]}

    print("4. tensor parallel parameter bytes (gpt2-mini)")
    tp = run(out, "tp-2", *common[:2], "--max-steps", "3", "--batch-size", "8", "--parallel", "tp", "--nproc", "2")
    res["tp"] = {"param_bytes_per_rank_tp2": tp["what_ran"]["parallel_detail"]["param_bytes_this_rank"],
                 "param_bytes_full_replica": two["what_ran"]["parallel_detail"]["param_bytes_this_rank"]}
    res["tp"]["ratio"] = res["tp"]["param_bytes_per_rank_tp2"] / res["tp"]["param_bytes_full_replica"]

    if not a.skip_medium:
        print("3. FSDP vs DDP peak memory per rank (gpt2-medium preset, 2 steps, batch 1 x 128)")
        med = ["--model", "gpt2-medium", "--max-steps", "2", "--warmup-steps", "1", "--batch-size", "1",
               "--eval-blocks", "2", "--nproc", "2", "--threads", "1"]
        ddp = run(out, "medium-ddp", *med, "--parallel", "ddp")
        fsdp = run(out, "medium-fsdp", *med, "--parallel", "fsdp")
        res["memory"] = {"params": ddp["metrics"]["params"],
                         "ddp_peak_bytes_per_rank": ddp["metrics"]["peak_memory_bytes_per_rank"],
                         "fsdp_peak_bytes_per_rank": fsdp["metrics"]["peak_memory_bytes_per_rank"],
                         "method": ddp["protocol"]["peak_memory"]}
        res["memory"]["ratio"] = max(res["memory"]["fsdp_peak_bytes_per_rank"]) / max(
            res["memory"]["ddp_peak_bytes_per_rank"])

    res["device"] = one["what_ran"]["device"]
    res["versions"] = one["versions"]
    res["protocol"] = {"tokens_per_s": one["protocol"]["train_tokens_per_s"],
                       "step_time": "per-step wall time from train_steps.csv, first 5 steps excluded; "
                                    "median (min-max)",
                       "peak_memory": one["protocol"]["peak_memory"]}
    (out / "parallel.json").write_text(json.dumps(res, indent=2))
    md = [f"# Distributed training on {res['device']}", "",
          f"torch {res['versions'].get('torch')}, {a.steps} steps, gpt2-mini unless said; CLI runs under {out}/", "",
          "| measurement | value |", "|---|---|",
          f"| 1 process x 1 thread, tokens/s | {res['scaling']['1x1_tokens_per_s']:,.0f} |",
          f"| DDP 2 processes x 1 thread, global tokens/s | {res['scaling']['ddp_2x1_tokens_per_s']:,.0f} |",
          f"| DDP speed-up | {res['scaling']['speedup']:.2f}x |",
          f"| with grad-accum 4 (global batch 32): 1 x 1 tokens/s | {res['scaling_accum4']['1x1_tokens_per_s']:,.0f} |",
          f"| with grad-accum 4: DDP 2 x 1 global tokens/s | {res['scaling_accum4']['ddp_2x1_tokens_per_s']:,.0f} |",
          f"| with grad-accum 4: DDP speed-up | {res['scaling_accum4']['speedup']:.2f}x |"]
    for sync, s in res["sync"].items():
        md.append(f"| step time, --sync {sync} | {s['median_s'] * 1000:.0f} ms ({s['min_s'] * 1000:.0f}-"
                  f"{s['max_s'] * 1000:.0f}), final loss {s['final_loss']:.4f} |")
    md.append(f"| TP=2 parameter bytes per rank / full replica | {res['tp']['param_bytes_per_rank_tp2'] / 2**20:.1f} "
              f"MiB / {res['tp']['param_bytes_full_replica'] / 2**20:.1f} MiB = {res['tp']['ratio']:.2f} |")
    if "memory" in res:
        m = res["memory"]
        md.append(f"| gpt2-medium ({m['params'] / 1e6:.0f}M) peak memory per rank, DDP | "
                  f"{', '.join(f'{b / 2**30:.2f} GiB' for b in m['ddp_peak_bytes_per_rank'])} |")
        md.append(f"| gpt2-medium peak memory per rank, FSDP | "
                  f"{', '.join(f'{b / 2**30:.2f} GiB' for b in m['fsdp_peak_bytes_per_rank'])} |")
        md.append(f"| FSDP / DDP peak memory | {m['ratio']:.2f} |")
    md += ["", "How measured:"] + [f"- {k}: {v}" for k, v in res["protocol"].items()]
    (out / "parallel.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
