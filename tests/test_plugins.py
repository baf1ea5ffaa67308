"""Plug-ins from outside the package (`tests/plugins/toy_plugin.py`, named in $EFFKIT_PLUGINS as a user would):
a toy engine, a toy workload and a toy stage reach `effkit run` and its bench, and a toy backend's options reach
`--help` and recipe validation, with no line of effkit changed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parent / "plugins"


def plugin_env(tmp_path, **extra):
    path = os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    return {**os.environ, "EFFKIT_PLUGINS": "toy_plugin", "PYTHONPATH": path, "COLUMNS": "250",
            "TOY_CALLS_DIR": str(tmp_path), **extra}


def effkit(args, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "effkit", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_an_engine_is_one_package_and_one_registration(monkeypatch):
    """The toy engine is a package of its own (its Engine and its runtime), and importing it is all it takes to
    reach effkit's engine registry: no line of effkit names it."""
    from effkit.registry import ENGINES

    monkeypatch.syspath_prepend(str(PLUGINS))
    import toy_engine

    try:
        assert hasattr(toy_engine, "__path__") and toy_engine.runtime.__name__ == "toy_engine.runtime"
        assert ENGINES.get("toy") is toy_engine.ENGINE and "toy" in ENGINES.names()
        assert not any("toy" in path for path in ENGINES.builtin.values())
    finally:
        ENGINES.unregister("toy")
        for name in [m for m in sys.modules if m.partition(".")[0] == "toy_engine"]:
            del sys.modules[name]


