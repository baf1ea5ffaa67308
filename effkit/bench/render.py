"""What the bench writes and prints from its report: bench.md (`bench_markdown`: the main table, the rounds, the
peer and compiled tables, verdicts, notes, protocol, samples), bench.csv (`flat_row`), leaderboard.json
(`leaderboard`), the verdict lines (`verdicts`) and the table the terminal shows a part of (`table_rows`,
`terminal_columns`, for `effkit.console.bench_table`). Every workload column comes from the workload registry
(`effkit.workloads`): registering a workload adds its columns; the built-ins keep the names their readers use.
Everything here reads the report's plain JSON (a bench.json read back renders the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from effkit import workloads
from effkit.bench.rows import TABLES, peer_workloads, train_figure, train_ratio
from effkit.bench.timing import TRAIN_BATCHES
from effkit.measure import results, stats
from effkit.report import atomic_write_text, write_rows_csv

TABLE_TRAIN_BATCH = TRAIN_BATCHES[-1]  # the training batch of bench.md's table and of bench.csv's ratio


# ----------------------------------------------------------------------------------------------- the main table
def workload_columns(w: workloads.Workload) -> tuple[str, str]:
    """A workload's two columns in the bench table: its own figure (`prefill b12 ms`, `decode b1 tok/s`) and its
    ratio to the reference (`decode b1 vs ref`)."""
    return f"{w.label} {'ms' if w.kind == 'prefill' else 'tok/s'}", f"{w.label} vs ref"


def figure_cell(w: workloads.Workload, r: dict[str, Any]) -> str:
    """A row's own figure at `w`: p50 milliseconds (prefill) or tokens/s (decode); n/a where the row has none (a
    report written before `w` was registered)."""
    v = r.get(w.figure)
    if v is None:
        return "n/a"
    return f"{v['p50_s'] * 1e3:.1f}" if w.kind == "prefill" else f"{v:.0f}"


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The bench table: each artifact's own figures, and its paired ratios to the reference with 95% intervals
    (`≈` marks a ratio whose interval contains 1: no difference shown; `?` one left undecided)."""
    ws = workloads.all_()
    cols = ["artifact", "eval loss (95% CI)", "bits/byte", "Δ loss vs ref",
            *[c for w in ws for c in workload_columns(w)],
            f"train tok/s b{TABLE_TRAIN_BATCH}", "train vs ref", "size MiB", "peak MiB"]
    ref = report["artifacts"][0]["tag"]
    rows = []
    for r in report["artifacts"]:
        is_ref = r["tag"] == ref

        def vs(key: str, is_ref: bool = is_ref, r: dict = r) -> str:
            if is_ref:
                return "ref"
            return (stats.fmt_ratio(r[key]) + same_rounds_note(report, r, key)) if key in r else "n/a"

        lo, hi = r["eval_loss_ci95"]
        train = r[train_figure(TABLE_TRAIN_BATCH)]
        bpb = r.get("bits_per_byte")
        rows.append([r["tag"], f"{r['eval_loss']:.4f} ({lo:.3f}-{hi:.3f})", f"{bpb:.4f}" if bpb else "n/a",
                     "ref" if is_ref else stats.fmt_delta(r[results.EVAL_LOSS_DELTA]),
                     *[c for w in ws for c in (figure_cell(w, r), vs(w.ratio))],
                     f"{train:,.0f}" if isinstance(train, float) else "n/a", vs(train_ratio(TABLE_TRAIN_BATCH)),
                     f"{r['size_bytes'] / 2**20:.1f} ({r['size_ratio']:.2f}x)",
                     f"{r['peak_memory_bytes'] / 2**20:.0f}"])
    return cols, rows


