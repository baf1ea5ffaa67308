"""What the studies share: their settings (`StudyConfig`, declared in effkit.config with the other options), the
record of one study (`Study`: its run and its plot), the training runs they are made of (`_train_cfg`, `_train`,
`_in_process`), step-time helpers (`_steady`, `_steady_mean`, `_time_ci`, `_mib`), the table cell and Markdown
formats (`fmt_value`, `_markdown`), and `run_study`: check the settings, run the study named in
`effkit.registry.STUDIES`, write its JSON, PNG and Markdown."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts
from effkit.child import run_isolated
from effkit.config import StudyConfig, TrainConfig, check_fields
from effkit.errors import EffkitError
from effkit.measure import hardware, stats
from effkit.registry import STUDIES
from effkit.report import atomic_write_text, pyplot
from effkit.train import train_in_processes


@dataclass(frozen=True)
class Study:
    """One `effkit study NAME`. `run(s)` measures and returns {"rows": [...], "notes": [...], ...}; the plot is
    `draw(ax, result)` on one axes of its own (6.4 x 4 in, titled with the name, with a grid), or `figure(plt,
    result)` for a study that lays out its own figure and returns it. `min_nproc`: the processes it needs (the
    studies comparing multi-process modes need 2)."""

    name: str
    help: str
    run: Callable[[StudyConfig], dict[str, Any]]
    draw: Callable[[Any, dict[str, Any]], None] | None = None
    figure: Callable[[Any, dict[str, Any]], Any] | None = None
    min_nproc: int = 1

    def plot(self, result: dict[str, Any], path: Path) -> None:
        plt = pyplot()
        if self.figure is not None:
            fig = self.figure(plt, result)
        else:
            fig, ax = plt.subplots(figsize=(6.4, 4))
            self.draw(ax, result)
            ax.set_title(self.name)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


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


def _time_ci(times: list[float]) -> list[float]:
    _, lo, hi = stats.mean_ci(_steady(times))
    return [lo, hi]


def _mib(b: float) -> float:
    return b / 2**20


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
    study: Study = STUDIES.get(name)  # an unknown name: one line listing the studies
    check_fields(s)
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and s.nproc > cores:
        raise EffkitError(f"--nproc {s.nproc} is more processes than this machine's {cores} CPU cores; "
                          f"use --nproc {cores} or fewer")
    if torch.cuda.is_available() and s.nproc > torch.cuda.device_count():
        raise EffkitError(f"--nproc {s.nproc} is more than this machine's {torch.cuda.device_count()} GPUs")
    if s.nproc < study.min_nproc:
        raise EffkitError(f"the {name} study compares multi-process modes; it needs --nproc {study.min_nproc} or "
                          "more")
    t = time.perf_counter()
    result = study.run(s)
    result.update({"study": name, "config": dataclasses.asdict(s), "wall_s": time.perf_counter() - t,
                   "device": hardware.describe_device(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                   "versions": artifacts.versions(), "git_commit": artifacts.git_commit()})
    out = Path(s.out) / name
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=2, default=str))
    study.plot(result, out / f"{name}.png")
    atomic_write_text(out / f"{name}.md", _markdown(name, result))
    return result