@pytest.mark.slow
def test_a_plugin_engine_workload_and_stage_run_in_effkit_run_and_its_bench(tmp_path, corpus_dir):
    recipe = tmp_path / "toy.toml"
    recipe.write_text(f"""
[run]
run_name = "toy"
stages = ["train", "bench", "toy"]
optimize_for = "decode-b2"
runs_dir = "{tmp_path / 'runs'}"
reports_dir = "{tmp_path / 'reports'}"

[train]
model = "gpt2-nano"
data = "{corpus_dir}"
vocab_size = 512
block_size = 32
eval_blocks = 4
batch_size = 4
max_steps = 3
warmup_steps = 1
eval_interval = 0
checkpoint_interval = 0

[bench]
quick = true
peer_engines = "toy"  # the built-in peers are covered by test_run; here only the plug-in's
speculative = false  # the speculative artifact is covered by test_bench_speculative and test_run

[toy]
greeting = "hi"
""")
    env = plugin_env(tmp_path)
    out = effkit(["run", str(recipe)], env)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = tmp_path / "reports" / "toy"
    bench = json.loads((reports / "bench.json").read_text())
    rows = {r["tag"]: r for r in bench["artifacts"]}
    assert rows["peer-toy"]["stage"] == "peer"  # the toy engine's peer
    assert list(rows) == ["train", "peer-toy"]
    assert "decode_b2" in bench["stopping"]  # the toy workload was timed for every contender
    for tag, r in rows.items():
        assert r["decode_tokens_per_s_b2"] > 0
        if tag != "train":
            assert r["decode_ratio_b2"]["ci"][0] <= r["decode_ratio_b2"]["ratio"] <= r["decode_ratio_b2"]["ci"][1]
    assert "decode_b2" in rows["train"]["vs_peers"]["peer-toy"]
    assert int((tmp_path / "decode_b2.calls").read_text()) >= 2  # through the toy engine's own decode timer
    assert "decode b2" in (reports / "bench.md").read_text()  # the peer table's column
    ship = json.loads((reports / "deliverable.json").read_text())
    assert ship["optimize_for"] == "decode-b2" and "decode-b2" in ship["line"]
    toy = json.loads((reports / "toy.json").read_text())
    assert toy == {"greeting": "hi", "benched": list(rows), "deliverable": "train"}
    again = effkit(["run", str(recipe)], env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stage 3/3: toy skipped: already complete" in again.stdout


def test_a_plugin_backends_options_reach_help_and_recipe_validation(tmp_path):
    env = plugin_env(tmp_path)
    helped = effkit(["quantize", "--help"], env, timeout=120)
    assert "--toy-bits" in helped.stdout and "toyq: bits per toy weight" in helped.stdout and "toyq" in helped.stdout
    check = ("import sys\nfrom effkit.config import QuantizeConfig, build_config\n"
             "from effkit.errors import EffkitError\n"
             "try:\n    print(build_config(QuantizeConfig, sys.argv[1], {}).options.toy_bits)\n"
             "except EffkitError as e:\n    print('refused:', e)\n")
    recipe = tmp_path / "q.toml"
    for table, says in (("toy_bits = 5", "5"), ('toy_bits = "x"', "toy_bits must be int (got 'x')"),
                        ("toy_bitz = 5", "unknown key 'toy_bitz' in [quantize]")):
        recipe.write_text(f"[quantize]\n{table}\n")
        out = subprocess.run([sys.executable, "-c", check, str(recipe)], capture_output=True, text=True, env=env,
                             timeout=120)
        assert says in out.stdout, out.stdout + out.stderr
    recipe.write_text("[toy]\ngreting = 1\n")  # a plug-in stage's table is checked the same way
    out = subprocess.run([sys.executable, "-c", check, str(recipe)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert "unknown key 'greting' in [toy]" in out.stdout
    without = subprocess.run([sys.executable, "-c", check, str(recipe)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "EFFKIT_PLUGINS": ""})
    assert "unknown section [toy]" in without.stdout


def test_a_plugin_that_does_not_import_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "EFFKIT_PLUGINS": "no_such_effkit_plugin"}
    out = subprocess.run([sys.executable, "-m", "effkit", "train", "--max-steps", "1"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "plug-in module 'no_such_effkit_plugin'" in out.stderr and "Traceback" not in out.stderr


def test_a_plugin_workload_of_a_builtins_kind_and_batch_keeps_its_own_keys_and_a_clash_is_refused():
    """A plug-in's `decode-b12-long` (batch 12, longer decode) took decode-b12's keys (they came from kind and
    batch only): the bench's plan and rows kept one of the two. Keys now come from the name; the built-ins keep
    theirs, and a workload whose keys would still meet another's is refused in one line."""
    import pytest

    from effkit import workloads
    from effkit.bench.rows import combine
    from effkit.errors import EffkitError
    from effkit.measure.stopping import Measured

    builtin = workloads.get("decode-b12")
    long = workloads.Workload("decode-b12-long", "decode", 12, tokens=256)
    try:
        workloads.register(long)
        for attr in ("key", "measure", "figure", "ratio"):
            assert getattr(long, attr) != getattr(builtin, attr), attr
        # the built-ins' keys are what reports and their readers already use
        assert [(w.measure, w.figure, w.ratio) for w in map(workloads.get, workloads.BUILTIN)] == [
            ("latency_b1", "latency_b1", "latency_ratio_b1"), ("latency_b12", "latency_b12", "latency_ratio_b12"),
            ("decode_b1", "decode_tokens_per_s_b1", "decode_ratio_b1"),
            ("decode_b12", "decode_tokens_per_s_b12", "decode_ratio_b12")]
        # both reach a bench row, each with its own figure: 100 tokens/s (decode-b12), 40 (decode-b12-long)
        record = {"level": 0.95, "rounds": 4}
        rate = {long.measure: 40.0, builtin.measure: 100.0}
        timed = {w.measure: Measured({t: [[rate.get(w.measure, 1.0)]] * 4 for t in ("ref", "a")}, record)
                 for w in workloads.all_()}
        timed |= {m: Measured({}, record) for m in ("train_b4", "train_b12")}
        static = [{"tag": t, "stage": "train" if t == "ref" else "quantize", "block_losses": [1.0, 2.0],
                   "block_docs": [0, 1], "size_bytes": 10, "generation": {}, "eval_loss": 1.5} for t in ("ref", "a")]
        row = combine(static, timed)[1]
        assert row[builtin.figure] == 100.0 and row[long.figure] == 40.0
        assert builtin.ratio in row and long.ratio in row
        # replacing a workload of the same name is allowed; a different name with the same keys is not
        workloads.register(workloads.Workload("decode-b12-long", "decode", 12, tokens=128))
        for clash, theirs in ((workloads.Workload("b12-long", "decode", 3), "decode-b12-long"),
                              (workloads.Workload("b12", "decode", 12), "decode-b12"),
                              (workloads.Workload("prefill-ratio-b12", "prefill", 12), "prefill-b12")):
            with pytest.raises(EffkitError) as refused:
                workloads.register(clash)
            said = str(refused.value)
            assert repr(clash.name) in said and repr(theirs) in said and "rename it" in said and "\n" not in said
            assert clash.name not in workloads.names()
    finally:
        for name in ("decode-b12-long", "b12-long", "b12", "prefill-ratio-b12"):
            workloads.unregister(name)


def test_a_registered_workload_adds_its_columns_to_every_table_and_the_builtins_keep_theirs():
    """#43: bench.md's table, bench.csv, leaderboard.json and the terminal's table named their b1/b12 columns by
    hand, so a registered workload reached bench.json but none of them. Their columns now come from the registry;
    the built-ins' names (which tests and users read) are what they were."""
    from effkit import workloads
    from effkit.bench.render import flat_row, leaderboard, table_rows, terminal_columns
    from effkit.bench.rows import combine
    from effkit.measure.stopping import Measured

    builtin_cols = ["artifact", "eval loss (95% CI)", "bits/byte", "Δ loss vs ref", "prefill b1 ms",
                    "prefill b1 vs ref", "prefill b12 ms", "prefill b12 vs ref", "decode b1 tok/s", "decode b1 vs ref",
                    "decode b12 tok/s", "decode b12 vs ref", "train tok/s b12", "train vs ref", "size MiB", "peak MiB"]
    builtin_csv = ["latency_b1_p50_ms", "latency_ratio_b1", "latency_b12_p50_ms", "latency_ratio_b12",
                   "generation_tokens_per_s", "generation_ratio", "decode_tokens_per_s_b12", "decode_ratio_b12"]
    added = [workloads.Workload("decode-b4", "decode", 4), workloads.Workload("prefill-b2-long", "prefill", 2, 64)]

    def report():
        record = {"level": 0.95, "rounds": 4}
        timed = {w.measure: Measured({t: [[0.01 if w.kind == "prefill" else 100.0]] * 4 for t in ("ref", "a")},
                                     record) for w in workloads.all_()}
        timed |= {m: Measured({}, record) for m in ("train_b4", "train_b12")}
        static = [{"tag": t, "stage": "train" if t == "ref" else "quantize", "block_losses": [1.0, 2.0],
                   "block_docs": [0, 1], "size_bytes": 10, "generation": {}, "eval_loss": 1.5,
                   "eval_loss_ci95": [1.4, 1.6], "perplexity": 4.5, "peak_memory_bytes": 2**20, "params": 3}
                  for t in ("ref", "a")]
        return {"artifacts": combine(static, timed), "stopping": {}}

    before = report()
    cols, _ = table_rows(before)
    assert cols == builtin_cols
    assert terminal_columns() == ["artifact", "eval loss (95% CI)", "Δ loss vs ref", "prefill b12 vs ref",
                                  "decode b1 tok/s", "decode b1 vs ref", "decode b12 tok/s", "decode b12 vs ref",
                                  "size MiB", "peak MiB"]
    csv_cols = list(flat_row(before["artifacts"][1]))
    assert [c for c in csv_cols if c in builtin_csv] == builtin_csv
    assert set(leaderboard(before["artifacts"])["units"]) == {"loss", "inference_latency_1", "inference_latency_12",
                                                              "training_throughput_4", "training_throughput_12"}
    try:
        for w in added:
            workloads.register(w)
        after = report()
        cols, rows = table_rows(after)
        assert cols[:len(builtin_cols) - 4] == builtin_cols[:-4] and cols[-4:] == builtin_cols[-4:]
        assert cols[-8:-4] == ["decode b4 tok/s", "decode b4 vs ref", "prefill b2-long ms", "prefill b2-long vs ref"]
        assert rows[1][cols.index("decode b4 tok/s")] == "100"
        assert {"decode b4 tok/s", "decode b4 vs ref", "prefill b2-long vs ref"} <= set(terminal_columns())
        assert {"decode_tokens_per_s_b4", "decode_ratio_b4", "latency_b2_long_p50_ms",
                "latency_ratio_b2_long"} <= set(flat_row(after["artifacts"][1]))
        board = leaderboard(after["artifacts"])
        assert board["units"]["inference_latency_b2_long"] == "seconds per forward (batch 2, 64 tokens, p50)"
        assert board["artifacts"]["a"]["inference_latency_b2_long"] == 0.01
    finally:
        for w in added:
            workloads.unregister(w.name)


def test_a_registered_prefill_workload_joins_the_parent_comparisons_under_its_own_keys():
    """The parent comparisons of quantize, export and prune timed batch 1 and 12 by hand: a registered prefill
    workload was measured by the bench but not beside the parent. They now time every prefill workload at its batch
    and tokens, under its keys; the built-ins keep theirs."""
    from effkit import workloads
    from effkit.measure import compare
    from effkit.measure.stopping import Stopping, measure
    from effkit.prune.stage import CurvePoint

    asked = []

    def contender(b, t):
        asked.append((b, t))
        return lambda: 0.01 * b

    extra = workloads.Workload("prefill-b4", "prefill", 4, tokens=16)
    try:
        workloads.register(extra)
        timed = compare.side_by_side({n: contender for n in ("fp32", "bf16", "int8", "fp32 compiled")}, 32,
                                     Stopping(rounds=2, fixed=True), 1)
        assert set(timed) == {"b1", "b12", "b4"} and {(1, 32), (12, 32), (4, 16)} == set(asked)
        gen = measure({"fp32": lambda: 1.0, "int8": lambda: 1.0}, Stopping(rounds=2, fixed=True), 1)
        m = compare._timing_ratios(timed, gen, None, {"fp32": "compiled"})
        for tail in ("b1", "b12", "b4"):
            assert {f"latency_ratio_{tail}", f"latency_ratio_{tail}_vs_bf16", f"bf16_latency_ratio_{tail}"} <= set(m)
            assert f"latency_{tail}" in m["stopping"] and tail in m["samples"]
            assert f"fp32_compiled_vs_fp32_{tail}" in m["compiled"]
        ratio = {"ratio": 1.0, "ci": [0.9, 1.1], "verdict": "same"}
        metrics = {**{k: 0.0 for k in ("achieved_sparsity", "block_params_removed", "n_embd", "n_layer", "n_inner",
                                        "eval_loss", "eval_loss_ci95", "params", "flops_per_token_dense",
                                        "speedup_projected_from_flops")}, "eval_loss_delta_vs_dense": ratio,
                   **{w.measure: {"p50_s": 0.01} for w in workloads.of_kind("prefill")},
                   **{w.ratio: ratio for w in workloads.of_kind("prefill")}}
        row = CurvePoint.of_round(1, 0.5, {"metrics": metrics, "artifact": "a"}, structured=True).to_dict()
        assert {"latency_b1_s", "latency_b12_s", "latency_b4_s", "latency_ratio_b1", "latency_ratio_b12",
                "latency_ratio_b4"} <= set(row)
    finally:
        workloads.unregister(extra.name)
    assert set(compare.side_by_side({"fp32": contender}, 32, Stopping(rounds=2, fixed=True), 1)) == {"b1", "b12"}
