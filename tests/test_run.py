import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    assert_choice_from_samples,
    assert_delta_from_blocks,
    assert_ratio_from_samples,
    loss_verdict_matches_interval,
)
from rich.console import Console

from effkit import cli
from effkit.bench import deliverable
from effkit.errors import EffkitError
from effkit.pipeline import (
    BUDGET_USED,
    Eta,
    fingerprints,
    make_plan,
    run_pipeline,
    stage_budgets,
    stage_work,
)
from effkit.quantize.stage import best_pruned
from effkit.stage import costs


def key_paths(obj, prefix=""):
    """Every key path of a JSON value (`a.b[].c`): list items share one path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{prefix}.{k}"
            yield from key_paths(v, f"{prefix}.{k}")
    elif isinstance(obj, list):
        for v in obj:
            yield from key_paths(v, f"{prefix}[]")


def write_recipe(tmp_path, corpus_dir, extra_run="", prune_rounds=1, finetune=1, latency_rounds=5, extra_bench="",
                 latency_repeats=2):
    recipe = tmp_path / "tiny.toml"
    modes = "" if "prune_modes" in extra_run else 'prune_modes = ["row"]'
    recipe.write_text(f"""
[run]
run_name = "tiny"
{modes}
runs_dir = "{tmp_path / 'runs'}"
reports_dir = "{tmp_path / 'reports'}"
{extra_run}

[train]
model = "gpt2-nano"
data = "{corpus_dir}"
vocab_size = 512
block_size = 32
eval_blocks = 4
batch_size = 4
max_steps = 4
warmup_steps = 1
eval_interval = 0
checkpoint_interval = 0

[prune]
target = 0.5
rounds = {prune_rounds}
finetune_steps = {finetune}
batch_size = 4
latency_rounds = {latency_rounds}
latency_repeats = {latency_repeats}
fixed_rounds = true

[quantize]
backend = "dynamic"
latency_repeats = {latency_repeats}
latency_rounds = {latency_rounds}
gen_tokens = 4
fixed_rounds = true