def terminal_columns() -> list[str]:
    """The columns a terminal shows of the bench table (`effkit.console.bench_table`; bench.md has them all): the
    loss, each workload of the peer table (prefill at batch 1 left out) with its ratio to the reference and, for
    decode, its tokens/s, the size and the peak memory."""
    shown = peer_workloads()
    cols = ["artifact", "eval loss (95% CI)", "Δ loss vs ref"]
    for w in workloads.all_():
        if w in shown:
            own, vs = workload_columns(w)
            cols += [vs] if w.kind == "prefill" else [own, vs]
    return [*cols, "size MiB", "peak MiB"]


def same_rounds_note(report: dict[str, Any], row: dict[str, Any], ratio_key: str) -> str:
    """`; ref <its figure> in these <n> rounds` beside a ratio whose contender stopped before the reference did
    (settled early): its figure and the ratio are over fewer rounds than the reference's own figure in the first
    row."""
    w = next((w for w in workloads.all_() if w.ratio == ratio_key), None)
    same = row.get("same_rounds", {}).get(w.key) if w else None
    total = report.get("stopping", {}).get(w.measure, {}).get("rounds") if w else None
    if not same or not total or same["rounds"] >= total:
        return ""
    ref = same["reference"]
    value = f"{ref['p50_s'] * 1e3:.1f} ms" if isinstance(ref, dict) else f"{ref:,.0f}"
    return f"; ref {value} in these {same['rounds']} rounds"


