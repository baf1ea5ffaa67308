"""`effkit study memory`: the memory plan (`effkit.memplan`) against measurement: predicted and measured per-rank
peak over the training steps, over models x optimizer x activation checkpointing (with the tuned allocator, glibc's
default one, or both), and for the first model ddp and fsdp on `nproc` processes."""

from __future__ import annotations

import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from effkit import memplan
from effkit.child import run_isolated
from effkit.config import TrainConfig
from effkit.studies.common import Study, StudyConfig, _mib, _train_cfg
from effkit.train import train_in_processes

# glibc keeps freed blocks up to its dynamic mmap threshold (which grows with the blocks freed) in the heap, so
# the resident set stays high after the tensors are gone; with a fixed threshold every block over it is returned
# when freed and the resident set follows what the tensors hold (training runs slower this way: only for measuring)
TENSOR_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run(s: StudyConfig) -> dict[str, Any]:
    """The memory plan against measurement: predicted (effkit.memplan) and measured per-rank peak over the
    training steps, over models x optimizer x activation checkpointing, and for the first model ddp and fsdp on
    `s.nproc` processes."""
    rows = [_row(s, cfg, mode, tensor_rss) for cfg, mode, tensor_rss in _grid(s)]
    return {"rows": rows, "notes": _notes(s, rows)}


def _grid(s: StudyConfig) -> list[tuple[TrainConfig, str, bool]]:
    """The runs: (training config, parallel mode or "none", whether with the tensor-tracking allocator)."""
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
    return runs


def _row(s: StudyConfig, cfg: TrainConfig, mode: str, tensor_rss: bool) -> dict[str, Any]:
    """One run and its plan: the predicted and the measured peak."""
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
    states = sum(plan.parts[k] for k in ("parameters", "gradients", "optimizer"))
    return {"model": model, "parallel": f"{mode} x{s.nproc}" if mode != "none" else "none", "optim": opt,
            "checkpointing": ac, "allocator": "tensor-tracking" if tensor_rss else "default",
            "predicted_mib": _mib(plan.steps_bytes), "runtime_mib": _mib(plan.parts.get("runtime", 0)),
            "measured_mib": _mib(measured),
            "error_pct": 100 * (plan.steps_bytes - measured) / measured,
            "model_state_bytes_per_param": states / params if mode == "none" else None,
            "measured_bytes_per_param": (measured + plan.parts["parameters"]) / params
            if mode == "none" else None}


def _notes(s: StudyConfig, rows: list[dict[str, Any]]) -> list[str]:
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
    return notes


def figure(plt, result: dict[str, Any]):
    """Predicted against measured peak per configuration (tensor-tracking allocator), on log axes, with the band
    within 15%."""
    rows = result["rows"]
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
    return fig


STUDY = Study("memory", "the memory plan against the measured peak, over models, optimizers and checkpointing", run,
              figure=figure)
