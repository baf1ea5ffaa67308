"""`effkit train --parallel auto --plan --simulate` checked against a published figure.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21,
arXiv:2104.04473), Table 1 (also the NVIDIA/Megatron-LM README): a GPT of 1.7B parameters (24 heads, hidden 2304,
24 layers, vocabulary 51,200, sequence 2,048) trained with tensor 1 x pipeline 1 (data parallel only) on 32 A100s
(4 DGX nodes, NVLink inside, 8 x 200 Gb/s InfiniBand between) at a global batch of 512 reaches 137 TFLOP/s per GPU
(44% of the 312 peak), counted by their Eq. 3 (activation recomputation included). Here the same model, GPU count,
batch and layout are ranked on paper with the `a100-nvlink` preset, and the data-parallel layout's predicted step is
turned into TFLOP/s per GPU by the same Eq. 3: as effkit's ddp runs (PyTorch's DDP, its bucketed all-reduce hidden
behind the backward) and as the paper's Megatron-LM ran it (its `local` DDP all-reduced the gradients after the
backward: nothing hidden).

Then the measured grid (skipped with --no-grid): on this machine, 2 processes, for each model and per-process batch
(GRID), the ranking cold (a fresh effkit cache: every probe, collective and simulation measured again; the corpus'
tokenizer and tokens linked from the usual cache) and warm, as `effkit train --parallel auto --plan` prints it
(wall seconds of the command), then every layout that fits timed side by side by `--parallel auto`'s trial
(`auto.trial`: paired rounds, the decision rule). auto's pick is the trial's winner among its `--auto-top`
best-predicted layouts, from the same samples; the best is the decision rule's pick among all; the verdict says
whether the pick is decided slower than the best.

Usage: python benchmarks/parallel_auto.py [--out reports/benchmarks] [--no-grid] [--models ...] [--batches ...]
Writes parallel_auto_simulation.json (the ranking, the figure, the simulation's number and the error) and
parallel_auto_grid.json (per case: the pick, the best, the verdict, every layout's predicted and measured step and
the error, the ranking's wall seconds cold and warm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

PUBLISHED = {"source": "Narayanan et al. 2021 (arXiv:2104.04473), Table 1, row 1; NVIDIA/Megatron-LM README",
             "params_billion": 1.7, "heads": 24, "hidden": 2304, "layers": 24, "tp": 1, "pp": 1, "gpus": 32,
             "batch": 512, "seq": 2048, "vocab": 51200, "tflops_per_gpu": 137, "peak_share": 0.44}
# the measured grid: models, per-process batches, tokens per block, steps per layout per paired round (the trial keeps
# those after its two warm-up steps: with 5, three a round)
GRID = {"models": ("gpt2-mini", "gpt2-small", "gpt2-medium"), "batches": (1, 2), "block": 32, "steps": 5}
PRESET = {"gpt2-small": "gpt2"}  # the grid's names of effkit's presets where they differ


def megatron_flops(p: dict) -> float:
    """Eq. 3 of the paper: FLOPs of one iteration with activation recomputation."""
    b, s, n, h, v = p["batch"], p["seq"], p["layers"], p["hidden"], p["vocab"]
    return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def plan_command(model: str, batch: int, block: int, cache: Path) -> float:
    """Wall seconds of `effkit train --parallel auto --plan` on 2 processes with `cache` as the effkit cache."""
    cmd = [sys.executable, "-m", "effkit", "train", "--parallel", "auto", "--plan", "--nproc", "2", "--model", model,
           "--batch-size", str(batch), "--block-size", str(block), "--no-amp", "--max-steps", "1"]
    start = time.perf_counter()
    subprocess.run(cmd, env=dict(os.environ, EFFKIT_CACHE=str(cache)), check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def fresh_cache(folder: Path) -> Path:
    """An empty effkit cache but for the corpus' tokenizer and tokens (linked: building them is not ranking)."""
    from effkit.data.tokenizer import cache_dir

    folder.mkdir(parents=True)
    for name in ("tokenizers", "tokens"):
        if (cache_dir() / name).is_dir():
            (folder / name).symlink_to(cache_dir() / name)
    return folder


