"""`effkit study NAME`: the classic distributed-training experiments, measured on this machine.

Every study runs real `effkit train` runs (multi-process ones through the same Accelerate launch as the CLI),
prints a table, and writes `reports/studies/NAME/NAME.json`, `NAME.md` and `NAME.png`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts
from effkit.child import run_isolated
from effkit.config import TrainConfig
from effkit.data import BlockSampler, make_loader, prepare
from effkit.errors import EffkitError
from effkit.measure import metrics, stats
from effkit.measure.results import PairedRatio
from effkit.model import PRESETS
from effkit.report import atomic_write_text, pyplot
from effkit.train import train_in_processes


@dataclass
class StudyConfig:
    model: str = "gpt2-mini"
    data: str = "builtin"
    vocab_size: int = 8192
    block_size: int = 128
    batch_size: int = 4
    steps: int = 12
    nproc: int = 2
    out: str = "reports/studies"
    runs_dir: str = "runs/studies"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)  # batch-size study
    block_sizes: tuple[int, ...] = (64, 128, 256)  # checkpointing study
    max_workers: int = -1  # dataloader study: 0..max_workers (-1: the number of CPU cores)
    microbatches: tuple[int, ...] = (1, 2, 4, 8)  # pipeline study
    memory_models: tuple[str, ...] = ("gpt2-medium",)  # memory study: after --model
    memory_optims: tuple[str, ...] = ("adamw", "adamw8bit")  # memory study
    memory_checkpointing: tuple[bool, ...] = (False, True)  # memory study
    memory_default_allocator: bool = True  # memory study: the first configuration again, with glibc's defaults
    memory_default_allocator_all: bool = False  # memory study: every single-process configuration again with them
    memory_tuned_allocator: bool = True  # memory study: the configurations with the tuned (tensor-tracking) one


def _train_cfg(s: StudyConfig, name: str, **kw) -> TrainConfig:
    base = dict(model=s.model, data=s.data, vocab_size=s.vocab_size, block_size=s.block_size,
                batch_size=s.batch_size, max_steps=s.steps, warmup_steps=2, eval_interval=0, checkpoint_interval=0,
                eval_blocks=8, warmup_steps_excluded=1, run_name=name, runs_dir=s.runs_dir,
                reports_dir=str(Path(s.runs_dir) / "reports"))
    return TrainConfig.from_flat(**{**base, **kw})


def _train(cfg: TrainConfig) -> dict[str, Any]:
    report = train_in_processes(cfg) if cfg.parallel.launched else _in_process(cfg)
    steps_csv = Path(cfg.run.reports_dir) / cfg.run.run_name / "train_steps.csv"
    with steps_csv.open() as f:
        rows = list(csv.DictReader(f))
    report["losses"] = [float(r["loss"]) for r in rows]
    report["step_times"] = [float(r["step_time_s"]) for r in rows]
    return report


def _in_process(cfg: TrainConfig) -> dict[str, Any]:
    """A single-process run in a fresh Python process, so that its peak-memory figure (RSS high-water mark)
    is not hidden by memory an earlier run of the study freed but the allocator kept."""
    return run_isolated("effkit.train:train_from_dict", {"config": cfg.to_dict()},
                        what=f"study run {cfg.run.run_name}")


def _steady(times: list[float]) -> list[float]:
    """Step times without the first (warm-up) step, when at least two remain."""
    return times[1:] if len(times) > 2 else times


def _steady_mean(times: list[float]) -> float:
    return statistics.fmean(_steady(times))


def _mib(b: float) -> float:
    return b / 2**20


# -------------------------------------------------------------------------------------------------- studies

def _time_ci(times: list[float]) -> list[float]:
    _, lo, hi = stats.mean_ci(_steady(times))
    return [lo, hi]


def study_sync(s: StudyConfig) -> dict[str, Any]:
    rows, losses, times = [], {}, {}
    for sync in ("gather-scatter", "all-reduce", "ddp"):
        r = _train(_train_cfg(s, f"sync-{sync}", parallel="ddp", sync=sync, nproc=s.nproc))
        losses[sync], times[sync] = r["losses"], r["step_times"]
        rows.append({"sync": sync, "time_per_iter_s": _steady_mean(r["step_times"]),
                     "time_per_iter_ci95": _time_ci(r["step_times"]),
                     "tokens_per_s": r["metrics"]["train_tokens_per_s"], "final_loss": r["losses"][-1]})
    ref = losses["ddp"]
    notes = []
    for row in rows:
        row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(losses[row["sync"]], ref, strict=True))
        if row["sync"] != "ddp":
            cmp = PairedRatio.of(stats.unpaired_ratio(_steady(times["ddp"]), _steady(times[row["sync"]])))
            row["time_vs_ddp"] = cmp.fmt()
            notes.append(f"{row['sync']} vs ddp, time per iteration: " + (
                "indistinguishable, " if cmp.verdict == "same" else f"{cmp.verdict}, ") + cmp.fmt())
        else:
            row["time_vs_ddp"] = "ref"
    identical = all(r["max_loss_diff_vs_ddp"] < 1e-4 for r in rows)
    return {"rows": rows, "losses": losses, "identical_losses": identical,
            "notes": [f"losses identical across the three strategies (|diff| < 1e-4): {identical}", *notes,
                      f"intervals: {stats.UNPAIRED_METHOD}; the first step of each run is left out"]}


def study_scaling(s: StudyConfig) -> dict[str, Any]:
    rows, times = [], {}
    for n in range(1, s.nproc + 1):
        kw = {"threads": 1} if n == 1 else {"parallel": "ddp", "nproc": n, "threads": 1}
        r = _train(_train_cfg(s, f"scaling-{n}", **kw))
        times[n] = r["step_times"]
        rows.append({"processes": n, "time_per_iter_s": _steady_mean(r["step_times"]),
                     "time_per_iter_ci95": _time_ci(r["step_times"]),
                     "tokens_per_s": r["metrics"]["train_tokens_per_s"]})
    base = rows[0]
    notes = [f"weak scaling: {s.batch_size} blocks per process per step, 1 thread each"]
    for row in rows:
        row["time_pct_of_single"] = 100 * row["time_per_iter_s"] / base["time_per_iter_s"]
        row["scaling_efficiency"] = row["tokens_per_s"] / (row["processes"] * base["tokens_per_s"])
        if row["processes"] > 1:
            cmp = PairedRatio.of(stats.unpaired_ratio(_steady(times[1]), _steady(times[row["processes"]])))
            notes.append(f"{row['processes']} processes vs 1, time per iteration: {cmp.verdict}, "
                         f"{cmp.fmt()} (1.00x would be perfect weak scaling)")
    notes.append(f"intervals: {stats.UNPAIRED_METHOD}; the first step of each run is left out")
    return {"rows": rows, "notes": notes}


def study_batch_size(s: StudyConfig) -> dict[str, Any]:
    rows = []
    for mode in ("fsdp", "tp"):
        for b in s.batch_sizes:
            r = _train(_train_cfg(s, f"batch-{mode}-{b}", parallel=mode, nproc=s.nproc, batch_size=b))
            rows.append({"mode": mode, "batch_size": b, "tokens_per_s": r["metrics"]["train_tokens_per_s"],
                         "peak_memory_mib": _mib(max(r["metrics"]["peak_memory_bytes_per_rank"]))})
    return {"rows": rows, "notes": ["batch size per data-parallel rank; tp ranks share one batch"]}


def study_amp(s: StudyConfig) -> dict[str, Any]:
    rows, losses = [], {}
    for name, amp in (("fp32", False), ("bf16", True)):
        t = time.perf_counter()
        r = _train(_train_cfg(s, f"amp-{name}", amp=amp))
        losses[name] = r["losses"]
        rows.append({"precision": name, "final_eval_loss": r["metrics"]["eval_loss"],
                     "total_time_s": time.perf_counter() - t, "train_tokens_per_s": r["metrics"]["train_tokens_per_s"],
                     "peak_memory_mib": _mib(r["metrics"]["peak_memory_bytes_per_rank"][0])})
    native = metrics.cpu_has_native_bf16() or torch.cuda.is_available()
    return {"rows": rows, "losses": losses,
            "notes": [f"native bf16 on this device: {native}" + ("" if native else
                      " (bf16 is emulated on this CPU, expect it to be slower than fp32)")]}


def study_checkpointing(s: StudyConfig) -> dict[str, Any]:
    rows = []
    limit = PRESETS.get(s.model, {}).get("n_positions", max(s.block_sizes))
    for block in [b for b in s.block_sizes if b <= limit]:
        for ckpt in (False, True):
            r = _train(_train_cfg(s, f"ckpt-{block}-{int(ckpt)}", block_size=block, activation_checkpointing=ckpt))
            rows.append({"block_size": block, "activation_checkpointing": ckpt,
                         "time_per_step_s": _steady_mean(r["step_times"]),
                         "peak_memory_mib": _mib(r["metrics"]["peak_memory_bytes_per_rank"][0])})
    return {"rows": rows, "notes": []}


def study_dataloader(s: StudyConfig) -> dict[str, Any]:
    """Batches drawn per second with 0..max_workers loader processes, measured in a fresh process: forking
    DataLoader workers from a process that had run OpenVINO GenAI's LLMPipeline crashed it (SIGSEGV in the
    loader's shutdown, OpenVINO 2026.4), and a fresh process also keeps what earlier studies left out of the
    timing."""
    return run_isolated("effkit.studies:dataloader_rows", {"config": _train_cfg(s, "dataloader").to_dict(),
                                                            "batch_size": s.batch_size,
                                                            "max_workers": s.max_workers},
                        what="the dataloader study")


def dataloader_rows(config: dict[str, Any], batch_size: int, max_workers: int) -> dict[str, Any]:
    data = prepare(TrainConfig.from_dict(config).data).blocks
    n_batches = min(200, len(data.train) // batch_size)
    rows = []
    for workers in range(0, (max_workers if max_workers >= 0 else os.cpu_count() or 1) + 1):
        sampler = BlockSampler(len(data.train), batch_size, 1, seed=0)
        t = time.perf_counter()
        it = iter(make_loader(data.train, sampler, workers))
        for _ in range(n_batches):
            next(it)
        elapsed = time.perf_counter() - t
        del it
        rows.append({"num_workers": workers, "seconds": elapsed, "batches": n_batches,
                     "batches_per_s": n_batches / elapsed})
    return {"rows": rows, "notes": [f"time to draw {n_batches} batches of {batch_size} pre-tokenized blocks, "
                                    "worker start-up included, in a fresh process"]}


def study_profile(s: StudyConfig) -> dict[str, Any]:
    r = _train(_train_cfg(s, "profile", eval_interval=max(1, s.steps // 2), profile=True))
    phases = r["metrics"]["time_breakdown_s"]
    total = sum(phases.values())
    rows = [{"phase": k, "seconds": v, "percent": 100 * v / total} for k, v in
            sorted(phases.items(), key=lambda kv: -kv[1])]
    return {"rows": rows, "notes": ["timers (time.perf_counter around each phase of the training loop, CUDA "
                                    "synchronised when on GPU), not torch.profiler"]}


def study_pipeline(s: StudyConfig) -> dict[str, Any]:
    """GPipe and 1F1B at `s.nproc` stages as micro-batches grow, one global batch throughout. The bubble is
    estimated from measured times: 1 - (sequential time / stages) / pipelined time, where the sequential time is
    one process running the same micro-batches one after another (batch B/m, m accumulation steps)."""
    p = s.nproc
    batch = max(8, -(-s.batch_size // 8) * 8)  # divisible by every micro-batch count of the study
    rows, seq = [], {}
    for m in s.microbatches:
        r = _train(_train_cfg(s, f"pipeline-seq-m{m}", batch_size=batch // m, grad_accum=m, threads=1))
        seq[m] = _steady_mean(r["step_times"])
    for schedule in ("gpipe", "1f1b"):
        for m in s.microbatches:
            row: dict[str, Any] = {"schedule": schedule, "microbatches": m,
                                   "bubble_theory": (p - 1) / (m + p - 1)}
            if schedule == "1f1b" and m < p:
                rows.append({**row, "time_per_iter_s": None, "time_per_iter_ci95": None,
                             "sequential_time_s": seq[m], "bubble_measured": None, "bubble_ci95": None,
                             "note": f"not run: 1F1B needs at least {p} micro-batches"})
                continue
            r = _train(_train_cfg(s, f"pipeline-{schedule}-m{m}", parallel="pp", nproc=p, threads=1,
                                  batch_size=batch, microbatches=m, pp_schedule=schedule))
            t, (lo, hi) = _steady_mean(r["step_times"]), _time_ci(r["step_times"])
            ideal, lo = seq[m] / p, max(lo, 1e-9)
            rows.append({**row, "time_per_iter_s": t, "time_per_iter_ci95": [lo, hi], "sequential_time_s": seq[m],
                         "bubble_measured": 1 - ideal / t, "bubble_ci95": [1 - ideal / lo, 1 - ideal / hi],
                         "note": ""})
    return {"rows": rows, "notes": [
        f"{p} stages of consecutive blocks (embeddings on the first, LM head on the last), 1 thread per process, "
        f"global batch {batch} blocks split into m micro-batches",
        "bubble_measured = 1 - (sequential / stages) / pipelined time per iteration; the sequential run does the "
        "same micro-batches in one process. It counts everything that keeps a stage from working: the schedule's "
        "bubble, unequal stages and the sends between processes; bubble_theory = (p-1)/(m+p-1) counts the first only",
        "intervals: 95% t-interval of the pipelined step times (the sequential time taken as exact); "
        "the first step of each run is left out"]}


def study_pp_memory(s: StudyConfig) -> dict[str, Any]:
    """Per-rank peak memory and parameter bytes of `pp` vs `ddp` with the same processes and global batch."""
    rows = []
    for mode in ("ddp", "pp"):
        batch = s.batch_size if mode == "pp" else max(1, s.batch_size // s.nproc)
        r = _train(_train_cfg(s, f"pp-memory-{mode}", parallel=mode, nproc=s.nproc, threads=1, batch_size=batch,
                              microbatches=min(batch, max(s.nproc, 2)), eval_blocks=2))
        peaks = r["metrics"]["peak_memory_bytes_per_rank"]
        rows.append({"mode": mode, "processes": s.nproc, "batch_per_rank": batch,
                     "peak_memory_mib_per_rank": [round(_mib(b)) for b in peaks],
                     "max_peak_memory_mib": _mib(max(peaks)),
                     "param_mib_rank0": _mib(r["what_ran"]["parallel_detail"]["param_bytes_this_rank"])})
    ratio = rows[1]["max_peak_memory_mib"] / rows[0]["max_peak_memory_mib"]
    return {"rows": rows, "notes": [
        f"largest per-rank peak, pp / ddp: {ratio:.2f}x (one run each; peak memory is a high-water mark, "
        "not a timing, and varies little between runs; time per step is left out: a few steps give no interval, "
        "and `effkit study pipeline` measures it)",
        f"same global batch ({s.batch_size} blocks): ddp gives each rank {rows[0]['batch_per_rank']}, pp gives every "
        f"stage all {s.batch_size} in micro-batches; {s.steps} steps, fp32, AdamW",
        "peak memory: " + ("cuda max_memory_allocated" if torch.cuda.is_available() else
                           "RSS high-water mark over the training steps minus RSS at their start (the model is "
                           "built whole on every rank, then split, before the measurement starts)")]}


# glibc keeps freed blocks up to its dynamic mmap threshold (up to 32 MiB) in the heap, so the resident set
# stays high after the tensors are gone; with a fixed threshold every block over 128 KiB is returned when freed
# and the resident set follows what the tensors hold (training runs slower this way: only for measuring)
TENSOR_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def study_memory(s: StudyConfig) -> dict[str, Any]:
    """The memory plan against measurement: predicted (effkit.memplan) and measured per-rank peak over the
    training steps, over models x optimizer x activation checkpointing, and for the first model ddp and fsdp on
    `s.nproc` processes."""
    from effkit import memplan

    models = list(dict.fromkeys([s.model, *s.memory_models]))
    configs = [(m, "none", o, ac) for m in models for o in s.memory_optims for ac in s.memory_checkpointing]
    first = (*configs[0], True)
    grid = [(*c, True) for c in configs] if s.memory_tuned_allocator else []
    if s.memory_default_allocator_all:  # the default allocator, as users run, for every configuration
        grid += [(*c, False) for c in configs]
    elif s.memory_default_allocator:  # for the first one
        grid.append((*configs[0], False))
    if s.nproc >= 2:
        grid += [(first[0], mode, first[2], first[3], True) for mode in ("ddp", "fsdp")]
    runs = []
    for model, mode, opt, ac, tensor_rss in grid:
        name = f"memory-{model}-{mode}-{opt}-{'ac' if ac else 'noac'}{'' if tensor_rss else '-default-malloc'}"
        kw = dict(model=model, optim=opt, activation_checkpointing=ac, amp=False, max_steps=min(s.steps, 3),
                  warmup_steps=1, eval_blocks=2)
        if mode != "none":
            kw.update(parallel=mode, nproc=s.nproc, threads=1)
        runs.append((_train_cfg(s, name, **kw), mode, tensor_rss))
    rows = []
    for cfg, mode, tensor_rss in runs:
        model, opt, ac = cfg.model.name, cfg.optim.optim, cfg.model.activation_checkpointing
        env = TENSOR_RSS_ENV if tensor_rss else {}
        if mode == "none":  # the runtime probe's process beside the run's: each measures its own resident set
            with ThreadPoolExecutor(1) as pool:
                planned = pool.submit(memplan.predict, cfg, probe=True, env=env)
                r = run_isolated("effkit.train:train_from_dict", {"config": cfg.to_dict()},
                                 what=f"study run {cfg.run.run_name}", env=env)
                plan = planned.result()
        else:
            plan = memplan.predict(cfg, probe=True, env=env)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                r = train_in_processes(cfg)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        measured = max(r["metrics"]["peak_memory_bytes_per_rank"])
        params = r["metrics"]["params"]
        states = sum(plan.per_rank[k] for k in ("parameters", "gradients", "optimizer"))
        rows.append({"model": model, "parallel": f"{mode} x{s.nproc}" if mode != "none" else "none", "optim": opt,
                     "checkpointing": ac, "allocator": "tensor-tracking" if tensor_rss else "default",
                     "predicted_mib": _mib(plan.steps_bytes), "runtime_mib": _mib(plan.per_rank.get("runtime", 0)),
                     "measured_mib": _mib(measured),
                     "error_pct": 100 * (plan.steps_bytes - measured) / measured,
                     "model_state_bytes_per_param": states / params if mode == "none" else None,
                     "measured_bytes_per_param": (measured + plan.per_rank["parameters"]) / params
                     if mode == "none" else None})
    notes = []
    for allocator, how in (("default", "glibc's default allocator, as users run"),
                           ("tensor-tracking", "the tuned allocator, MALLOC_MMAP_THRESHOLD_=131072")):
        group = [r for r in rows if r["allocator"] == allocator]
        if group:
            within = sum(abs(r["error_pct"]) <= 15 for r in group)
            notes.append(f"{how}: plan within 15% of the measured peak in {within} of {len(group)} configurations; "
                         f"mean |error| {statistics.fmean(abs(r['error_pct']) for r in group):.1f}%")
    notes += ["predicted: " + memplan.METHOD,
              "measured: peak RSS over the training steps minus RSS at their start (the model built before), "
              f"largest rank, one run each ({min(s.steps, 3)} steps, fp32, batch {s.batch_size} x {s.block_size} "
              "tokens); tensor-tracking allocator: glibc's mmap threshold fixed at 128 KiB "
              "(MALLOC_MMAP_THRESHOLD_=131072) so freed tensors leave the resident set; default: as users run, "
              "where glibc keeps freed blocks",
              "model_state_bytes_per_param: the plan's parameters + gradients + optimizer state at the peak / "
              "parameters; measured_bytes_per_param: (measured increase + parameters) / parameters, activations "
              "included",
              "error_pct = (predicted - measured) / measured"]
    return {"rows": rows, "notes": notes}


STUDIES: dict[str, Callable[[StudyConfig], dict[str, Any]]] = {
    "sync": study_sync, "scaling": study_scaling, "batch-size": study_batch_size, "amp": study_amp,
    "checkpointing": study_checkpointing, "dataloader": study_dataloader, "profile": study_profile,
    "pipeline": study_pipeline, "pp-memory": study_pp_memory, "memory": study_memory,
}


# -------------------------------------------------------------------------------------------------- plots

def _plot(name: str, result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    if name == "batch-size":
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for i, mode in enumerate(("fsdp", "tp")):
            sub = [r for r in rows if r["mode"] == mode]
            ax = axes[i]
            ax.plot([r["batch_size"] for r in sub], [r["tokens_per_s"] for r in sub], "o-", color="C0")
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s", color="C0")
            ax2 = ax.twinx()
            ax2.plot([r["batch_size"] for r in sub], [r["peak_memory_mib"] for r in sub], "s--", color="C1")
            ax2.set_ylabel("peak memory / rank (MiB)", color="C1")
            ax.set_title(mode)
        for mode in ("fsdp", "tp"):
            sub = [r for r in rows if r["mode"] == mode]
            axes[2].plot([r["peak_memory_mib"] for r in sub], [r["tokens_per_s"] for r in sub], "o-", label=mode)
        axes[2].set_xlabel("peak memory / rank (MiB)")
        axes[2].set_ylabel("tokens/s")
        axes[2].set_title("fsdp vs tp")
        axes[2].legend()
    elif name == "memory":
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        top = max(max(r["predicted_mib"], r["measured_mib"]) for r in rows) * 1.1
        ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="0.9", label="within 15%")
        ax.plot([0, top], [0, top], "k-", lw=0.8)
        for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
            for ac, marker in ((False, "o"), (True, "s")):
                sub = [r for r in rows if r["model"] == model and r["checkpointing"] == ac
                       and r["allocator"] == "tensor-tracking"]
                if sub:
                    ax.scatter([r["measured_mib"] for r in sub], [r["predicted_mib"] for r in sub], color=f"C{i}",
                               marker=marker, label=f"{model}{', checkpointing' if ac else ''}")
        ax.set_xlabel("measured peak over the steps (MiB)")
        ax.set_ylabel("predicted (MiB)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title("memory plan vs measurement, per rank")
        ax.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        if name == "sync":
            means = [r["time_per_iter_s"] * 1e3 for r in rows]
            err = [[m - r["time_per_iter_ci95"][0] * 1e3 for m, r in zip(means, rows, strict=True)],
                   [r["time_per_iter_ci95"][1] * 1e3 - m for m, r in zip(means, rows, strict=True)]]
            ax.bar([r["sync"] for r in rows], means, yerr=err, capsize=4)
            ax.set_ylabel("time per iteration (ms, 95% CI)")
        elif name == "scaling":
            ax.plot([r["processes"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label="measured")
            ax.plot([r["processes"] for r in rows], [r["processes"] * rows[0]["tokens_per_s"] for r in rows], "--",
                    label="linear")
            ax.set_xlabel("processes")
            ax.set_ylabel("global tokens/s")
            ax.legend()
        elif name == "amp":
            for prec, losses in result["losses"].items():
                ax.plot(range(1, len(losses) + 1), losses, label=prec)
            ax.set_xlabel("step")
            ax.set_ylabel("train loss")
            ax.legend()
        elif name == "checkpointing":
            for ckpt in (False, True):
                sub = [r for r in rows if r["activation_checkpointing"] == ckpt]
                ax.plot([r["block_size"] for r in sub], [r["peak_memory_mib"] for r in sub], "o-",
                        label=f"checkpointing {'on' if ckpt else 'off'}")
            ax.set_xlabel("block size")
            ax.set_ylabel("peak memory (MiB)")
            ax.legend()
        elif name == "dataloader":
            ax.plot([r["num_workers"] for r in rows], [r["seconds"] for r in rows], "o-")
            ax.set_xlabel("num_workers")
            ax.set_ylabel("seconds")
        elif name == "pipeline":
            ms = sorted({r["microbatches"] for r in rows})
            ax.plot(ms, [next(r["bubble_theory"] for r in rows if r["microbatches"] == m) for m in ms], "k--",
                    label="theory (p-1)/(m+p-1)")
            for i, sched in enumerate(("gpipe", "1f1b")):
                sub = [r for r in rows if r["schedule"] == sched and r["bubble_measured"] is not None]
                err = [[r["bubble_measured"] - r["bubble_ci95"][0] for r in sub],
                       [r["bubble_ci95"][1] - r["bubble_measured"] for r in sub]]
                ax.errorbar([r["microbatches"] + 0.08 * (i - 0.5) for r in sub], [r["bubble_measured"] for r in sub],
                            yerr=err, fmt="o-", capsize=4, label=f"{sched} measured (95% CI)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_xlabel("micro-batches m")
            ax.set_ylabel("idle fraction of a stage")
            ax.legend()
        elif name == "pp-memory":
            for i, r in enumerate(rows):
                ax.bar([i * 3 + k for k in range(len(r["peak_memory_mib_per_rank"]))], r["peak_memory_mib_per_rank"],
                       label=r["mode"])
            ax.set_xticks([])
            ax.set_ylabel("peak memory per rank (MiB)")
            ax.legend()
        elif name == "profile":
            ax.pie([r["seconds"] for r in rows], labels=[r["phase"] for r in rows], autopct="%1.0f%%")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_value(v: Any) -> str:
    """A study table cell: 4 significant digits; an interval as lo-hi; - for a value not measured."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, float) for x in v):
        return f"{v[0]:.4g}-{v[1]:.4g}"
    return str(v)


