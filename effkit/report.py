"""Report writers: one JSON per stage (`reports/<run>/<stage-tag>.json`, a `StageReport`); `summary.md` and
`summary.csv` are rebuilt from those JSONs (one writer, so re-running a stage replaces its row); per-step CSVs;
every plot (matplotlib, through `pyplot()`); the run's report (`render_run_report`, with the expected time against
the actual, `eta_section`, and what a time budget left of the training, `schedule_line`); and the `report` stage of
`effkit run` (`ReportStage`), which rebuilds it."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from effkit import workloads
from effkit.artifacts import atomic_write_text, prune_branch
from effkit.errors import EffkitError
from effkit.measure import results
from effkit.measure.results import LossDelta, PairedRatio
from effkit.stage import Plan, RunContext, Stage, Step


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def summary_row(report: dict[str, Any]) -> dict[str, Any]:
    m, what = report.get("metrics", {}), report.get("what_ran", {})
    peak = m.get("peak_memory_bytes_per_rank") or []
    return {
        "stage": report.get("stage"), "tag": report.get("tag"), "artifact": report.get("artifact"),
        "eval_loss": m.get("eval_loss"), "bits_per_byte": m.get("bits_per_byte"), "perplexity": m.get("perplexity"),
        "train_tokens_per_s": m.get("train_tokens_per_s"), "mfu": m.get("mfu"),
        "peak_memory_mb": round(max(peak) / 2**20, 1) if peak else None,
        "params": m.get("params"), "size_mb": round(m["size_bytes"] / 2**20, 2) if m.get("size_bytes") else None,
        "parallel": what.get("parallel"), "world_size": what.get("world_size"), "amp_dtype": what.get("amp_dtype"),
        "time": report.get("time"),
    }


SUMMARY_FIELDS = list(summary_row({}))  # summary.csv's columns


def markdown_section(report: dict[str, Any]) -> str:
    lines = [f"## {report['stage']} ({report['tag']}) at {report.get('time', '')}", "",
             f"Artifact: `{report.get('artifact')}`", "", "| what ran | |", "|---|---|",
             *(f"| {k} | {_fmt(v)} |" for k, v in report.get("what_ran", {}).items()), "",
             "| metric | value |", "|---|---|",
             *(f"| {k} | {_fmt(json.dumps(v) if isinstance(v, (dict, list)) else v)} |"
               for k, v in report.get("metrics", {}).items())]
    if report.get("verdicts"):
        lines.append("")
        lines.extend(f"> {v}" for v in report["verdicts"])
    if report.get("protocol"):
        lines.append("")
        lines.append("How it was measured:")
        lines.extend(f"- {k}: {v}" for k, v in report["protocol"].items())
    lines.append("")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class StageReport:
    """One stage's report of the artifact it made: what ran, its metrics, the verdicts and how each figure was
    measured, with what only that stage reports in `extras` (export's `load_command`, the memory plan beside the
    measured peak, a time budget's `schedule`). Built once, when all of it is known: nothing rewrites it after.
    `as_dict()` is its JSON; readers of the files read that dict back."""
    stage: str
    tag: str
    parent: str | None
    run: str
    artifact: str
    time: str  # `time`, `versions` and `git_commit`: as the artifact's effkit.json records them (`stamp`)
    config: dict[str, Any]
    metrics: dict[str, Any]
    verdicts: list[str]
    what_ran: dict[str, Any]
    versions: dict[str, str]
    git_commit: str | None
    protocol: dict[str, str]
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if clash := sorted(self.extras.keys() & {f.name for f in fields(self)}):
            raise ValueError(f"a stage's extras cannot replace the report's own fields: {clash}")

    def as_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extras"}, **self.extras}


def stamp(meta: dict[str, Any]) -> dict[str, Any]:
    """The report's `time`, `versions` and `git_commit` from the artifact's effkit.json (`artifacts.write_meta`)."""
    return {k: meta[k] for k in ("time", "versions", "git_commit")}


def write_stage_report(reports_dir: Path, report: StageReport) -> Path:
    """Write `<tag>.json` into the run's report folder and rebuild its summary."""
    reports_dir = Path(reports_dir)
    path = reports_dir / f"{report.tag}.json"
    atomic_write_text(path, json.dumps(report.as_dict(), indent=2, default=str))
    rebuild_summary(reports_dir)
    return path


def stage_reports(out: Path, strict: bool = True) -> list[dict[str, Any]]:
    """The stage reports of a run folder (`<tag>.json` with metrics), oldest first. A corrupt file is an error
    when `strict` (`effkit report`), else left out (a stage that just finished still writes its summary)."""
    reports = []
    for p in sorted(Path(out).glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            if not strict:
                continue
            raise EffkitError(f"{p} is corrupt; delete it or re-run the stage that wrote it") from None
        if isinstance(data, dict) and "tag" in data and "metrics" in data:
            reports.append(data)
    return sorted(reports, key=lambda r: str(r.get("time", "")))


def rebuild_summary(out: Path, reports: list[dict[str, Any]] | None = None) -> Path:
    """`summary.md` (plots found in the folder, the bench table, one section per stage) and `summary.csv`
    (one row per stage tag), both rebuilt from the stage JSONs."""
    out = Path(out)
    reports = stage_reports(out, strict=False) if reports is None else reports
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS)
    w.writeheader()
    w.writerows(summary_row(r) for r in reports)
    atomic_write_text(out / "summary.csv", buf.getvalue())
    lines = [f"# effkit report: {out.name}", ""]
    if (out / "deliverable.json").is_file():  # written by `effkit run` after its bench
        ship = json.loads((out / "deliverable.json").read_text())
        lines += ["## What to ship", "", ship["line"], "", f"({ship['how']}.)", ""]
    for name in PLOTS:
        if (out / name).is_file():
            lines += [f"![{Path(name).stem}]({name})", ""]
    for r in reports:
        if line := schedule_line(r):
            lines += ["## Training within the time budget", "", line[0].upper() + line[1:] + ".", ""]
    if (out / "bench.md").is_file():
        lines += ["## Benchmark", "", *(out / "bench.md").read_text().splitlines()[2:], ""]
    lines += [markdown_section(r) for r in reports]
    if (out / "eta.json").is_file():  # written by `effkit run`
        lines += eta_section(json.loads((out / "eta.json").read_text()))
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    return out / "summary.md"


def schedule_line(report: dict[str, Any]) -> str | None:
    """What a time budget did to a training (`schedule` in its report, written by `effkit run`): the steps trained
    of the recipe's and the budget, the bits per byte they reached, and beside it the result the recipe records for
    its full schedule (quoted as the recipe states it); None without a budget."""
    s = report.get("schedule") or {}
    if not s.get("budget_min"):
        return None
    m = report.get("metrics", {})
    full, trained, shortened = s["recipe_steps"], m.get("steps", s["steps"]), s["steps"] < s["recipe_steps"]
    if shortened:
        line = f"trained {trained:,} of {full:,} steps (time budget {s['budget_min']:g} min"
        line += (f": one step predicted at {s['step_time_s']:.3f} s before training"
                 + (f" and {s['training_step_time_s']:.3f} s in training's own first steps"
                    if "training_step_time_s" in s else "")
                 + f", the recipe's steps predicted {s['predicted_full_s'] / 60:.1f} min for the whole run)"
                 if "step_time_s" in s else ")")
    else:
        line = f"trained all {full:,} steps of the recipe (time budget {s['budget_min']:g} min: " + (
            f"predicted {s['predicted_full_s'] / 60:.1f} min for the whole run, within it)" if "predicted_full_s" in s
            else f"{s.get('how_chosen', '')})")
    if m.get("bits_per_byte") is not None:
        line += f": {m['bits_per_byte']:.3f} bits per byte on the held-out blocks"
    if shortened:
        if s.get("full_schedule_result"):
            line += f"; the recipe's full {full:,} steps: {s['full_schedule_result']}"
        line += f"; `effkit run --full` trains all {full:,}"
    return line


def eta_section(eta: dict[str, Any]) -> list[str]:
    """The run's expected time per stage (printed after the first training steps) against what each took."""
    lines = ["## Time on this machine: expected against actual", "",
             f"One training step: {eta['step_time_s']:.3f} s ({eta['step_time_how']}). {eta['how']}.", "",
             *([f"Training steps: {tb['steps']:,} of the recipe's {tb['recipe_steps']:,}, chosen before training for "
                f"a time budget of {tb['budget_min']:g} min; the estimate is for them.", ""]
               if (tb := eta.get("time_budget")) and tb.get("budget_min") else []),
             "| stage | expected | actual | actual / expected |", "|---|---|---|---|"]
    for k, v in eta["predicted_s"].items():
        a = eta["actual_s"].get(k)
        lines.append(f"| {k} | {v / 60:.1f} min | " + (f"{a / 60:.1f} min | {a / v:.2f} |" if a is not None else
                                                       ("skipped (already complete) | |" if k in eta["skipped"]
                                                        else "not run | |")))
    done = [k for k in eta["predicted_s"] if k in eta["actual_s"]]
    if done:
        e, a = sum(eta["predicted_s"][k] for k in done), sum(eta["actual_s"][k] for k in done)
        lines.append(f"| all stages run | {e / 60:.1f} min | {a / 60:.1f} min | {a / e:.2f} |")
    return [*lines, ""]


def write_rows_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    fields: list[str] = []
    for r in rows:
        fields.extend(k for k in r if k not in fields)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(Path(path), buf.getvalue())


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_loss_curve(rows: list[dict[str, Any]], path: Path, title: str = "training loss") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", lw=1)
    ev = [r for r in rows if r.get("eval_loss") is not None]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(plt, fig, path)


def plot_loss_curves(out: Path) -> Path | None:
    """Every `<tag>_steps.csv` of the run on one plot."""
    files = sorted(out.glob("*_steps.csv"), key=lambda f: (not f.name.startswith("train_"), f.name))
    if not files:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    train_end, branch_end = 0, {}  # each pruning mode's rounds continue after training, one after another
    for f in files:
        rows = list(csv.DictReader(f.open()))
        if not rows:
            continue
        tag = f.name.removesuffix("_steps.csv")
        branch = prune_branch(tag) or tag
        offset = 0 if tag == "train" else branch_end.get(branch, train_end)
        steps = [int(r["step"]) + offset for r in rows]
        ax.plot(steps, [float(r["loss"]) for r in rows], lw=1, label=tag)
        if tag == "train":
            train_end = steps[-1]
        else:
            branch_end[branch] = steps[-1]
    ax.set_xlabel("step (fine-tuning rounds follow training)")
    ax.set_ylabel("train loss (nats/token)")
    ax.grid(alpha=0.3)
    if len(files) <= 12:
        ax.legend(fontsize=7)
    return save_figure(plt, fig, out / "loss_curves.png")


def plot_comparison(out: Path) -> Path | None:
    """Held-out loss (95% CI), prefill latency at batch 12 and decode tokens/s at batch 1 and 12, each relative to
    the reference (paired, 95% CI), and size of every benchmarked artifact and peer row, side by side."""
    bench = out / "bench.json"
    if not bench.is_file():
        return None
    rows = json.loads(bench.read_text())["artifacts"]
    shown = sorted((w for w in workloads.all_() if w.name != workloads.PREFILL_B1.name),
                   key=lambda w: w.kind != "prefill")
    panels = [(w.ratio, f"{w.label} {'time' if w.kind == 'prefill' else 'tokens/s'}") for w in shown
              if w.ratio in rows[0]]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 + len(panels), figsize=(4.2 * (2 + len(panels)), max(3.0, 0.4 * len(rows) + 1.4)),
                             sharey=True)
    tags = [r["tag"] for r in rows]
    palette = {"train": "#4c72b0", "import": "#4c72b0", "prune": "#dd8452", "peer": "#8c8c8c"}
    colors = [palette.get(r["stage"], "#55a868") for r in rows]

    def err(values, cis):  # matplotlib's xerr: distances below and above each value
        pairs = list(zip(values, cis, strict=True))
        return [[v - c[0] for v, c in pairs], [c[1] - v for v, c in pairs]]

    loss = [LossDelta.of(r[results.EVAL_LOSS_DELTA]) for r in rows]
    deltas = [d.delta * 100 for d in loss]
    axes[0].barh(tags, deltas, color=colors, capsize=3, xerr=err(deltas, [[c * 100 for c in d.ci95] for d in loss]))
    axes[0].axvline(0.0, color="k", lw=0.8)
    axes[0].set_title(f"Δ held-out loss vs {rows[0]['tag']} (%, paired 95% CI)", fontsize=9)
    for ax, (key, title) in zip(axes[1:], panels, strict=False):
        cmp = [PairedRatio.of(r[key]) for r in rows]
        ratios = [c.ratio for c in cmp]
        ax.barh(tags, ratios, color=colors, xerr=err(ratios, [c.ci for c in cmp]), capsize=3)
        ax.axvline(1.0, color="k", lw=0.8)
        better = "lower" if key.startswith("latency") else "higher"
        ax.set_title(f"{title} / {rows[0]['tag']} ({better} is better)", fontsize=9)
    axes[-1].barh(tags, [r["size_bytes"] / 2**20 for r in rows], color=colors)
    axes[-1].set_title("size on disk (MiB); grey: peer engines", fontsize=9)
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    return save_figure(plt, fig, out / "comparison.png")