# -------------------------------------------------------------------------------------------------- bench.md
def bench_markdown(report: dict[str, Any]) -> str:
    cols, rows = table_rows(report)
    lines = [f"# effkit bench: {report['run']}", "", f"Device: {report['device']}; torch "
             f"{report['versions'].get('torch')}; {report['time']}", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    # the level the printed intervals were computed at, as the ratios carry it, else the stopping records'
    levels = [v["ci_level"] for r in report["artifacts"][1:] for v in r.values()
              if isinstance(v, dict) and "ci_level" in v and "ratio" in v] or [
        s.get("level") for s in report.get("stopping", {}).values()]
    held = [x for x in levels if x is not None]
    # Holm's levels differ ratio by ratio: a look count read off each (as `interval_words` does) would be false
    intervals = (f"intervals at their own Holm levels ({min(held):.2%} to {max(held):.2%}: each ratio's ci_level in "
                 "bench.json and bench.csv)" if held and "Holm" in family_words(report)
                 else stats.interval_words(levels))
    lines += ["", f"Ratios are paired with the reference and carry {intervals}; {family_words(report)}; "
              "≈ marks an interval that "
              "contains 1 (no difference shown) and ? one that also stopped wider than the precision asked for "
              "(undecided: more rounds could still decide it). A contender whose ratios settled early ran fewer "
              "rounds than the reference: its figure and ratio are over its own rounds, and the reference's figure "
              "over those same rounds is beside the ratio (`ref ... in these N rounds`).", ""]
    lines += stopping_lines(report.get("stopping", {}))
    lines += peer_lines(report)
    lines += compiled_lines(report)
    if report.get("verdicts"):
        lines += ["Verdicts:", *[f"- {v}" for v in report["verdicts"]], ""]
    flags = [f"- {r['tag']}: {f}" for r in report["artifacts"] for f in r["flags"]]
    flags += [f"- {tag}: {why}" for tag, why in report.get("not_run", {}).items()]
    if flags:
        lines += ["Notes:", *flags, ""]
    lines += ["How measured:", *[f"- {k}: {v}" for k, v in report["protocol"].items()], ""]
    lines += sample_lines(report["artifacts"])
    return "\n".join(lines)


def family_words(report: dict[str, Any]) -> str:
    """`family-wise error 5% per table: Holm's step-down within each look's 1.67% over the 8 ratios of the main
    table, 12 of the peer table`: how the tables' ratios are corrected together (`stopping.Family`)."""
    sizes: dict[str, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, dict) and "table" in o and "family" in o:
            sizes[o["table"]] = o["family"]
        for v in (o.values() if isinstance(o, dict) else o if isinstance(o, list) else ()):
            walk(v)
    walk(report["artifacts"])
    if not sizes:
        return "each ratio alone (no table-wide correction)"
    alpha = 1 - next(iter(report.get("stopping", {}).values()), {}).get("level", stats.CONFIDENCE)
    return (f"family-wise error {1 - stats.CONFIDENCE:.0%} per table: Holm's step-down within each look's "
            f"{alpha:.2%} over " + ", ".join(f"the {sizes[t]} ratios of the {t} table" for t in TABLES if t in sizes)
            + " (each interval at its Holm level)")


def stopping_lines(records: dict[str, dict[str, Any]]) -> list[str]:
    """How many rounds each measure needed, and why it stopped."""
    if not records:
        return []
    why = {"fixed": "fixed rounds", "decided": "every ratio decided or within the precision",
           "max-rounds": "last look done, some ratios undecided", "budget": "time budget spent, some undecided"}
    def looks(r: dict[str, Any]) -> str:
        per_look = r.get("contenders_per_look", [])
        return f"; contenders per look {'/'.join(map(str, per_look))}" if len(per_look) > 1 else ""
    cells = [f"{name} {r['rounds']} ({why.get(r['stopped'], r['stopped'])}, {r['seconds']:.0f} s{looks(r)})"
             for name, r in records.items()]
    return ["Rounds per measure (a contender whose ratios are settled is not measured in later looks; each ratio "
            "gives its own rounds): " + "; ".join(cells) + ".", ""]


def peer_lines(report: dict[str, Any]) -> list[str]:
    """bench.md's table of every artifact against the engines a user would pick instead (the peer rows)."""
    peers = [r["tag"] for r in report["artifacts"] if r["stage"] == "peer"]
    if not peers:
        return []
    ws = peer_workloads()
    head = " | ".join(f"vs {p}: " + " | ".join(w.label for w in ws) for p in peers)
    lines = ["Against the engines a user would pick instead (the dense reference through them, same rounds; decode "
             "ratios above 1 and prefill ratios below 1 are faster than the peer):", "",
             f"| artifact | {head} |", "|---|" + "---|" * len(ws) * len(peers)]
    same = []
    for r in report["artifacts"]:
        if "vs_peers" in r:
            twins = r.get("same_computation_as", ())
            cells = [stats.fmt_ratio(r["vs_peers"][p][w.key]) + (" (same computation)" if p in twins else "")
                     for p in peers for w in ws]
            lines.append(f"| {r['tag']} | " + " | ".join(cells) + " |")
            same += [f"{r['tag']} runs the very computation of {p}" for p in r.get("same_computation_as", ())]
    if same:
        lines += ["", "; ".join(same) + " (the same operators and weights in the same engine with the same settings: "
                  "one speed by construction). Their ratios are the protocol's A/A check, each alone at its look's "
                  "level and left out of the table's Holm family: a decided one is a measurement problem on this "
                  "machine, flagged in the notes."]
    return [*lines, ""]


def compiled_lines(report: dict[str, Any]) -> list[str]:
    """bench.md's table of compiled vs eager latency and generation (present with --compile)."""
    rows = [r for r in report["artifacts"] if "compiled" in r]
    if not rows:
        return []
    ref = report["artifacts"][0]["tag"]
    big, small = workloads.PREFILL_B12, workloads.PREFILL_B1  # the table's two prefill workloads
    lines = ["Compiled (torch.compile, Inductor; forward with freezing, decoding with a static KV cache) vs eager, "
             "same interleaved rounds:", "",
             f"| artifact | eager {big.tail} ms | compiled {big.tail} ms | compiled vs eager {big.tail} | "
             f"compiled vs {ref} (eager) {big.tail} | compiled vs eager {small.tail} | compiled gen tok/s | "
             "compiled vs eager gen |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["compiled"]
        if big.figure in c:
            fwd = (f"{c[big.figure]['p50_s'] * 1e3:.1f} | {stats.fmt_ratio(c[f'ratio_vs_eager_{big.tail}'])} | "
                   f"{stats.fmt_ratio(c[big.ratio])} | {stats.fmt_ratio(c[f'ratio_vs_eager_{small.tail}'])}")
        else:
            fwd = f"{c['status']} | | |"
        gen = (f"{c['generation_tokens_per_s']:.0f} | {stats.fmt_ratio(c['generation_ratio_vs_eager'])}"
               if "generation_tokens_per_s" in c else f"{c.get('generation_status', 'not run')} |")
        lines.append(f"| {r['tag']} | {r[big.figure]['p50_s'] * 1e3:.1f} | {fwd} | {gen} |")
    return [*lines, ""]


def sample_lines(artifacts_: list[dict[str, Any]]) -> list[str]:
    """Each artifact's greedy text and its seeded sample, side by side (greedy decoding loops at this scale:
    the share of its 8-token windows that repeat says how much)."""
    first = next((r["generation"] for r in artifacts_ if "sampled_text" in r.get("generation", {})), None)
    if first is None:
        return []
    lines = ["Samples (prompt " + repr(first["prompt"]) + f"; sampled: {first['sampling']}):", "",
             "| artifact | greedy | repeated 8-grams | sampled |", "|---|---|---|---|"]
    cell = lambda t: t.replace("\n", "⏎")[:300].replace("|", "\\|")  # noqa: E731  (line breaks shown)
    for r in artifacts_:
        g = r["generation"]
        if "sampled_text" in g:
            lines.append(f"| {r['tag']} | {cell(g['text'])} | {g['greedy_repeated_fraction']:.0%} | "
                         f"{cell(g['sampled_text'])} |")
    return [*lines, ""]


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per artifact, in words, following the statistics."""
    out = []
    for r in rows[1:]:
        parts = [stats.summary_of(r[results.LATENCY_RATIO_B12], f"latency {workloads.PREFILL_B12.tail}"),
                 f"size {r['size_ratio']:.2f}x",
                 stats.summary_of(r[results.EVAL_LOSS_DELTA], f"loss vs {rows[0]['tag']}")]
        if r.get(results.EVAL_LOSS_DELTA_VS_CONTROL):
            parts.append(stats.summary_of(r[results.EVAL_LOSS_DELTA_VS_CONTROL],
                                          "loss vs its dense control (same fine-tuning)"))
        out.append(f"{r['tag']}: " + "; ".join(parts))
    return out


# ------------------------------------------------------------------------------------------------- bench.csv
def csv_names(w: workloads.Workload) -> tuple[str, str]:
    """A workload's columns in bench.csv: (its figure's, its ratio's stem): `latency_b12_p50_ms` and
    `latency_ratio_b12`, `decode_tokens_per_s_b12` and `decode_ratio_b12`; `workloads.GENERATION` under the
    generation's names."""
    if w.name == workloads.GENERATION:
        return "generation_tokens_per_s", results.GENERATION_RATIO
    return (f"{w.measure}_p50_ms" if w.kind == "prefill" else w.figure), w.ratio


def flat_row(r: dict[str, Any]) -> dict[str, Any]:
    """A row of bench.csv: the row's figures, each ratio with its interval, the interval's confidence and its
    verdict in five columns."""
    def num(v):
        return round(v, 2) if isinstance(v, float) else v

    def ratio(key: str) -> dict[str, Any]:
        c = results.PairedRatio.of(r[key]) if r.get(key) else None
        return {f"{key}": c.ratio, f"{key}_lo": c.ci[0], f"{key}_hi": c.ci[1], f"{key}_ci_level": c.ci_level,
                f"{key}_verdict": c.verdict} if c else dict.fromkeys(
                    (key, f"{key}_lo", f"{key}_hi", f"{key}_ci_level", f"{key}_verdict"), "")

    def fig(w: workloads.Workload) -> Any:
        v = r.get(w.figure, "")
        return v["p50_s"] * 1e3 if isinstance(v, dict) else v

    d = results.LossDelta.of(r[results.EVAL_LOSS_DELTA])
    out = {"tag": r["tag"], "stage": r["stage"], "eval_loss": r["eval_loss"], "eval_loss_lo": r["eval_loss_ci95"][0],
           "eval_loss_hi": r["eval_loss_ci95"][1], "perplexity": r["perplexity"],
           "eval_loss_delta": d.delta, "eval_loss_delta_lo": d.ci95[0], "eval_loss_delta_hi": d.ci95[1],
           "eval_loss_delta_verdict": d.verdict}
    for w in workloads.all_():
        figure_name, ratio_key = csv_names(w)
        out |= {figure_name: fig(w), **ratio(ratio_key)}
    out |= {train_figure(b): num(r[train_figure(b)]) for b in TRAIN_BATCHES}
    return {**out, **ratio(train_ratio(TABLE_TRAIN_BATCH)),
            "peak_memory_mb": r["peak_memory_bytes"] / 2**20, "params": r["params"],
            "size_mb": r["size_bytes"] / 2**20, "size_ratio": r["size_ratio"], "flags": "; ".join(r["flags"])}


# ------------------------------------------------------------------------------------------ leaderboard.json
def leaderboard_key(w: workloads.Workload) -> str:
    """A prefill workload's leaderboard key: `inference_latency_12` for prefill-b12, `inference_latency_<tail>`
    for one whose name is not `prefill-b<batch>`."""
    end = w.tail
    return f"inference_latency_{w.batch if end == f'b{w.batch}' else end}"


def leaderboard_units() -> dict[str, str]:
    """leaderboard.json's units: the loss, every prefill workload's latency (decode ones have no slot in its
    format) and the training throughput at each training batch."""
    tokens = lambda w: f", {w.tokens} tokens" if w.tokens else ""  # noqa: E731
    return {"loss": "nats/token (held-out eval loss)",
            **{leaderboard_key(w): f"seconds per forward (batch {w.batch}{tokens(w)}, p50)"
               for w in workloads.of_kind("prefill")},
            **{f"training_throughput_{b}": f"tokens/s (batch {b})" for b in TRAIN_BATCHES}}


def leaderboard(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The leaderboard's slots (its format: bare figures), and beside them (`paired`) what makes them comparable:
    the timings each figure is the median of, and the artifact's paired ratio to the reference with its interval,
    the interval's level and the rounds both ran (`reference`: the first artifact's tag); the loss with its 95%
    interval."""
    def num(v):
        return v if isinstance(v, float) else None

    def paired(r: dict[str, Any]) -> dict[str, Any]:
        out = {"loss": {"eval_loss": r["eval_loss"], "ci95": r["eval_loss_ci95"]}}
        for w in workloads.of_kind("prefill"):
            out[leaderboard_key(w)] = {"timings": r[w.figure].get("samples"),
                                       **({"vs_reference": r[w.ratio]} if r is not rows[0] else {})}
        for b in TRAIN_BATCHES:
            if r is not rows[0] and r.get(train_ratio(b)):
                out[f"training_throughput_{b}"] = {"vs_reference": r[train_ratio(b)]}
        return out

    return {"units": leaderboard_units(), "artifacts": {r["tag"]: {
        "loss": r["eval_loss"], **{leaderboard_key(w): r[w.figure]["p50_s"] for w in workloads.of_kind("prefill")},
        **{f"training_throughput_{b}": num(r[train_figure(b)]) for b in TRAIN_BATCHES}} for r in rows},
        "reference": rows[0]["tag"], "paired": {r["tag"]: paired(r) for r in rows}}


def write_reports(out: Path, report: dict[str, Any]) -> None:
    """bench.json, leaderboard.json, bench.csv and bench.md in the run's report folder `out`."""
    rows = report["artifacts"]
    atomic_write_text(out / "bench.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "leaderboard.json", json.dumps(leaderboard(rows), indent=2))
    write_rows_csv(out / "bench.csv", [flat_row(r) for r in rows])
    atomic_write_text(out / "bench.md", bench_markdown(report))