def grid_case(model: str, batch: int, block: int, steps: int, scratch: Path) -> dict:
    """One case of the grid (see the module's text)."""
    from effkit.config import TrainConfig
    from effkit.measure.choice import Rule, decide
    from effkit.parallel import auto
    from effkit.train import time_steps

    cache = fresh_cache(scratch / f"{model}-b{batch}")
    preset = PRESET.get(model, model)
    cold = plan_command(preset, batch, block, cache)
    warm = plan_command(preset, batch, block, cache)
    os.environ["EFFKIT_CACHE"] = str(cache)
    cfg = TrainConfig().with_flat(model=preset, parallel="auto", nproc=2, batch_size=batch, block_size=block,
                                  amp=False, auto_steps=steps)
    ranking = auto.rank(cfg)
    rows = [r for r in ranking["layouts"] if r["fits"]]
    start = time.perf_counter()
    auto.trial(cfg, rows, ranking["global_batch"], time_steps)
    rule, order = Rule(), [r["layout"] for r in rows]
    samples = {r["layout"]: r["samples_s"] for r in rows}
    top = order[: cfg.parallel.auto_top]
    pick = decide({n: samples[n] for n in top}, False, rule.level, rule.precision, prefer=order.index).picked
    best = decide(samples, False, rule.level, rule.precision, prefer=order.index)
    verdict = ("the best" if pick == best.picked else "decided slower" if pick in best.screened else
               "a tie" if pick in best.ties else "undecided")
    for r in rows:
        r["error"] = r["predicted_over_measured"] - 1
    return {"model": model, "batch_per_process": batch, "block": block, "steps": steps, "pick": pick,
            "best": best.picked, "verdict": verdict, "best_line": best.line(), "ranking_cold_s": cold,
            "ranking_warm_s": warm, "trial_s": time.perf_counter() - start,
            "max_abs_error": max(abs(r["error"]) for r in rows),
            "layouts": [{k: r[k] for k in ("layout", "flags", "step_s", "compute_s", "comm_s", "bubble_s",
                                           "measured_step_s", "error", "samples_s")} for r in rows],
            "not_fitting": [r["layout"] for r in ranking["layouts"] if not r["fits"]],
            "hardware": ranking["hardware"]["how"]}


def grid(out: Path, models: list[str], batches: list[int], block: int, steps: int) -> None:
    cases = []
    with tempfile.TemporaryDirectory(prefix="effkit-auto-grid-") as tmp:
        for model in models:
            for batch in batches:
                cases.append(grid_case(model, batch, block, steps, Path(tmp)))
                c = cases[-1]
                print(f"{model} batch {batch}: pick {c['pick']}, best {c['best']} ({c['verdict']}); errors up to "
                      f"{c['max_abs_error']:.0%}; ranking {c['ranking_cold_s']:.1f} s cold, "
                      f"{c['ranking_warm_s']:.1f} s warm; trial {c['trial_s']:.0f} s", flush=True)
                (out / "parallel_auto_grid.json").write_text(json.dumps({"grid": GRID, "cases": cases}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/benchmarks")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--models", nargs="+", default=list(GRID["models"]))
    ap.add_argument("--batches", nargs="+", type=int, default=list(GRID["batches"]))
    args = ap.parse_args()
    from transformers import GPT2Config

    from effkit import memplan
    from effkit.config import TrainConfig
    from effkit.parallel import auto

    p = PUBLISHED
    folder = Path(tempfile.mkdtemp(prefix="megatron-1.7b-"))
    GPT2Config(vocab_size=p["vocab"], n_positions=p["seq"], n_embd=p["hidden"], n_layer=p["layers"],
               n_head=p["heads"]).save_pretrained(folder)
    nodes = p["gpus"] // 8
    cfg = TrainConfig().with_flat(model=str(folder), parallel="auto", nproc=8, nnodes=nodes, block_size=p["seq"],
                                  batch_size=p["batch"] // p["gpus"], amp=True, max_steps=1, simulate="a100-nvlink")
    ranking = auto.rank(cfg, "a100-nvlink")
    rows = [r for r in ranking["layouts"] if r["fits"] and r["mode"] == "ddp"]
    ddp = rows[0]
    simulated = megatron_flops(p) / ddp["step_s"] / p["gpus"] / 1e12
    after = auto.predict_step(auto._layout_of(ddp), memplan._model_config(cfg), p["seq"], ranking["global_batch"], 1,
                              replace(auto.simulated_hardware("a100-nvlink"), overlaps=False), True)
    unhidden = megatron_flops(p) / after["step_s"] / p["gpus"] / 1e12
    result = {"published": p, "layout": ddp, "simulated_tflops_per_gpu": simulated,
              "error": simulated / p["tflops_per_gpu"] - 1, "best": ranking["layouts"][0], "ranking": ranking,
              "all_reduce_after_backward": {**after, "tflops_per_gpu": unhidden,
                                            "error": unhidden / p["tflops_per_gpu"] - 1}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel_auto_simulation.json").write_text(json.dumps(result, indent=1))
    print(f"{ddp['layout']} [{ddp['flags']}]: predicted step {ddp['step_s']:.2f} s (compute {ddp['compute_s']:.2f}, "
          f"comm {ddp['comm_s']:.2f}); {simulated:.0f} TFLOP/s per GPU against {p['tflops_per_gpu']} published "
          f"({result['error']:+.0%}); the all-reduce after the backward (Megatron-LM's local DDP): step "
          f"{after['step_s']:.2f} s, {unhidden:.0f} TFLOP/s ({unhidden / p['tflops_per_gpu'] - 1:+.0%}); auto's first: "
          f"{ranking['layouts'][0]['layout']} ({ranking['layouts'][0]['step_s']:.2f} s)")
    if not args.no_grid:
        grid(out, args.models, args.batches, GRID["block"], GRID["steps"])


if __name__ == "__main__":
    main()