[bench]
quick = true
{extra_bench}
""")
    return recipe


@pytest.mark.slow
def test_tiny_recipe_end_to_end_then_skips(tmp_path, corpus_dir):
    # the fewest rounds, repeats and tokens the options allow: every step of the run, each measure a short one
    recipe = write_recipe(tmp_path, corpus_dir, extra_run='quantize_from = ["train", "best-pruned"]\n'
                                                          "max_loss_increase = 0.5", latency_rounds=2,
                          latency_repeats=1, extra_bench="rounds = 3\nrepeats = 1\ngen_tokens = 8\n"
                                                         "contest_budget_s = 1")
    first = run_pipeline(str(recipe))
    assert first["done"] == ["train", "prune row", "quantize train", "quantize best-pruned (prune-row-distill-r1)",
                             "bench",
                             "report"]
    tags = [r["tag"] for r in first["bench"]["artifacts"]]
    # effkit run makes the speculative artifact: benched where its k measured faster than plain decoding, else listed
    from effkit.bench.speculative import REF_INT4, tag_of

    spec = tag_of(REF_INT4)  # the reference's weight-only form: the run has no weight-only artifact
    assert (spec in tags) != (spec in first["bench"]["not_run"])
    tags = [t for t in tags if t != spec]
    assert tags == ["train", "prune-row-distill-r1", "quantize-dynamic", "prune-row-distill-r1+quantize-dynamic",
                    "peer-ctranslate2-int8", "peer-onnxruntime-int8", "peer-openvino",
                    "peer-llamacpp"]  # effkit run benches the peers
    peers = [r for r in first["bench"]["artifacts"] if r["stage"] == "peer"]
    assert all(r["decode_tokens_per_s_b1"] > 0 and r["decode_tokens_per_s_b12"] > 0 for r in peers)
    assert set(first["bench"]["artifacts"][0]["vs_peers"]) == {"peer-ctranslate2-int8", "peer-onnxruntime-int8",
                                                               "peer-openvino", "peer-llamacpp"}
    from effkit.bench.rows import peer_workloads

    # the peers decode exactly the tokens every artifact decodes (same prompt, same count, same end-of-text rule)
    assert len({r["generation"]["new_tokens"] for r in first["bench"]["artifacts"]}) == 1
    assert {r["generation"]["prompt"] for r in first["bench"]["artifacts"]} == {first["bench"]["artifacts"][0][
        "generation"]["prompt"]}
    samples = first["bench"]["samples"]  # #39 (13): each artifact against each peer, recomputed from the rounds
    for r in first["bench"]["artifacts"][:4]:
        for p in ("peer-ctranslate2-int8", "peer-onnxruntime-int8", "peer-openvino", "peer-llamacpp"):
            for w in peer_workloads():
                assert_ratio_from_samples(r["vs_peers"][p][w.key], samples[w.measure], p, r["tag"],
                                          w.higher_is_better)
    assert not list((tmp_path / "runs" / "tiny").glob(".tmp-peers-*"))  # the peers' folders are gone
    tags = tags[:4]
    composed = json.loads((tmp_path / "runs" / "tiny" / tags[-1] / "effkit.json").read_text())
    assert composed["parent"].endswith("prune-row-distill-r1") and composed["metrics"]["int8_layers_reloaded"] > 0
    rows = {r["tag"]: r for r in first["bench"]["artifacts"]}
    control = rows["prune-row-distill-r1"]["control_artifact"]  # the int8 form of a round is judged by its control
    assert "/controls/" in control and rows["prune-row-distill-r1+quantize-dynamic"]["control_artifact"] == control
    assert loss_verdict_matches_interval(rows["prune-row-distill-r1+quantize-dynamic"]["eval_loss_delta_vs_control"])
    losses, docs = first["bench"]["block_losses"], first["bench"]["block_docs"]
    for tag, r in rows.items():  # #39 (13): every loss delta to the dense model, recomputed from the blocks
        assert_delta_from_blocks(r["eval_loss_delta"], losses["train"], losses[tag], docs)
    assert "control_artifact" not in rows["quantize-dynamic"]
    # the seams refactor changed no report: every key path of a tiny run before it (tests/data, made by the
    # same recipe at commit 2a0791c) is still there; keys the generation work added are allowed
    before = json.loads((Path(__file__).parent / "data" / "report_keys_before_seams.json").read_text())
    from effkit.measure.hardware import no_native_bf16

    emulated = no_native_bf16()  # the code that decides whether bf16 runs on this CPU, asked as the run asked it
    probe = json.loads((tmp_path / "reports" / "tiny" / "train.json").read_text())["what_ran"]["amp_probe"]
    assert (probe.get("not_run") == f"bf16 not run: {emulated}") if emulated else "fp32_step_s" in probe
    for name, paths in before.items():
        now = set(key_paths(json.loads((tmp_path / name).read_text())))
        if emulated:  # neither the bf16 parent nor the amp probe's timings are run where bf16 is emulated
            paths = [p for p in paths if "bf16" not in p and ".amp_probe." not in p]
        assert set(paths) <= now, (name, sorted(set(paths) - now)[:5])
    ship = first["deliverable"]
    assert ship["tag"] in tags + [spec]
    assert ship["line"].startswith(f"deliver {ship['tag']} (chosen for decode-b1: ")
    assert_choice_from_samples(ship["choice"])  # #42 (1): the deliverable recomputed from the bench's rounds
    assert ship["best_pruned"]["picked"] == "prune-row-distill-r1"
    summary = (tmp_path / "reports" / "tiny" / "summary.md").read_text()
    assert ship["line"] in summary and "prune-row-distill-r1+quantize-dynamic" in summary
    eta = first["eta"]  # 4 steps: too few for the in-run estimate, so the training report's speed gives it
    assert eta["step_time_s"] > 0 and "training report" in eta["step_time_how"]
    assert set(eta["actual_s"]) == set(eta["predicted_s"]) == {"train", "prune row", "quantize train",
                                                               "quantize best-pruned", "bench"}
    assert json.loads((tmp_path / "reports" / "tiny" / "eta.json").read_text())["actual_s"] == eta["actual_s"]
    # what each step consulted as it ran, once per cache key, warm or filled now (with what filling it cost)
    assert set(eta["caches_used"]) <= set(eta["actual_s"]) and eta["wall_s"] >= sum(eta["actual_s"].values())
    assert all(("fill_s" in u) and (u["warm"] or u["fill_s"] >= 0) for us in eta["caches_used"].values() for u in us)
    assert "## Time on this machine: expected against actual" in summary
    strict = make_plan(str(recipe))
    strict.run = strict.run.replace(max_loss_increase=-1.0)  # no round can be 100% better than its control
    picked, table = best_pruned(strict)
    assert picked is None and table["rounds"] and not any(r["within_budget"] for r in table["rounds"])
    pruned = json.loads((tmp_path / "runs" / "tiny" / "prune-row-distill-r1" / "effkit.json").read_text())["metrics"]
    # judged against the model the user has (train), the control's share beside it
    assert table["rounds"][0]["loss_delta"] == pruned["eval_loss_delta_vs_dense"]["delta"]
    assert table["rounds"][0]["loss_delta_vs_control"] == pruned["eval_loss_delta_vs_control"]["delta"]
    second = run_pipeline(str(recipe))
    assert second["done"] == ["train (skipped)", "prune row (skipped)", "quantize train (skipped)",
                              "quantize best-pruned (prune-row-distill-r1) (skipped)", "bench (skipped)", "report"]
    stale_before = (tmp_path / "runs" / "tiny" / "quantize-dynamic" / "effkit.json").stat().st_mtime_ns
    recipe.write_text(recipe.read_text().replace('backend = "dynamic"\nlatency_repeats = 1',
                                                 'backend = "dynamic"\nlatency_repeats = 2'))
    # the quantize section alone changed: the fingerprints the run compares say it and what follows run again
    recorded = json.loads((tmp_path / "runs" / "tiny" / "pipeline.json").read_text())
    now = fingerprints(make_plan(str(recipe)))
    assert [k for k in ("train", "prune row", "quantize train", "quantize best-pruned", "bench")
            if now[k] != recorded[k]["fingerprint"]] == ["quantize train", "quantize best-pruned", "bench"]
    # the bench that runs again leaves the peers and the speculative artifact out (the first run benched them) and
    # has a quarter of its time (its deliverable's rounds): the run is shorter, the same steps
    recipe.write_text(recipe.read_text().replace("quick = true", "quick = true\npeers = false\nspeculative = false\n"
                                                                 "peer_share = 0.25"))
    changed = run_pipeline(str(recipe))
    assert changed["done"] == ["train (skipped)", "prune row (skipped)", "quantize train",
                               "quantize best-pruned (prune-row-distill-r1)", "bench", "report"]
    assert (tmp_path / "runs" / "tiny" / "quantize-dynamic" / "effkit.json").stat().st_mtime_ns != stale_before
    assert json.loads((tmp_path / "runs" / "tiny" / "quantize-dynamic" / "effkit.json").read_text())[
        "config"]["latency_repeats"] == 2
    only_train = recipe.read_text().replace('run_name = "tiny"', 'run_name = "tiny"\nstages = ["train"]')
    recipe.write_text(only_train)
    forced = run_pipeline(str(recipe), force=True)
    assert forced["done"] == ["train"]  # redone, although complete
    assert not (tmp_path / "runs" / "tiny" / "prune-row-distill-r1").exists()  # --force starts the run afresh


def test_the_expected_time_is_the_measured_step_time_times_each_stages_work_rescaled_as_stages_finish(
        tmp_path, corpus_dir):
    recipe = write_recipe(tmp_path, corpus_dir)  # the bench timed sequentially, within 20 s per measure
    recipe.write_text(recipe.read_text().replace("quick = true", "budget_s = 20"))
    plan = make_plan(str(recipe))
    budgets = stage_budgets(plan)  # prune and quantize run fixed rounds in this recipe
    assert budgets == {"prune row": 0.0, "quantize": 0.0, "bench": 6 * 20.0}
    printed = Console(file=__import__("io").StringIO(), width=400)
    eta = Eta(plan, printed)
    # warm-up steps of 3 s (left out), then steps of 0.5 s with one slow (evaluating) step among them
    times = iter([0.0] + [3.0 * i for i in range(1, 6)] + [15 + 0.5 * i for i in range(1, 30)])
    eta.clock = lambda: next(times)
    for step in range(1, 26):
        eta.on_train_step(step, 1.0)
    assert eta.step_s is None  # 20 steady steps are not yet seen
    eta.on_train_step(26, 1.0)
    assert eta.step_s == pytest.approx(0.5)
    work = stage_work(plan)
    # training at its step time; each measuring step at the seconds fitted for it x this machine's factor
    units = __import__("effkit.pipeline").pipeline.unit_seconds(plan, 0.5, eta.factor)
    assert units["train"] == 0.5 and eta.record()["seconds_per_unit"] == units
    assert eta.first == pytest.approx({k: units[k] * w + BUDGET_USED * budgets.get(k, 0) for k, w in work.items()})
    assert "one training step 0.500 s" in printed.file.getvalue()
    eta.finished("train", 100.0)
    eta.finished("prune row", 2 * eta.first["prune row"])  # twice as long as expected: what is left doubles
    assert eta.remaining(["quantize", "bench"]) == pytest.approx({"quantize": 2 * eta.first["quantize"],
                                                                  "bench": 2 * eta.first["bench"]})
    assert "prune row took" in printed.file.getvalue()


def _fake_bench(speeds: dict[str, list[float]], losses: dict[str, float], stages: dict[str, str] | None = None,
                sizes: dict[str, float] | None = None, seed: int = 0, spread: dict[str, float] | None = None) -> dict:
    """A bench report as the deliverable reads it: decode-b1 tokens/s per round (`speeds`: one figure a round,
    with 1% noise; a shorter list is an artifact that settled early; the deliverable's own rounds the same ones),
    per-block losses around 5.0 x (1 + the relative loss), each artifact's own per-block noise `spread` (default
    0.005), every artifact's ratios to the reference and to the peers from those samples."""
    import random

    from effkit.measure import stats

    rng = random.Random(seed)
    stages = stages or {}
    samples = {t: [[v * (1 + rng.gauss(0, 0.01))] for v in rounds] for t, rounds in speeds.items()}
    noise = [rng.gauss(0, 0.05) for _ in range(64)]
    blocks = {t: [5.0 * (1 + d) + e + rng.gauss(0, (spread or {}).get(t, 0.005)) for e in noise]
              for t, d in losses.items()}
    docs = [i // 4 for i in range(64)]
    level = 1 - 0.05 / 3
    ref = next(iter(speeds))
    peers = [t for t in speeds if stages.get(t) == "peer"]

    def ratio(a, b):
        n = min(len(samples[a]), len(samples[b]))
        return stats.paired_ratio(samples[a][:n], samples[b][:n], True, level=level)

    rows = []
    for t in speeds:
        rows.append({"tag": t, "stage": stages.get(t, "quantize" if t != ref else "train"), "artifact": f"/runs/x/{t}",
                     "size_ratio": (sizes or {}).get(t, 1.0 if t == ref else 0.5),
                     "eval_loss_delta": stats.paired_delta(blocks[ref], blocks[t], docs),
                     "decode_ratio_b1": ratio(ref, t),
                     "vs_peers": {p: {"decode_b1": ratio(p, t)} for p in peers}})
    # the deliverable's own rounds: its contenders, and the fastest peer as their reference
    fastest = max(peers, key=lambda p: sorted(speeds[p])[len(speeds[p]) // 2], default=None)
    ours = {t: s for t, s in samples.items() if stages.get(t) != "peer" or t == fastest}
    against = {"peer": fastest, "reference": {t: ratio(fastest, t) for t in ours if t != fastest}} if fastest else {}
    return {"artifacts": rows, "samples": {"decode_b1": samples}, "block_losses": blocks, "block_docs": docs,
            "stopping": {"decode_b1": {"level": level, "precision": 0.03, "rounds": 24}},
            "deliverable_rounds": {"workload": "decode-b1", "samples": ours,
                                   "record": {"level": level, "precision": 0.03, "looks": 3, "stopped": "decided"},
                                   **against}}


def test_the_deliverable_is_measured_in_its_own_rounds_with_a_budget_for_each_open_contender():
    """The deliverable's decision gets its own paired, interleaved rounds among its contenders (fake clock, the
    tests' noise model): three equal contenders and a per-measure budget too small for a second look. Each one open
    against the leader adds `contest_budget_s`, as every decision's head to head, so its rounds run later looks where
    the bench's own measure stops at the first; the deliverable's record carries those rounds and every sample."""
    import random
    from types import SimpleNamespace

    from effkit.bench.timing import deliverable_rounds
    from effkit.config import BenchMeasure
    from effkit.measure import stats, stopping

    now, rng = [0.0], random.Random(5)

    def contender():
        def call() -> float:
            took = 0.05 * rng.lognormvariate(0, 0.05)
            now[0] += took
            return 8 / took  # tokens/s of a decode of 8 new tokens
        return call
    stop = stopping.Stopping(rounds=6, budget_s=1.0, looks=3)
    rounds = deliverable_rounds({n: contender() for n in ("train", "a", "b", "peer-x", "peer-y")},
                                ("decode-b1", ["train", "a", "b"]), stop, BenchMeasure().contest_budget_s,
                                peer="peer-x", clock=lambda: now[0], sleep=lambda s: None)
    # the fastest peer is timed in the screen's rounds as the reference, every contender set against it; no other
    assert set(rounds["samples"]) == {"train", "a", "b", "peer-x"} and rounds["workload"] == "decode-b1"
    assert rounds["peer"] == "peer-x" and set(rounds["reference"]) == {"train", "a", "b"}
    assert rounds["record"]["looks"] > 1, rounds["record"]  # the head to head ran on its budget per open contender
    assert max(len(s) for s in rounds["samples"].values()) > 6
    alone = stopping.measure({n: contender() for n in "abc"}, stop, 1, pairs=[("a", "b")], clock=lambda: now[0])
    assert alone.record["looks"] == 1 and alone.record["stopped"] == "budget", alone.record  # the bench's measure
    bench = _fake_bench({t: [100.0] * 24 for t in ("train", "a", "b")}, {"train": 0.0, "a": 0.001, "b": 0.001})
    bench["deliverable_rounds"] = rounds
    plan = SimpleNamespace(run=SimpleNamespace(pipeline=SimpleNamespace(max_loss_increase=0.02,
                                                                        optimize_for="decode-b1")))
    ship = deliverable(plan, bench)
    ours = {t: s for t, s in rounds["samples"].items() if t != "peer-x"}  # the peer is never a candidate
    assert ship["choice"]["samples"] == ours and ship["tag"] != "peer-x"
    assert ship["choice"]["record"]["looks"] == rounds["record"]["looks"]
    assert ship["choice"]["record"]["rounds"] == {t: len(s) for t, s in ours.items()}
    assert_choice_from_samples(ship["choice"])
    against = ship["vs_fastest_peer"]  # what ships against the fastest peer, over the screen's rounds
    n = len(rounds["samples"]["peer-x"])
    assert against["peer"] == "peer-x" and against["ratio"] == rounds["reference"][ship["tag"]] == stats.paired_ratio(
        rounds["samples"]["peer-x"], rounds["samples"][ship["tag"]][:n], True, level=against["ratio"]["ci_level"])
    assert "vs the fastest peer peer-x: " in ship["line"]
    del bench["deliverable_rounds"]  # a bench report without them: bench again, never the bench's own samples
    with pytest.raises(EffkitError, match="no rounds of the deliverable's own"):
        deliverable(plan, bench)


@pytest.mark.slow
def test_loss_ships_only_where_it_buys_a_decided_speed_up(tmp_path, corpus_dir):
    """A lossy leader (+0.8%, within the run's budget) still undecided against the best lossless artifact (within
    +0.2%) leaves the lossless one in place; decided faster than it, the lossy one ships."""
    plan = make_plan(str(write_recipe(tmp_path, corpus_dir, extra_run="max_loss_increase = 0.02")))
    ref, noisy = [100.0] * 6, [130.0, 260.0, 120.0, 250.0, 125.0, 270.0]  # 1.5x by point estimate, rounds apart
    bench = _fake_bench({"train": ref, "lossless": [150.0] * 6, "lossy": [v * 150 / 100 for v in noisy]},
                        {"train": 0.0, "lossless": 0.0, "lossy": 0.008})
    ship = deliverable(plan, bench)
    assert ship["lossless"]["tag"] == "lossless" and ship["tag"] == "lossless"
    assert ship["verdict"] == "undecided: kept the default" and "kept the default" in ship["line"]
    assert ship["choice"]["leader"] == "lossy" and ship["choice"]["ratios"]["lossy"]["verdict"] == "same"
    bench = _fake_bench({"train": ref, "lossless": [150.0] * 6, "lossy": [300.0] * 6},
                        {"train": 0.0, "lossless": 0.0, "lossy": 0.008})
    ship = deliverable(plan, bench)
    assert ship["tag"] == "lossy" and ship["verdict"] == "decided" and ship["lossless"]["tag"] == "lossless"


def test_the_deliverable_is_chosen_pairwise_within_the_budget_by_the_decision_rule(tmp_path, corpus_dir):
    """#42 (1): the deliverable took the largest point estimate of each artifact's ratio to the reference, with no
    comparison between the candidates, across ratios that ran 6 and 24 rounds. Here `early` looked 1.30x the
    reference over its 6 rounds, `late` 1.25x over 24, but in the 6 rounds both ran `late` was decided faster."""
    plan = make_plan(str(write_recipe(tmp_path, corpus_dir, extra_run="max_loss_increase = 0.02")))
    ref = [100.0] * 24
    bench = _fake_bench({"train": ref, "early": [130.0] * 6, "late": [140.0] * 6 + [120.0] * 18},
                        {"train": 0.0, "early": 0.001, "late": 0.001})
    ship = deliverable(plan, bench)
    assert ship["tag"] == "late" and ship["verdict"] == "decided"
    assert ship["choice"]["ratios"]["early"]["verdict"] == "slower"
    assert_choice_from_samples(ship["choice"])
    # within the budget means the interval's upper end: a point estimate of +1.9% whose interval reaches past 2%
    # is out (it was in)
    bench = _fake_bench({"train": ref, "fast": [300.0] * 24, "ok": [150.0] * 24},
                        {"train": 0.0, "fast": 0.018, "ok": 0.001}, spread={"fast": 0.06})
    fast = bench["artifacts"][1]["eval_loss_delta"]
    assert fast["ci95"][1] > 0.02 > fast["delta"]
    assert deliverable(plan, bench)["tag"] == "ok"
    # a peer decided faster than the delivered artifact is named in its line; the lossless one is judged too
    bench = _fake_bench({"train": ref, "q": [150.0] * 24, "peer-x": [200.0] * 24}, {"train": 0.0, "q": 0.0005,
                        "peer-x": 0.0}, stages={"peer-x": "peer"})
    ship = deliverable(plan, bench)
    assert ship["tag"] == "q" and ship["lossless"]["tag"] == "q"
    assert set(ship["beaten_by_peers"]["delivered"]) == {"peer-x"} and "NOTE: the delivered artifact q is slower" \
        in ship["line"]
    # a peer that runs the delivered artifact's very computation (one digest) is never "faster": that is noise
    bench["artifacts"][1]["same_computation_as"] = ["peer-x"]
    ship = deliverable(plan, bench)
    assert ship["beaten_by_peers"]["delivered"] == {} and "NOTE" not in ship["line"]
    assert "vs peer-x (the same computation: the protocol's A/A check)" in ship["line"]
    # a tie within the precision goes to the smaller; an undecided leader is labelled a point estimate
    bench = _fake_bench({"train": ref, "big": [150.0] * 24, "small": [150.0] * 24},
                        {"train": 0.0, "big": 0.001, "small": 0.001}, sizes={"big": 0.6, "small": 0.3})
    ship = deliverable(plan, bench)
    assert ship["tag"] == "small" and ship["verdict"].startswith("tie")
    noisy = _fake_bench({"train": ref, "a": [150.0, 100.0] * 3, "b": [100.0, 155.0] * 3},
                        {"train": 0.0, "a": 0.001, "b": 0.001})
    ship = deliverable(plan, noisy)
    assert ship["verdict"] == "undecided: chosen by point estimate" and "point estimate" in ship["line"]
    nan = _fake_bench({"train": ref, "nan": [500.0] * 24}, {"train": 0.0, "nan": 0.0})  # never delivered
    nan["artifacts"][1]["invalid"] = "non-finite held-out loss"
    assert deliverable(plan, nan)["tag"] == "train"


@pytest.mark.slow
def test_a_run_killed_during_prune_resumes_and_completes(tmp_path, corpus_dir):
    recipe = write_recipe(tmp_path, corpus_dir, prune_rounds=2, finetune=20, latency_rounds=2, latency_repeats=1,
                          extra_run='stages = ["train", "prune"]')  # the fewest latency rounds: not what is tested
    proc = subprocess.Popen([sys.executable, "-m", "effkit", "run", str(recipe)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    marker = tmp_path / "runs" / "tiny" / "prune-row-distill-r1" / "effkit.json"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert not (tmp_path / "reports" / "tiny" / "prune-row-distill.json").exists()  # killed before the stage finished
    result = run_pipeline(str(recipe))
    assert result["done"] == ["train (skipped)", "prune row"]
    assert (tmp_path / "runs" / "tiny" / "prune-row-distill-r2" / "effkit.json").is_file()
    assert not list((tmp_path / "runs" / "tiny").glob(".tmp-*"))


@pytest.mark.parametrize("change, needle", [
    ('stages = ["train", "bench", "prune"]', "impossible order"),
    ('stages = ["train", "distill"]', "unknown stage 'distill'"),
    ('prune_modes = ["heads"]', "unknown prune mode 'heads'"),
    ('quantize_from = "prune-row-r7"', "is not an artifact this recipe makes"),
    ('quantize_from = ["train", 3]', "quantize_from must be a tag or a list of tags"),
    ("max_loss_increase = -0.1", "max-loss-increase must be a finite number >= 0"),
    ("time_budget_min = -5", "time-budget-min must be a finite number >= 0"),
    ("flavour = 1", "unknown key 'flavour' in [run]"),
    ("= broken", "is not valid TOML"),
])
def test_malformed_recipe_is_refused_before_anything_runs(change, needle, tmp_path, corpus_dir, capsys,
                                                          monkeypatch):
    recipe = write_recipe(tmp_path, corpus_dir, extra_run=change)
    monkeypatch.setattr(sys, "argv", ["effkit", "run", str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert str(recipe) in err
    assert not (tmp_path / "runs").exists()


def test_missing_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", "run", str(tmp_path / "nope.toml")])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2 and "not found" in capsys.readouterr().err


def test_dry_run_shows_the_plan_and_the_launch_command(tmp_path, corpus_dir, capsys, monkeypatch):
    recipe = write_recipe(tmp_path, corpus_dir)
    text = recipe.read_text().replace('model = "gpt2-nano"', 'model = "gpt2-nano"\nparallel = "fsdp"\nnproc = 2')
    recipe.write_text(text)
    monkeypatch.setattr(sys, "argv", ["effkit", "run", "--dry-run", str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr()
    assert exc.value.code in (0, None), out.err
    assert "accelerate.commands.launch --num_processes 2" in out.out and "ACCELERATE_USE_CPU=1" in out.out
    assert "prune row" in out.out and "bench" in out.out
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_runs_bench_times_the_round_of_each_mode_a_user_would_look_at(tmp_path, corpus_dir):
    """#46: the run's bench re-timed every pruning round the prune stage had already judged. It now times each
    mode's most compressed round within the budget (by the upper end of the loss interval), or the least damaged
    where none is, and says where the others' figures are."""
    from effkit import artifacts
    from effkit.bench.stage import other_rounds
    from effkit.stage import best_of_each_mode

    plan = make_plan(str(write_recipe(tmp_path, corpus_dir, prune_rounds=2,
                                      extra_run='prune_modes = ["row", "depth"]\nmax_loss_increase = 0.02')))
    losses = {"row": [(0.005, 0.012), (0.015, 0.025)], "depth": [(0.03, 0.04), (0.05, 0.06)]}
    for cfg in plan.prune.values():
        for r in (1, 2):
            d = plan.layout.artifact(artifacts.prune_tag(cfg.label, r))
            d.mkdir(parents=True)
            (d / "weights").write_bytes(b"x" * (1000 // r))  # round 2 is smaller
            delta, hi = losses[cfg.method.mode][r - 1]
            (d / artifacts.META).write_text(json.dumps({"stage": "prune", "metrics": {
                "eval_loss_delta_vs_dense": {"delta": delta, "ci95": [delta - 0.005, hi], "verdict": "worse"},
                "latency_b12": {"p50_s": 0.01}}}))
    labels = {c.method.mode: c.label for c in plan.prune.values()}
    tag = lambda mode, r: artifacts.prune_tag(labels[mode], r)  # noqa: E731
    # row r2's point estimate (+1.5%) is within 2% but its interval's upper end (+2.5%) is not: r1 it is; no
    # depth round is within the budget: its least damaged round
    assert best_of_each_mode(plan) == {labels["row"]: tag("row", 1), labels["depth"]: tag("depth", 1)}
    left = other_rounds(plan)
    assert set(left) == {tag("row", 2), tag("depth", 2)}
    assert str(plan.report_dir / f"prune-{labels['row']}.json") in left[tag("row", 2)]


# ------------------------------------------------------------------------------------------ the time budget (#46)
def budget_recipe(tmp_path, corpus_dir, budget_min: float):
    """A training-only tiny recipe of 100 steps with a time budget (fp32: no precision probe)."""
    recipe = write_recipe(tmp_path, corpus_dir, extra_run=f'stages = ["train"]\ntime_budget_min = {budget_min}\n'
                                                           'full_schedule_result = "1.234 bits per byte (docs/x.md)"')
    recipe.write_text(recipe.read_text().replace("max_steps = 4\nwarmup_steps = 1",
                                                 "max_steps = 100\nwarmup_steps = 5\namp = false"))
    return recipe


def fake_probe(monkeypatch, seconds: float | None):
    """The training step time measured before training: `seconds` (and counted), or a failure if asked for."""
    from effkit.train import TrainStage

    calls = []

    def probe(self, plan):
        if seconds is None:
            raise AssertionError("the step time was measured again")
        calls.append(plan.train.optim.max_steps)
        return seconds, "a fake probe"

    monkeypatch.setattr(TrainStage, "probe_step_time", probe)
    monkeypatch.setitem(costs(), "train_setup", 0.0)  # the quickstart's set-up weight would swamp a 30 s budget
    monkeypatch.setattr("effkit.pipeline.OUTSIDE_S", 0.0)  # and so would its seconds outside the stages
    return calls


def test_the_time_budget_fits_the_steps_by_the_estimates_model():
    from effkit.pipeline import choose_steps, step_grain

    assert [step_grain(n) for n in (4, 40, 200, 1500, 20000)] == [1, 1, 5, 50, 500]
    total = lambda n: 60 + 0.5 * n  # noqa: E731 - a run of 60 s besides training, 0.5 s a step
    assert choose_steps(1500, 300, total, 900) == 1500  # 810 s: within the budget
    assert choose_steps(1500, 300, total, 600) == 1050  # 1,080 fit: the multiple of 50 below
    assert choose_steps(1500, 300, total, 100) == 300  # none fits: the fewest allowed
    assert choose_steps(1500, 301, total, 100) == 350  # the fewest rounded up to the grain
    assert choose_steps(4, 1, total, 61.6) == 3


def test_the_budgets_prediction_is_the_estimate_the_run_prints(tmp_path, corpus_dir):
    from effkit.pipeline import predicted_total, shared, step_timer

    plan = make_plan(str(write_recipe(tmp_path, corpus_dir)))
    plan.run = plan.run.replace(time_budget_min=1.0)
    timer = step_timer(plan)
    total = predicted_total(plan, timer, 3, 0.25)
    assert plan.train.optim.max_steps == 4  # predicted on a copy
    plan.configs = shared(plan, timer, 3)[0].configs  # what the run then runs (`apply_decision`): its shares too
    eta = Eta(plan, Console(file=__import__("io").StringIO()))
    eta.set_step_time(0.25, "a test")
    assert total == pytest.approx(sum(eta.first.values())) and eta.work["train"] < stage_work(
        make_plan(str(tmp_path / "tiny.toml")))["train"]


@pytest.mark.slow
def test_a_time_budget_trains_fewer_steps_chosen_once_and_kept_on_resume(tmp_path, corpus_dir, monkeypatch):
    import io

    recipe = budget_recipe(tmp_path, corpus_dir, 0.5)  # 30 s; 0.5 s a step: 59 steps fit, 55 in steps of 5
    calls = fake_probe(monkeypatch, 0.5)
    printed = Console(file=io.StringIO(), width=400)
    first = run_pipeline(str(recipe), console=printed)
    said = printed.file.getvalue()
    assert calls == [100] and first["done"] == ["train"]
    assert ("time budget 0.5 min: one training step 0.500 s (a fake probe); the recipe's 100 steps predict 0.8 min in "
            "all; training 55 steps instead (predicted 0.5 min); `effkit run --full` trains all 100") in said
    run, reports = tmp_path / "runs" / "tiny", tmp_path / "reports" / "tiny"
    record = json.loads((run / "pipeline.json").read_text())
    decision = record["time_budget"]
    assert (decision["steps"], decision["recipe_steps"], decision["budget_min"], decision["step_time_s"]) == \
        (55, 100, 0.5, 0.5)
    report = json.loads((reports / "train.json").read_text())
    assert report["metrics"]["steps"] == 55 and report["config"]["optim"]["max_steps"] == 55  # the schedule's end
    assert report["schedule"]["steps"] == 55 and report["schedule"]["full_schedule_result"].startswith("1.234")
    assert report["schedule"]["shares"] == {"train": {"share": 0.55, "training_steps": 55}}  # no measuring stage
    assert report["schedule"]["what_it_costs"].startswith("55 of the recipe's 100 training steps reached ")
    assert "the full schedule: 1.234 bits per byte" in report["schedule"]["what_it_costs"]
    # the warm-up (5 steps) ends before training's own steps are timed (the first 5 are left out): no re-fit, said
    assert report["schedule"]["refit"].startswith("not re-fitted: the warm-up (5 steps) ended")
    assert first["eta"]["time_budget"]["steps"] == 55 and first["eta"]["work_in_steps"]["train"] < 56
    bpb = report["metrics"]["bits_per_byte"]
    line = (f"trained 55 of 100 steps (time budget 0.5 min: one step predicted at 0.500 s before training, the "
            f"recipe's steps predicted 0.8 min for the whole run): {bpb:.3f} bits per byte on the held-out blocks; "
            "the recipe's full 100 steps: 1.234 bits per byte (docs/x.md); `effkit run --full` trains all 100")
    assert first["schedule"] == line and line[1:] in (reports / "summary.md").read_text()
    fingerprint = record["train"]["fingerprint"]

    fake_probe(monkeypatch, None)  # from now on, measuring again fails the test
    printed = Console(file=io.StringIO(), width=400)
    again = run_pipeline(str(recipe), console=printed)
    assert again["done"] == ["train (skipped)"] and again["schedule"] == line
    assert "training 55 of the recipe's 100 steps, as decided when this run started" in printed.file.getvalue()
    import shutil

    shutil.rmtree(run / "train")  # an interrupted training: it runs again with the steps chosen at the start
    resumed = run_pipeline(str(recipe), console=Console(file=io.StringIO()))
    assert resumed["done"] == ["train"]
    assert json.loads((reports / "train.json").read_text())["metrics"]["steps"] == 55
    assert json.loads((run / "pipeline.json").read_text())["train"]["fingerprint"] == fingerprint


@pytest.mark.slow
def test_full_trains_the_recipes_schedule_and_a_later_budgeted_run_keeps_it(tmp_path, corpus_dir, monkeypatch,
                                                                            capsys):
    import io

    recipe = budget_recipe(tmp_path, corpus_dir, 0.5)
    fake_probe(monkeypatch, None)  # --full measures nothing
    monkeypatch.setattr(sys, "argv", ["effkit", "run", "--full", str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "reports" / "tiny" / "train.json").read_text())
    assert report["metrics"]["steps"] == 100 and "schedule" not in report
    printed = Console(file=io.StringIO(), width=400)
    later = run_pipeline(str(recipe), console=printed)  # the budget again: the full training is complete, kept
    assert later["done"] == ["train (skipped)"]
    assert "the training is already complete with all 100 steps of the recipe: kept" in printed.file.getvalue()
    assert json.loads((tmp_path / "runs" / "tiny" / "pipeline.json").read_text())["time_budget"]["steps"] == 100


def test_the_budgets_decision_is_recorded_and_a_new_invocation_reuses_it_without_measuring(tmp_path, corpus_dir,
                                                                                            monkeypatch):
    """What a resumed `effkit run` sees before training: the recorded count, the same fingerprints, no probe."""
    import io

    from effkit import artifacts
    from effkit.pipeline import RECORD, StageRecord, fingerprints, fit_time_budget

    recipe = budget_recipe(tmp_path, corpus_dir, 0.5)
    quiet = Console(file=io.StringIO(), width=400)
    fake_probe(monkeypatch, 0.5)
    plan = make_plan(str(recipe))
    with artifacts.run_lock(plan.run_dir):
        decided = fit_time_budget(plan, StageRecord(plan, quiet), quiet)
        assert decided["steps"] == plan.train.optim.max_steps == 55 and plan.schedule is decided
        fp = fingerprints(plan)
        assert json.loads((plan.run_dir / RECORD).read_text())["time_budget"]["steps"] == 55
        fake_probe(monkeypatch, None)
        again = make_plan(str(recipe))
        record = StageRecord(again, quiet)
        assert fit_time_budget(again, record, quiet)["steps"] == again.train.optim.max_steps == 55
        assert record.now == fingerprints(again) == fp
        doubled = make_plan(str(recipe), {"time_budget_min": 1.0})  # another budget: decided again
        fake_probe(monkeypatch, 0.5)
        assert fit_time_budget(doubled, StageRecord(doubled, quiet), quiet)["steps"] == 100


def test_no_budget_keeps_the_recipes_steps_and_measures_nothing(tmp_path, corpus_dir, monkeypatch):
    plan = make_plan(str(budget_recipe(tmp_path, corpus_dir, 0)))
    from effkit.pipeline import StageRecord, fit_time_budget

    fake_probe(monkeypatch, None)
    with __import__("effkit").artifacts.run_lock(plan.run_dir):
        assert fit_time_budget(plan, StageRecord(plan, Console(file=__import__("io").StringIO())), None) is None
    assert plan.train.optim.max_steps == 100 and plan.schedule is None


def test_a_probe_made_slow_by_a_busy_moment_is_corrected_by_the_refit_from_trainings_own_steps(tmp_path, corpus_dir,
                                                                                                  monkeypatch):
    """The step time predicted before training is three times training's own (a busy moment): the floor is chosen;
    training's first steps (a fake clock: 0.5 s each) re-fit the decision once, during the warm-up, to the recipe's
    full schedule; both figures and the disagreement are recorded, and the fingerprints follow. The next run of the
    recipe here (a fresh clone) whose prediction is the same figure (cached) predicts with training's own instead;
    another figure (measured again) is used as it is."""
    import io
    from functools import partial

    from effkit import artifacts
    from effkit.pipeline import RECORD, StageRecord, fingerprints, fit_time_budget, refit_time_budget

    recipe = budget_recipe(tmp_path, corpus_dir, 1.0)  # 60 s: 100 steps of 0.5 s fit, 35 of 1.5 s
    recipe.write_text(recipe.read_text().replace("warmup_steps = 5", "warmup_steps = 30"))
    quiet = Console(file=io.StringIO(), width=400)
    fake_probe(monkeypatch, 1.5)
    plan = make_plan(str(recipe))
    with artifacts.run_lock(plan.run_dir):
        record = StageRecord(plan, quiet)
        decided = fit_time_budget(plan, record, quiet)
        assert decided["steps"] == plan.train.optim.max_steps == 35 and decided["share"] == 0.35
        eta = Eta(plan, quiet)
        eta.refit = partial(refit_time_budget, plan, record, quiet)
        times = iter([0.5 * i for i in range(40)])
        eta.clock = lambda: next(times)
        assert [eta.on_train_step(step, 1.0) for step in range(1, 26)] == [None] * 25
        assert eta.on_train_step(26, 1.0) == 100  # 20 steady steps, within the warm-up of 30: re-fitted once
        assert eta.on_train_step(27, 1.0) is None and eta.refit is None
    d = plan.schedule
    assert plan.train.optim.max_steps == 100 and d["steps"] == 100 and d["share"] == 1.0
    assert (d["step_time_s"], d["training_step_time_s"], d["probe_over_training"]) == pytest.approx((1.5, 0.5, 3.0))
    assert d["probe_disagrees"] and d["probe_tolerance"] == 0.25
    assert d["refit"]["at_step"] == 26 and d["refit"]["steps_before"] == 35 and d["refit"]["fits"]
    assert json.loads((plan.run_dir / RECORD).read_text())["time_budget"]["refit"]["steps"] == 100
    assert record.now == fingerprints(plan) and eta.work["train"] > 100  # the estimate counts the steps trained now
    assert eta.step_s == pytest.approx(0.5) and "re-fitted from training's own steps" in quiet.file.getvalue()

    for probe, used in ((1.5, 0.5), (1.2, 1.2)):
        (plan.run_dir / RECORD).unlink()  # a fresh clone: nothing decided yet
        fake_probe(monkeypatch, probe)
        again = make_plan(str(recipe))
        decided = fit_time_budget(again, StageRecord(again, quiet), quiet)
        assert (decided["step_time_s"], decided["probe_step_time_s"]) == pytest.approx((used, probe))
        assert (decided["steps"] == 100) == (used == 0.5)


def test_the_trainer_retargets_its_schedule_only_during_the_warm_up(tiny_cfg):
    from effkit.errors import EffkitError
    from effkit.parallel import init_runtime
    from effkit.train import Trainer, lr_lambda

    tr = Trainer(tiny_cfg(max_steps=6, warmup_steps=3), init_runtime(), progress=False)
    tr.train_step()
    tr.step = 1
    tr.retarget(10)  # the cosine is the one a 10-step run follows from its start: the warm-up's rates are the same
    assert tr.horizon == tr.cfg.optim.max_steps == 10
    assert len(tr.scheduler.lr_lambdas) == len(tr.optimizer.param_groups) > 1  # one per group (decayed or not)
    for f in tr.scheduler.lr_lambdas:
        assert [f(k) for k in range(10)] == [lr_lambda(tr.cfg.optim, 10)(k) for k in range(10)]
    tr.train_step()  # the scheduler steps every group on the new schedule
    tr.step = 4
    with pytest.raises(EffkitError, match="only during the warm-up"):
        tr.retarget(8)


def test_a_budget_too_small_for_the_floors_is_refused_before_training_in_one_line(tmp_path, corpus_dir, capsys,
                                                                                   monkeypatch):
    """A budget typed on the command line is refused where even the floors are predicted over it."""
    recipe = budget_recipe(tmp_path, corpus_dir, 0.5)
    fake_probe(monkeypatch, 0.5)  # 6 s budget; the floor, 20 steps of 0.5 s, takes 10
    monkeypatch.setattr(sys, "argv", ["effkit", "run", str(recipe), "--time-budget-min", "0.1"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "time budget 0.1 min is too short" in err and "20 of the recipe's 100 training steps" in err
    assert "--time-budget-min 1 would fit them" in err and "effkit run --full" in err
    assert not (tmp_path / "runs" / "tiny").exists() and not (tmp_path / "reports").exists()


def test_the_recipes_own_budget_over_at_the_floors_is_said_before_training_and_the_run_goes_on(tmp_path, corpus_dir,
                                                                                               monkeypatch):
    """The recipe's budget is a target (README command 1 on a slow CPU): predicted over at the floors, the run says so
    in one line before training, trains the floors and records why."""
    import io

    from effkit import artifacts
    from effkit.pipeline import StageRecord, fit_time_budget

    recipe = budget_recipe(tmp_path, corpus_dir, 0.1)
    fake_probe(monkeypatch, 0.5)
    plan = make_plan(str(recipe))
    out = io.StringIO()
    said = Console(file=out, width=400)
    with artifacts.run_lock(plan.run_dir):
        d = fit_time_budget(plan, StageRecord(plan, said), said)
    assert d["steps"] == 20 and not d["fits"] and "--time-budget-min 1 would fit them" in d["over_budget"]
    lines = [line for line in out.getvalue().splitlines() if "too short" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: time budget 0.1 min is too short")
    assert "running at the floors" in lines[0]


def test_the_share_given_to_each_stage_is_recorded_in_the_runs_report(tmp_path, corpus_dir, monkeypatch):
    """A budget between the floors and the full run: training and every measuring stage get the same share, down to
    their floors; pipeline.json, the estimate (eta.json) and the plan the stages run carry it."""
    import io

    from effkit import artifacts, pipeline
    from effkit.bench.stage import peers_at_share
    from effkit.pipeline import BUDGET_MARGIN, RECORD, StageRecord, fit_time_budget, predicted_total, step_timer

    recipe = write_recipe(tmp_path, corpus_dir, finetune=10)
    recipe.write_text(recipe.read_text().replace("max_steps = 4\nwarmup_steps = 1", "max_steps = 100\nwarmup_steps = 5")
                      .replace("quick = true", "rounds = 6\nbudget_s = 20"))
    fake_probe(monkeypatch, 0.05)
    plan = make_plan(str(recipe))
    timer = step_timer(plan)
    middle = (predicted_total(plan, timer, 50, 0.05) + 1) / 60 / (1 - BUDGET_MARGIN)  # 50 steps fit, 55 do not
    plan.run = plan.run.replace(time_budget_min=middle)
    quiet = Console(file=io.StringIO(), width=400)
    with artifacts.run_lock(plan.run_dir):
        d = fit_time_budget(plan, StageRecord(plan, quiet), quiet)
    assert d["steps"] == 50 and d["share"] == 0.5 and set(d["shares"]) == {"train", "prune", "quantize", "bench"}
    assert all(v["share"] == 0.5 for v in d["shares"].values()) and d["shares"]["train"]["training_steps"] == 50
    assert d["shares"]["prune"]["row"]["finetune_steps"] == plan.prune["row"].finetune.finetune_steps == 5
    bench = d["shares"]["bench"]
    assert {k: bench[k] for k in ("share", "rounds", "budget_s")} == {"share": 0.5, "rounds": 3, "budget_s": 10.0}
    assert plan.bench.measure.rounds == 3 and plan.bench.what.peer_share == 0.5
    assert (bench["peers"], bench["not_run"]) == peers_at_share(plan.bench)  # the peers it makes, and those it lists
    assert d["shares"]["quantize"]["budget_s"] == plan.quantize.measure.budget_s
    assert set(d["stage_s"]) == {"train", "prune row", "quantize", "bench"}
    assert sum(d["stage_s"].values()) + pipeline.OUTSIDE_S == pytest.approx(d["predicted_s"])
    assert json.loads((plan.run_dir / RECORD).read_text())["time_budget"]["shares"] == d["shares"]
    eta = Eta(plan, quiet)
    eta.set_step_time(0.05, "a test")
    assert eta.record()["time_budget"]["shares"] == d["shares"] and eta.first == pytest.approx(d["stage_s"])


@pytest.mark.parametrize("args, needle", [
    (["--time-budget-min", "-1"], "--time-budget-min must be a finite number >= 0 (got -1.0)"),
    (["--time-budget-min", "5", "--full"], "--full trains the recipe's full schedule; drop --time-budget-min"),
])
def test_a_bad_time_budget_is_one_line(args, needle, tmp_path, corpus_dir, capsys, monkeypatch):
    recipe = budget_recipe(tmp_path, corpus_dir, 0.5)
    monkeypatch.setattr(sys, "argv", ["effkit", "run", *args, str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "runs").exists()


def test_the_budget_and_train_plan_share_one_step_time_predictor(tiny_cfg, tmp_path, corpus_dir):
    from effkit import memplan
    from effkit.train import TrainStage

    seconds, how = memplan.step_time(tiny_cfg())
    assert seconds > 0 and "as `effkit train --plan` predicts it" in how and ", fp32," in how
    assert f"from {memplan.STEP_ROUNDS} steps" in how
    assert memplan.predict(tiny_cfg(), probe=True).step_s == seconds  # the figure `train --plan` prints (cached)
    assert memplan.step_time(tiny_cfg(parallel="ddp"))[0] is None
    plan = make_plan(str(budget_recipe(tmp_path, corpus_dir, 0.5)))
    assert TrainStage().probe_step_time(plan) == memplan.step_time(plan.train)  # what the time budget is fitted with


def test_the_step_time_for_amp_auto_is_priced_in_the_precision_auto_trains_in(tiny_cfg, monkeypatch):
    """A CPU where `--amp auto` picks bf16 autocast (its own paired measurement, cached) trains in bf16: the budget's
    step is probed in bf16 there, and in fp32 where auto keeps fp32; the choice is read as training reads it."""
    from types import SimpleNamespace

    from effkit import memplan
    from effkit.measure import precision

    probed, asked = [], []
    monkeypatch.setattr(memplan, "predict", lambda cfg, probe: probed.append(cfg.optim) or SimpleNamespace(step_s=0.1))
    for picked in ("bf16", "fp32"):
        monkeypatch.setattr(precision, "cpu_choice", lambda config, batch, block, p=picked: asked.append(
            (config.n_layer, batch, block)) or {"picked": p})
        seconds, how = memplan.step_time(tiny_cfg(amp=None))
        assert seconds == 0.1 and f", {picked} (--amp auto's choice on this CPU)," in how
    assert (probed[0].amp, probed[0].amp_dtype) == (True, "bf16") and probed[1].amp is False
    cfg = tiny_cfg(amp=None)
    assert asked == [(memplan._model_config(cfg).n_layer, cfg.optim.batch_size, cfg.data.block_size)] * 2
    memplan.step_time(tiny_cfg(amp=False))
    assert probed[-1].amp is False and len(asked) == 2  # asked for fp32: nothing to choose


def test_run_plan_plans_every_stage_from_shapes_and_prices_the_run_as_the_run_does(tmp_path, corpus_dir, capsys,
                                                                                    monkeypatch):
    """#47: `effkit run --plan` gives each stage's memory plan before anything runs (the later stages' from
    shape-only artifacts in a temporary folder: a safetensors header over a hole), and the run's time by the model
    `effkit run` fits its budget with; it writes nothing in the run's folders."""
    from effkit import pipeline
    from effkit.artifacts import shape_only
    from effkit.bench.plan import weights_of
    from effkit.model import build_model
    from effkit.model.gpt2 import save_model
    from effkit.runplan import run_plan

    model = build_model("gpt2-nano", vocab_size=512)  # a shape-only artifact reads as the saved model does
    save_model(model, tmp_path / "real")
    fake = shape_only(tmp_path / "shape", model.config, {"block_size": 32})
    assert weights_of(fake)[0] == weights_of(tmp_path / "real")[0] == 4 * model.num_parameters()
    assert fake.joinpath("model.safetensors").stat().st_blocks * 512 < weights_of(fake)[0]  # a hole, not weights

    recipe = write_recipe(tmp_path, corpus_dir)
    fake_probe(monkeypatch, 0.05)
    r = run_plan(str(recipe))
    assert [row["stage"] for row in r["memory"]] == ["train", "prune row", "quantize", "bench"]
    assert all(row["fits"] and 0 < row["required_bytes"] <= row["total_bytes"] for row in r["memory"])
    t = r["time"]
    assert t["step_s"] == 0.05 and t["steps"] == t["recipe_steps"] == 4
    assert t["total_s"] == pytest.approx(sum(t["seconds"].values()) + pipeline.OUTSIDE_S)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()
    monkeypatch.setattr(sys, "argv", ["effkit", "run", "--plan", str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None) and "plan of the run tiny" in out and "plan: every stage fits" in out
    assert not (tmp_path / "runs").exists()
