"""The README's headline table, generated from a run's reports (`bench.json`, `deliverable.json`), never typed.

    python benchmarks/headline.py reports/quickstart            # print the table
    python benchmarks/headline.py reports/quickstart --write    # keep the report in docs/reports/quickstart/ and
                                                                # replace the table in README.md (its markers)

`tests/test_docs.py` checks that the README's table is exactly what this script makes of the kept report.

Every cell comes from the bench's rows: the artifact's own median over its rounds, its paired ratio to the dense
model (`train`) with its interval, and the deliverable's line; the caption says where and when it was measured, and
the level the intervals were computed at (read from the ratios: 98.3% for each look of the bench's sequential
stopping, 95% with fixed rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from effkit.bench.render import same_rounds_note  # noqa: E402
from effkit.measure import stats  # noqa: E402

START, END = "<!-- headline:start (benchmarks/headline.py) -->", "<!-- headline:end -->"
KEPT = ROOT / "docs" / "reports"  # the reports the README's table was generated from
FILES = ("bench.json", "deliverable.json")


RATIOS = ("latency_ratio_b12", "decode_ratio_b1", "decode_ratio_b12")  # the table's ratio columns


def table(report_dir: Path) -> str:
    bench = json.loads((report_dir / "bench.json").read_text())
    ship = json.loads((report_dir / "deliverable.json").read_text()) if (report_dir / "deliverable.json").is_file() \
        else {}
    ref = bench["artifacts"][0]
    rows = ["| artifact | Δ loss vs dense | prefill b12 | decode b1 tok/s | vs dense | decode b12 tok/s | vs dense "
            "| size |", "|---|---|---|---|---|---|---|---|"]
    for r in bench["artifacts"]:
        is_ref = r is ref
        lossless = (ship.get("lossless") or {}).get("tag")
        name = r["tag"] + (" (delivered)" if r["tag"] == ship.get("tag") else "") \
            + (" (lossless)" if r["tag"] == lossless else "")
        name = f"**{name}**" if r["tag"] == ship.get("tag") else name
        if r["stage"] == "peer":
            name = f"peer: {r['tag'].removeprefix('peer-')} of {ref['tag']}"
        loss = (f"ref ({r['eval_loss']:.4f} nats, {r['bits_per_byte']:.4f} bits/byte)" if is_ref
                else stats.fmt_delta(r["eval_loss_delta"]))
        cell = lambda key, r=r, is_ref=is_ref: ("ref" if is_ref  # noqa: E731
                                                else stats.fmt_ratio(r[key]) + same_rounds_note(bench, r, key))
        rows.append(f"| {name} | {loss} | {cell(RATIOS[0])} | {r['decode_tokens_per_s_b1']:,.0f} | "
                    f"{cell(RATIOS[1])} | {r['decode_tokens_per_s_b12']:,.0f} | {cell(RATIOS[2])} | "
                    f"{r['size_ratio']:.2f}x |")
    v = bench.get("versions", {})
    levels = [r[k]["ci_level"] for r in bench["artifacts"] if r is not ref for k in RATIOS if r.get(k)]
    workload = ship.get("optimize_for", "decode-b1")
    command = "effkit run" + ("" if workload == "decode-b1" else f" --workload {workload}")
    caption = (f"Measured by `{command}` on {bench['device']}, {bench['time'][:10]}; torch {v.get('torch')}, "
               f"effkit commit {str(bench.get('git_commit'))[:7]}. Ratios are paired with {ref['tag']} in interleaved "
               f"rounds with {stats.interval_words(levels)}; prefill ratios are of latency (below 1 is "
               "faster), decode ratios of tokens/s (above 1 is faster); `≈` marks an interval that contains 1, `?` "
               "one left undecided; tokens/s are each artifact's median over its own rounds, and where an artifact "
               "settled before the reference stopped (fewer rounds) the reference's figure over those same rounds is "
               "beside its ratio.")
    out = [caption, "", *rows]
    beaten = {which: by for which, by in ship.get("beaten_by_peers", {}).items() if by}
    for which, by in beaten.items():  # a peer that beats what effkit ships is said under the table, not only in
        tag = ship["tag"] if which == "delivered" else ship["lossless"]["tag"]  # the line below it
        out += ["", f"**Slower than a peer**: the {which} artifact {tag} at {workload}: "
                + ", ".join(f"{p} is faster ({tag} vs it {stats.fmt_ratio(r)})" for p, r in by.items()) + "."]
    twins = [f"{r['tag']} runs the very computation of {p}" for r in bench["artifacts"]
             for p in r.get("same_computation_as", ())]
    if twins:  # a tie by construction, which no number of rounds on a noisy machine would show within +-3%
        out += ["", "**Same computation as a peer**: " + "; ".join(twins) + " (the same operators and weights in the "
                "same engine with the same settings: a tie by construction; its measured ratios show this machine's "
                "noise)."]
    if ship.get("line"):
        out += ["", "```", ship["line"], "```"]
    return "\n".join(out)


def readme_table(readme: str) -> str:
    """The table between the README's markers."""
    return readme.partition(START)[2].partition(END)[0].strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report_dir", type=Path)
    ap.add_argument("--write", action="store_true", help="replace the table in README.md between its markers")
    args = ap.parse_args()
    text = table(args.report_dir)
    if not args.write:
        print(text)
        return
    kept = KEPT / args.report_dir.resolve().name
    kept.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (args.report_dir / name).is_file():
            (kept / name).write_text((args.report_dir / name).read_text())
    text = table(kept)
    readme = ROOT / "README.md"
    body = readme.read_text()
    if START not in body or END not in body:
        sys.exit(f"README.md has no {START} ... {END} markers")
    head, _, rest = body.partition(START)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    print(f"wrote the headline table of {args.report_dir} into {readme}")


if __name__ == "__main__":
    main()
