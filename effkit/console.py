"""What the commands print: the rich tables and the lines under them, one `show_*` per command, from the report
the stage returned (the CLI is flags -> config -> stage -> `console.show_*(report)`). Nothing here computes or
decides; rich and the stages' formatters are imported when a table is drawn, so `effkit --help` stays light."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def terminal():
    """A rich console that stays readable when the output is a file or pipe (rich falls back to 80 columns)."""
    from rich.console import Console

    probe = Console()
    return probe if probe.is_terminal else Console(width=160)


def _artifact_lines(report: dict, reports_dir: str) -> None:
    print(f"artifact: {report['artifact']}\nreport:   {Path(reports_dir) / report['run']}")


def show_plan(p: Any) -> None:
    """`effkit <stage> --plan` (train's with `--fit`): a stage's predicted peak (an `effkit.stageplan.StagePlan`),
    its parts, the verdict and, where it was predicted, the time of training."""
    from rich.table import Table

    from effkit.stageplan import HEADROOM

    t = Table(title=f"memory plan: effkit {p.stage}, {p.scope}")
    t.add_column("at the peak")
    t.add_column("MiB", justify="right")
    for k, v in p.parts.items():
        t.add_row(k, f"{v / 2**20:,.0f}")
    t.add_row("[bold]total", f"[bold]{p.total_bytes / 2**20:,.0f}")
    if p.required_bytes != p.total_bytes:
        t.add_row("must fit (less the clean file pages the kernel can drop)", f"{p.required_bytes / 2**20:,.0f}")
    t.add_row(p.device, f"{p.device_bytes / 2**20:,.0f}" if p.device_bytes else "unknown")
    if p.usable_bytes:
        t.add_row(f"usable (less {HEADROOM:.0%} kept free)", f"{p.usable_bytes / 2**20:,.0f}")
    out = terminal()
    out.print(t)
    for n in p.notes:
        out.print(f"  {n}")
    out.print(f"plan: {p.verdict()}; predicted from {p.method}")
    if p.step_s is not None:
        steps = p.config.get("steps") or 0
        total = f", {steps:,} steps: {p.step_s * steps / 60:.1f} min of training" if steps else ""
        out.print(f"time: one training step {p.step_s:.2f} s predicted{total} (the runtime probe's steps of one and "
                  "two blocks, extended to the whole model; evaluations, the checkpoints and the save not counted"
                  + ("; in fp32: --amp auto may choose bf16 where it measures faster" if p.config["amp"] == "auto"
                     else "") + ")")


def show_layouts(r: dict) -> None:
    """`effkit train --parallel auto --plan`: the layouts ranked by predicted step time, one line each (the ones
    that do not fit last, never priced), and what the prediction was made from."""
    hw = r["hardware"]
    where = f"SIMULATION on paper for {hw['name']}" if r["simulated"] else "measured on this machine"
    print(f"parallel layouts for {r['model']} on {r['world']} processes ({r['nnodes']} node(s)), global batch "
          f"{r['global_batch']} x {r['block_size']} tokens: {where}")
    for i, row in enumerate(r["layouts"], 1):
        memory = f"{row['per_rank_bytes'] / 2**20:,.0f} of {row['usable_bytes'] / 2**20:,.0f} MiB per rank"
        if row["fits"]:
            print(f"{i:3}. {row['layout']:<50} step {row['step_s']:.4g} s = compute {row['compute_s']:.4g} + comm "
                  f"{row['comm_s']:.4g} + bubble {row['bubble_s']:.4g}  {memory}  fits  [{row['flags']}]")
        else:
            print(f"  -  {row['layout']:<50} does not fit ({memory}), not timed  [{row['flags']}]")
    for line in r["not_runnable"]:
        print(f"  -  {line}")
    for k, v in hw["how"].items():
        print(f"{k}: {v}")
    hidden = "only DDP's all-reduce overlapping the backward" if hw.get("overlaps", True) else "nothing overlapped"
    print(f"ranked in {r['elapsed_s']:.1f} s; step = compute + communication + pipeline bubble, {hidden}"
          + ("; a simulation: nothing was run" if r["simulated"] else ""))


def show_run_plan(r: dict) -> None:
    """`effkit run --plan`: each stage's memory plan (`effkit.runplan`) and the run's predicted time."""
    from rich.table import Table

    time = r["time"]
    seconds = time.get("seconds", {})
    t = Table(title=f"plan of the run {r['run']} ({r['recipe']})")
    for c in ("stage", "what", "peak GiB", "must fit GiB", "usable GiB", "memory", "predicted time"):
        t.add_column(c, justify="right" if "GiB" in c or c == "predicted time" else "left")
    for row in r["memory"]:
        keys = [k for k in seconds if k == row["stage"] or k.startswith(f"{row['stage']} ")]
        secs = sum(seconds[k] for k in keys)
        t.add_row(row["stage"], row["what"], f"{row['total_bytes'] / 2**30:.2f}",
                  f"{row['required_bytes'] / 2**30:.2f}",
                  f"{row['usable_bytes'] / 2**30:.1f}" if row["usable_bytes"] else "unknown", row["verdict"],
                  f"{secs / 60:.1f} min" if keys else "")
    out = terminal()
    out.print(t)
    for n in r["notes"]:
        out.print(f"  {n}")
    if "total_s" in time:
        steps = (f"{time['steps']:,} of the recipe's {time['recipe_steps']:,} training steps (its "
                 f"{time['budget_min']:g}-minute budget)" if time["steps"] < time["recipe_steps"]
                 else f"all {time['steps']:,} training steps")
        out.print(f"time: {time['total_s'] / 60:.1f} min predicted, {steps}; one training step {time['step_s']:.3f} s "
                  f"({time['how']}); {time['model']}")
        if time.get("share", 1.0) < 1 and len(time.get("shares", {})) > 1:
            out.print(f"  every measuring stage on {time['share']:.0%} of its recipe's budgets, as training")
        if time.get("fits") is False:
            out.print(f"  even the floors are over the {time['budget_min']:g}-minute budget: `effkit run` would stop "
                      "before training (a larger --time-budget-min, or --full)")
        if time.get("under_way"):
            out.print("  this run is under way: the plan is the whole recipe's; `effkit run` skips what is complete "
                      "and keeps the training steps it decided when it started")
    else:
        out.print(f"time: {time['how']}")
    fits = [row["fits"] for row in r["memory"]]
    if False in fits:
        out.print("plan: a stage does NOT fit; `effkit <stage> --plan` shows its parts, and the stage would stop "
                  "before loading")
    elif not fits or None in fits:
        out.print("plan: fit unknown (a device's memory is unknown, or no stage has a memory plan)")
    else:
        out.print("plan: every stage fits")


def show_train(report: dict) -> None:
    """`effkit train`: the metrics table, the artifact and the report (on a node other than 0: where node 0 put
    them)."""
    from rich.table import Table

    if "node_rank" in report:
        print(f"node {report['node_rank']}: training finished; node 0 saved the artifact "
              f"({report['artifact_on_node0']}) and wrote the report ({report['report_on_node0']}) on its machine")
        return
    m, w = report["metrics"], report["what_ran"]
    t = Table(title=f"train: {report['run']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("held-out loss", f"{m['eval_loss']:.4f} nats/token"),
            ("bits per byte", f"{m['bits_per_byte']:.4f}" if m.get("bits_per_byte") else "n/a"),
            ("perplexity", f"{m['perplexity']:.1f}"),
            ("steps", str(m["steps"])),
            ("train tokens/s", f"{m['train_tokens_per_s']:,.0f}" if m["train_tokens_per_s"] else "n/a"),
            ("MFU", f"{m['mfu']:.1%}" if m["mfu"] else f"invalid: {m['mfu_invalid']}" if m.get("mfu_invalid")
             else "n/a"),
            ("peak memory / rank", ", ".join(f"{b / 2**20:,.0f} MiB" for b in m["peak_memory_bytes_per_rank"])),
            ("parameters", f"{m['params']:,}"), ("size on disk", f"{m['size_bytes'] / 2**20:.1f} MiB"),
            ("parallel", f"{w['parallel']} x{w['world_size']}"), ("precision", w["amp_dtype"])]
    for r in rows:
        t.add_row(*r)
    terminal().print(t)
    print(f"artifact: {report['artifact']}\nreport:   {Path(report['config']['run']['reports_dir']) / report['run']}")


def show_prune(report: dict, mode: str, reports_dir: str) -> None:
    """`effkit prune`: one row per round (the dense parent first), the verdicts, the artifact and the report."""
    from rich.table import Table

    from effkit.measure import results
    from effkit.measure.stats import fmt_delta, fmt_ratio

    t = Table(title=f"prune --mode {mode}: {report['run']}")
    for col in ("round", "removed", "eval loss", "control loss", "Δ loss vs control", "params",
                "latency b12 vs dense", "FLOPs speed-up"):
        t.add_column(col, justify="right")
    for r in report["curve"]:
        first = r["round"] == 0
        delta = r.get(results.EVAL_LOSS_DELTA_VS_CONTROL)
        t.add_row(str(r["round"]), f"{r['achieved_sparsity']:.3f}", f"{r['eval_loss']:.4f}",
                  f"{r['control_eval_loss']:.4f}" if r.get("control_eval_loss") is not None else "not run",
                  "ref" if first else (fmt_delta(delta) if delta else "n/a"), f"{r['params']:,}",
                  "ref" if first else fmt_ratio(r[results.LATENCY_RATIO_B12]),
                  "" if first else f"{r['speedup_projected']:.2f}x")
    terminal().print(t)
    for v in report["verdicts"]:
        print(f"note: {v}")
    _artifact_lines(report, reports_dir)


def _quantize_table(report: dict):
    from rich.table import Table

    from effkit.measure import results
    from effkit.measure.stats import fmt_delta, fmt_ratio

    m = report["metrics"]
    t = Table(title=f"quantize ({report['what_ran']['backend']}): {report['run']}")
    for col in ("", "eval loss", "Δ loss vs fp32", "size", "latency b12 (p50)", "b12 vs fp32", "generate tok/s"):
        t.add_column(col, justify="right")
    rows = (("parent fp32", m["parent_fp32"], None, None),
            *([("parent bf16", m["parent_bf16"], m["bf16_eval_loss_delta"], m[results.BF16_LATENCY_RATIO_B12])]
              if "parent_bf16" in m else []),  # absent where the CPU has no native bf16: a note says so
            ("int8", m, m[results.EVAL_LOSS_DELTA], m[results.LATENCY_RATIO_B12]))
    for label, r, delta, ratio in rows:
        gen = r.get("generation", {}).get("tokens_per_s")
        t.add_row(label, f"{r['eval_loss']:.4f}", fmt_delta(delta) if delta else "ref",
                  f"{r['size_bytes'] / 2**20:.1f} MiB" if "size_bytes" in r else "",
                  f"{r[results.LATENCY_B12]['p50_s'] * 1000:.1f} ms", fmt_ratio(ratio) if ratio else "ref",
                  f"{gen:.0f}" if gen else "")
    return t


def _auto_table(auto: dict):
    """`quantize --backend auto`: every candidate backend, and the one it picked."""
    from rich.table import Table

    from effkit.measure.stats import fmt_delta, fmt_ratio

    a = Table(title=f"--backend auto picked {auto['picked']} ({auto.get('verdict', 'decided')}): {auto['how']}")
    w = auto["optimize_for"]
    for col in ("backend", "status", "eval loss", "loss vs parent", f"{w} vs parent", f"{w} vs picked"):
        a.add_column(col)
    for b, row in auto["table"].items():
        a.add_row(b, row["status"], f"{row['eval_loss']:.4f}" if "eval_loss" in row else "",
                  fmt_delta(row["loss_delta"]) if "loss_delta" in row else "",
                  fmt_ratio(row["ratio_to_parent"]) if "ratio_to_parent" in row else "",
                  "picked" if b == auto["picked"] else
                  fmt_ratio(row["ratio_to_picked"]) if "ratio_to_picked" in row else "")
    return a


def show_quantize(report: dict, reports_dir: str) -> None:
    """`effkit quantize`: the parent (fp32, bf16) against int8, auto's choice, the generation samples, the
    verdicts, the artifact and the report."""
    m = report["metrics"]
    terminal().print(_quantize_table(report))
    if m.get("auto"):
        terminal().print(_auto_table(m["auto"]))
    print(f"parent: {m['parent_fp32']['generation']['text'][:120]!r}")
    print(f"int8:   {m['generation']['text'][:120]!r}")
    print(f"int8, sampled ({m['generation']['sampling']}): {m['generation']['sampled_text'][:120]!r}")
    if "note" in m["generation"]:  # e.g. --gen-tokens capped by the model's context
        print(f"note: {m['generation']['note']}")
    for v in report["verdicts"]:
        print(f"note: {v}")
    print(f"int8 layers in the reloaded artifact: {m['int8_layers_reloaded']}; {m['portability']}")
    _artifact_lines(report, reports_dir)


def show_export(report: dict, reports_dir: str) -> None:
    """`effkit export`: the exported model against its PyTorch parent in one line, the sample, the verdicts, how
    to load it, the artifact and the report."""
    from effkit.measure import results
    from effkit.measure.stats import fmt_delta, fmt_ratio

    m = report["metrics"]
    print(f"{report['tag']}: loss {m['eval_loss']:.4f} ({fmt_delta(m[results.EVAL_LOSS_DELTA])} vs PyTorch fp32), "
          f"latency b12 {fmt_ratio(m[results.LATENCY_RATIO_B12])}, size {m['size_ratio_vs_parent']:.2f}x, "
          f"int8 operators {m['int8_layers_reloaded']}")
    print(f"sample: {m['generation']['text'][:120]!r}")
    for v in report["verdicts"]:
        print(f"note: {v}")
    print(f"load it: {report['load_command']}, or effkit bench / generate --from {report['artifact']}")
    _artifact_lines(report, reports_dir)


def bench_table(report: dict, title: str):
    """The bench table for a terminal: the columns that decide (`effkit.bench.render.terminal_columns`: bench.md
    has them all)."""
    from rich.table import Table

    from effkit.bench.render import table_rows, terminal_columns

    cols, rows = table_rows(report)
    keep = [cols.index(c) for c in terminal_columns()]
    t = Table(title=title)
    for i in keep:
        t.add_column(cols[i], justify="left" if cols[i] == "artifact" else "right", no_wrap=cols[i] == "artifact")
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


def show_bench(report: dict, reports_dir: str, as_json: bool = False) -> None:
    """`effkit bench`: the table and its notes, or (`--json`) the machine-readable result."""
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    terminal().print(bench_table(report, f"effkit bench: {report['run']} ({report['device']})"))
    for v in report["verdicts"]:
        print(f"note: {v}")
    print("ratios are paired with the first artifact, with 95% intervals; ≈: the interval contains 1")
    print(f"report: {Path(reports_dir) / report['run']}/bench.md")


def show_run(result: dict, recipe: str, dry_run: bool, out: Any) -> None:
    """`effkit run`: the plan (`--dry-run`), or the bench table, the stages run, the report and the deliverable;
    on `out`, the console the run printed its progress on."""
    if dry_run:
        from rich.table import Table

        t = Table(title=f"plan of {recipe}")
        for col in ("stage", "what", "leaves"):
            t.add_column(col, overflow="fold")
        for s in result["plan"]:
            t.add_row(s["stage"], s["what"], s["leaves"])
        out.print(t)
        for s in result["plan"]:
            if "launch" in s:
                out.print(f"launch ({s['stage']}): {s['launch']}", soft_wrap=True)
        return
    if result["bench"]:
        out.print(bench_table(result["bench"], f"effkit run: {result['bench']['run']}"))
    out.print(f"stages: {', '.join(result['done'])}; wall time {result['wall_s'] / 60:.1f} min")
    if result.get("schedule"):  # what a time budget left of the training, beside the recipe's full result
        out.print(result["schedule"], soft_wrap=True, highlight=False)
    out.print(f"report: {result['report']}")
    if result.get("deliverable"):
        out.print(result["deliverable"]["line"], soft_wrap=True, highlight=False)
