"""Report writers: one JSON per stage (`reports/<run>/<stage-tag>.json`), appended to `summary.md` and
`summary.csv`, plus per-step CSVs. Plots (matplotlib) are rendered by `plot_*` helpers."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from effkit.artifacts import atomic_write_text

SUMMARY_FIELDS = ["stage", "tag", "artifact", "eval_loss", "perplexity", "train_tokens_per_s", "mfu",
                  "peak_memory_mb", "params", "size_mb", "parallel", "world_size", "amp_dtype", "time"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def summary_row(report: dict[str, Any]) -> dict[str, Any]:
    m, what = report.get("metrics", {}), report.get("what_ran", {})
    peak = m.get("peak_memory_bytes_per_rank") or []
    return {
        "stage": report.get("stage"), "tag": report.get("tag"), "artifact": report.get("artifact"),
        "eval_loss": m.get("eval_loss"), "perplexity": m.get("perplexity"),
        "train_tokens_per_s": m.get("train_tokens_per_s"), "mfu": m.get("mfu"),
        "peak_memory_mb": round(max(peak) / 2**20, 1) if peak else None,
        "params": m.get("params"), "size_mb": round(m["size_bytes"] / 2**20, 2) if m.get("size_bytes") else None,
        "parallel": what.get("parallel"), "world_size": what.get("world_size"), "amp_dtype": what.get("amp_dtype"),
        "time": report.get("time"),
    }


def markdown_section(report: dict[str, Any]) -> str:
    m, what = report.get("metrics", {}), report.get("what_ran", {})
    lines = [f"## {report['stage']} ({report['tag']}) at {report.get('time', '')}", ""]
    lines.append(f"Artifact: `{report.get('artifact')}`")
    lines.append("")
    lines.append("| what ran | |")
    lines.append("|---|---|")
    for k, v in what.items():
        lines.append(f"| {k} | {_fmt(v)} |")
    lines.append("")
    lines.append("| metric | value |")
    lines.append("|---|---|")
    for k, v in m.items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v)
        lines.append(f"| {k} | {_fmt(v)} |")
    if report.get("verdicts"):
        lines.append("")
        lines.extend(f"> {v}" for v in report["verdicts"])
    if report.get("protocol"):
        lines.append("")
        lines.append("How it was measured:")
        lines.extend(f"- {k}: {v}" for k, v in report["protocol"].items())
    lines.append("")
    return "\n".join(lines) + "\n"


def write_stage_report(reports_dir: Path, report: dict[str, Any]) -> Path:
    """Write `<tag>.json` and append to summary.md / summary.csv of the run's report folder."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / f"{report['tag']}.json"
    atomic_write_text(path, json.dumps(report, indent=2, default=str))
    md = reports_dir / "summary.md"
    head = "" if md.exists() else f"# effkit report: {reports_dir.name}\n\n"
    with md.open("a") as f:
        f.write(head + markdown_section(report))
    csv_path = reports_dir / "summary.csv"
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        if new:
            w.writeheader()
        w.writerow(summary_row(report))
    return path


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


def plot_loss_curve(rows: list[dict[str, Any]], path: Path, title: str = "training loss") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(out: Path) -> Path | None:
    """Every `<tag>_steps.csv` of the run on one plot."""
    files = sorted(out.glob("*_steps.csv"), key=lambda f: (not f.name.startswith("train_"), f.name))
    if not files:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    train_end, branch_end = 0, {}  # each pruning mode's rounds continue after training, one after another
    for f in files:
        rows = list(csv.DictReader(f.open()))
        if not rows:
            continue
        tag = f.name.removesuffix("_steps.csv")
        branch = tag.rsplit("-r", 1)[0] if tag.startswith("prune-") else tag
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
    fig.tight_layout()
    path = out / "loss_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(out: Path) -> Path | None:
    """Loss, latency (batch 12) and size of every benchmarked artifact, side by side."""
    bench = out / "bench.json"
    if not bench.is_file():
        return None
    rows = json.loads(bench.read_text())["artifacts"]
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, max(3.0, 0.35 * len(rows) + 1.2)), sharey=True)
    tags = [r["tag"] for r in rows]
    series = [("held-out loss", [r["eval_loss"] for r in rows]),
              ("latency b12 p50 (ms)", [r["latency_b12"]["p50_s"] * 1e3 for r in rows]),
              ("size on disk (MiB)", [r["size_bytes"] / 2**20 for r in rows])]
    for ax, (title, values) in zip(axes, series, strict=True):
        ax.barh(tags, values, color=["#4c72b0" if r["stage"] == "train" else "#dd8452" if r["stage"] == "prune"
                                     else "#55a868" for r in rows])
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.tight_layout()
    path = out / "comparison.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_run_report(reports_dir: Path, run: str) -> tuple[Path, list[Path]]:
    """Re-render `summary.md` of a run from its stage JSONs, with PNG plots."""
    from effkit.errors import EffkitError

    out = Path(reports_dir) / run
    if not out.is_dir():
        known = sorted(p.name for p in Path(reports_dir).iterdir() if p.is_dir()) if Path(reports_dir).is_dir() else []
        raise EffkitError(f"unknown run {run!r}: no {out}; known runs: {', '.join(known) or 'none'}")
    stage_reports = []
    for p in sorted(out.glob("*.json")):
        data = json.loads(p.read_text())
        if isinstance(data, dict) and "tag" in data and "metrics" in data:
            stage_reports.append(data)
    stage_reports.sort(key=lambda r: str(r.get("time", "")))
    plots = [p for p in (plot_loss_curves(out), plot_comparison(out)) if p]
    if any(out.glob("prune-*.json")):
        from effkit.prune.stage import plot_prune_curves

        plots += plot_prune_curves(out)
    lines = [f"# effkit report: {run}", ""]
    for p in plots:
        lines += [f"![{p.stem}]({p.name})", ""]
    if (out / "bench.md").is_file():
        lines += ["## Benchmark", "", *(out / "bench.md").read_text().splitlines()[2:], ""]
    lines += [markdown_section(r) for r in stage_reports]
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    return out / "summary.md", plots