def _markdown(name: str, result: dict[str, Any]) -> str:
    rows = result["rows"]
    cols = list(rows[0])

    def fmt(v):
        return fmt_value(v)

    lines = [f"# study: {name}", "", f"Device: {result['device']}; torch {result['versions'].get('torch')}", "",
             f"![{name}]({name}.png)", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", *[f"- {n}" for n in result["notes"]], "", "Config: " + json.dumps(result["config"]), ""]
    return "\n".join(lines)


def run_study(name: str, s: StudyConfig) -> dict[str, Any]:
    if name not in STUDIES:
        raise EffkitError(f"unknown study {name!r}; choose one of {', '.join(STUDIES)}")
    if s.nproc < 1:
        raise EffkitError(f"--nproc must be at least 1 (got {s.nproc})")
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and s.nproc > cores:
        raise EffkitError(f"--nproc {s.nproc} is more processes than this machine's {cores} CPU cores; "
                          f"use --nproc {cores} or fewer")
    if torch.cuda.is_available() and s.nproc > torch.cuda.device_count():
        raise EffkitError(f"--nproc {s.nproc} is more than this machine's {torch.cuda.device_count()} GPUs")
    if name in ("sync", "batch-size", "pipeline", "pp-memory") and s.nproc < 2:
        raise EffkitError(f"the {name} study compares multi-process modes; it needs --nproc 2 or more")
    if s.steps < 2 or s.batch_size < 1:
        raise EffkitError("--steps must be at least 2 and --batch-size at least 1")
    t = time.perf_counter()
    result = STUDIES[name](s)
    result.update({"study": name, "config": dataclasses.asdict(s), "wall_s": time.perf_counter() - t,
                   "device": metrics.describe_device(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                   "versions": artifacts.versions(), "git_commit": artifacts.git_commit()})
    out = Path(s.out) / name
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=2, default=str))
    _plot(name, result, out / f"{name}.png")
    atomic_write_text(out / f"{name}.md", _markdown(name, result))
    return result
