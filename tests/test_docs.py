"""The README's headline table is generated from a report kept in the repo, never typed (#39 (8))."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def headline():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "benchmarks" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_headline_table_is_what_the_script_makes_of_the_kept_report():
    h = headline()
    kept = h.KEPT / "quickstart"
    assert (kept / "bench.json").is_file(), "run `python benchmarks/headline.py reports/quickstart --write`"
    readme = (ROOT / "README.md").read_text()
    assert h.readme_table(readme) == h.table(kept).strip()
    assert readme.index("## Commands") < len("\n".join(readme.splitlines()[:60]))  # within the first 60 lines
    assert len(readme.splitlines()) < 150


def fake_bench(level):
    """A two-row bench report (the reference and one contender) whose ratios carry `level` (None: fixed rounds,
    95%, stored without a level), with every field the headline and bench.md read."""
    def ratio(x):
        return {"ratio": x, "ci": [x - 0.1, x + 0.1], "verdict": "faster", "rounds": 24,
                "ci_level": 0.95 if level is None else level}

    rows = [{"tag": tag, "stage": stage, "eval_loss": 4.0, "eval_loss_ci95": [3.9, 4.1], "bits_per_byte": 1.5,
             "perplexity": 54.6, "eval_loss_delta": {"delta": 0.01, "ci95": [0.0, 0.02], "verdict": "worse"},
             "latency_b1": {"p50_s": 0.001}, "latency_b12": {"p50_s": 0.01}, "decode_tokens_per_s_b1": 500.0,
             "decode_tokens_per_s_b12": 3000.0, "train_tokens_per_s_b12": 9000.0, "size_bytes": 2**20,
             "size_ratio": 1.0, "peak_memory_bytes": 2**25, "flags": [], "generation": {},
             **{k: ratio(0.8) for k in ("latency_ratio_b1", "latency_ratio_b12", "decode_ratio_b1",
                                        "decode_ratio_b12", "train_ratio_b12")}}
            for tag, stage in (("train", "train"), ("quantize-dynamic", "quantize"))]
    return {"run": "fake", "device": "CPU", "time": "2026-01-01T00:00:00", "versions": {"torch": "2.13.0"},
            "git_commit": "0123456789", "artifacts": rows, "protocol": {}, "verdicts": [],
            "stopping": {"decode_b1": {"rounds": 24, "looks": 3, "stopped": "max-rounds", "seconds": 1.0,
                                       "level": 0.95 if level is None else level}}}


def test_the_captions_name_the_level_the_intervals_were_computed_at(tmp_path):
    """Under sequential stopping each look's interval is at 1 - 0.05 / 3 = 98.3% (Bonferroni over the 3 looks), but
    the README's headline said "95% intervals" and bench.md "95% intervals (at least 95% under ...)": both now say
    the level the ratios carry, and 95% only where that is what was computed (fixed rounds)."""
    import json

    from effkit.bench import bench_markdown

    h = headline()
    sequential = "98.3% intervals (Bonferroni over 3 looks: together at least 95%)"
    for level, says, not_says in ((0.9833333333333333, sequential, "95% intervals"),
                                  (None, "95% intervals", "98.3%")):
        (tmp_path / "bench.json").write_text(json.dumps(fake_bench(level)))
        caption = h.table(tmp_path).splitlines()[0]
        assert says in caption and not_says not in caption, caption
        md = bench_markdown(fake_bench(level))
        caption = next(line for line in md.splitlines() if line.startswith("Ratios are paired"))
        assert says in caption and not_says not in caption, caption


def test_a_caption_under_holm_names_each_ratios_own_level_not_a_look_count():
    """Holm gives each ratio of a table its own level (0.05/looks/(k - rank + 1)): read as a look count, 99.9%
    became "Bonferroni over 50 looks". The caption gives the range of the levels and where each is kept."""
    from effkit.bench import bench_markdown

    report = fake_bench(0.98)
    row = report["artifacts"][1]
    ratios = [k for k, v in row.items() if isinstance(v, dict) and "ci_level" in v]
    for k, level in zip(ratios, (0.9833, 0.9917, 0.9944, 0.9958, 0.9967), strict=True):
        row[k] = {**row[k], "ci_level": level, "family": 5, "table": "main"}
    caption = next(line for line in bench_markdown(report).splitlines() if line.startswith("Ratios are paired"))
    assert "intervals at their own Holm levels (98.33% to 99.67%" in caption, caption
    assert "Bonferroni over" not in caption and "the 5 ratios of the main table" in caption, caption


def test_the_headline_says_when_a_peer_beats_what_effkit_ships(tmp_path):
    """#42: a peer decided faster than the delivered (or the lossless) artifact at the chosen workload is said under
    the README's table, and the lossless artifact is marked in it."""
    import json

    h = headline()
    (tmp_path / "bench.json").write_text(json.dumps(fake_bench(0.98)))
    slower = {"ratio": 0.8, "ci": [0.7, 0.9], "verdict": "slower"}
    ship = {"tag": "quantize-dynamic", "optimize_for": "decode-b1", "line": "deliver quantize-dynamic ...",
            "lossless": {"tag": "quantize-dynamic"}, "beaten_by_peers": {"delivered": {"peer-x": slower},
                                                                          "lossless": {}}}
    (tmp_path / "deliverable.json").write_text(json.dumps(ship))
    text = h.table(tmp_path)
    assert "**Slower than a peer**: the delivered artifact quantize-dynamic at decode-b1: peer-x is faster" in text
    assert "the lossless artifact" not in text and "quantize-dynamic (delivered) (lossless)" in text
    ship["beaten_by_peers"] = {"delivered": {}, "lossless": {}}
    (tmp_path / "deliverable.json").write_text(json.dumps(ship))
    assert "Slower than a peer" not in h.table(tmp_path)
    # an artifact that runs a peer's very computation is said to, under the table and in bench.md's peer table
    from effkit.bench.render import peer_lines

    bench = fake_bench(0.98)
    bench["artifacts"][0]["stage"], bench["artifacts"][0]["tag"] = "peer", "peer-onnxruntime-int8"
    row = bench["artifacts"][1]
    row["same_computation_as"] = ["peer-onnxruntime-int8"]
    row["vs_peers"] = {"peer-onnxruntime-int8": {k: {"ratio": 0.9, "ci": [0.8, 1.01], "verdict": "same"}
                                                 for k in ("decode_b1", "decode_b12", "prefill_b1", "prefill_b12")}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert ("**Same computation as a peer**: quantize-dynamic runs the very computation of peer-onnxruntime-int8"
            in h.table(tmp_path))
    md = "\n".join(peer_lines(bench))
    assert "(same computation)" in md and "quantize-dynamic runs the very computation of" in md