def save_sparsity_figure(plt, fig, axes, path: Path) -> None:
    for ax in axes:
        ax.set_xlabel("fraction of block parameters removed (weight mode: zeroed)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel (no control arm) has nothing to label
            ax.legend(fontsize=8)
    save_figure(plt, fig, path)


def plot_prune_curves(out: Path) -> list[Path]:
    """prune_loss.png: held-out loss of each pruning mode next to its dense control (left), and the paired loss
    change against the control with its 95% interval (right: what pruning cost). prune_latency.png: batch-12
    latency relative to the dense parent (paired, 95% interval). One line per pruning run found (mode, and
    whether it distilled), all on one axis: the fraction of transformer-block parameters removed."""
    curves = {}
    for p in sorted(Path(out).glob("prune-*.json")):
        data = json.loads(p.read_text())
        if "curve" in data:
            curves[data.get("label", data["config"]["mode"])] = data["curve"]
    if not curves:
        return []
    plt = pyplot()
    names = {"weight": "weight (zeroed block weights)", "row": "row (MLP channels)",
             "width": "width (residual channels)", "depth": "depth (whole blocks)"}
    label = {k: names.get(k.removesuffix("-distill"), k) + (" + distillation" if k.endswith("-distill") else "")
             for k in curves}

    def removed(mode, r):  # weight mode zeroes weights (its block parameters all stay): its zeroed fraction
        if mode == "weight" or r.get("block_params_removed") is None:
            return r["achieved_sparsity"]
        return r["block_params_removed"]

    def errorbars(ax, xs, cis, color, lab, fmt="o-"):
        cis = [results.comparison(c) for c in cis]
        values = [c.ratio if isinstance(c, PairedRatio) else c.delta * 100 for c in cis]
        scale = 1 if isinstance(cis[0], PairedRatio) else 100
        ends = [c.ci if isinstance(c, PairedRatio) else c.ci95 for c in cis]
        below = [v - e[0] * scale for v, e in zip(values, ends, strict=True)]
        above = [e[1] * scale - v for v, e in zip(values, ends, strict=True)]
        ax.errorbar(xs, values, yerr=[below, above], capsize=3, fmt=fmt, color=color, label=lab)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (mode, rows) in enumerate(curves.items()):
        color, xs = f"C{i}", [removed(mode, r) for r in rows]
        left.plot(xs, [r["eval_loss"] for r in rows], "o-", color=color, label=label.get(mode, mode))
        ctrl = [(x, r["control_eval_loss"]) for x, r in zip(xs, rows, strict=True) if r.get("control_eval_loss")]
        if len(ctrl) > 1:
            left.plot(*zip(*ctrl, strict=True), "s--", color=color, alpha=0.6, label=f"{mode}: its dense control")
        deltas = [(x, r[results.EVAL_LOSS_DELTA_VS_CONTROL]) for x, r in zip(xs, rows, strict=True)
                  if r.get(results.EVAL_LOSS_DELTA_VS_CONTROL)]
        if deltas:
            errorbars(right, [x for x, _ in deltas], [d for _, d in deltas], color, label.get(mode, mode))
    left.set_ylabel("held-out loss (nats/token)")
    left.set_title("pruned vs dense control (same fine-tuning)")
    right.axhline(0.0, color="k", lw=0.8)
    right.set_ylabel("Δ loss vs control (%, paired 95% CI)")
    right.set_title("what pruning cost (0 = nothing)")
    save_sparsity_figure(plt, fig, (left, right), out / "prune_loss.png")

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, (mode, rows) in enumerate(curves.items()):
        pts = [(removed(mode, r), r[results.LATENCY_RATIO_B12]) for r in rows if r.get(results.LATENCY_RATIO_B12)]
        pts = [(0.0, PairedRatio(1.0, (1.0, 1.0), "same"))] + pts  # the dense model itself
        errorbars(ax, [x for x, _ in pts], [p for _, p in pts], f"C{i}", label.get(mode, mode))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("latency b12 / dense (paired, 95% CI)")
    save_sparsity_figure(plt, fig, (ax,), out / "prune_latency.png")
    return [out / "prune_loss.png", out / "prune_latency.png"]


PLOTS = ("loss_curves.png", "comparison.png", "prune_loss.png", "prune_latency.png")


def render_run_report(reports_dir: Path, run: str) -> tuple[Path, list[Path]]:
    """Render the run's PNG plots and rebuild its `summary.md` around them."""
    out = Path(reports_dir) / run
    if not out.is_dir():
        known = sorted(p.name for p in Path(reports_dir).iterdir() if p.is_dir()) if Path(reports_dir).is_dir() else []
        raise EffkitError(f"unknown run {run!r}: no {out}; known runs: {', '.join(known) or 'none'}")
    reports = stage_reports(out, strict=True)  # a corrupt stage report: one line, before any plot is drawn
    plots = [p for p in (plot_loss_curves(out), plot_comparison(out)) if p] + plot_prune_curves(out)
    return rebuild_summary(out, reports), plots


# ------------------------------------------------------------------------------------- the stage in `effkit run`

class ReportStep(Step):
    key = "report"
    records = False  # always runs: it only reads the reports

    def run(self, ctx: RunContext) -> None:
        render_run_report(Path(ctx.plan.run.folders.reports_dir), ctx.plan.run.pipeline.run_name)

    def describe(self, plan: Plan) -> dict[str, Any]:
        return {"stage": "report", "what": "summary.md with plots", "leaves": str(plan.report_dir / "summary.md")}


class ReportStage(Stage):
    name = "report"

    def steps(self, plan: Plan) -> list[Step]:
        return [ReportStep()]


STAGE = ReportStage()
