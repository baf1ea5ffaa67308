"""The speculative artifact in the bench and the run (`effkit.bench.speculative`): made from the dense reference with
k chosen (here monkeypatched: no timing on a shared machine decides a test) and its exactness checked on the held-out
prompts before any timing, a mismatch a failure that says where; its row's draft statistics; a lossless candidate of
the deliverable, shipped only where it measured faster; left out with a reason on a small budget share."""

from pathlib import Path

import pytest
from test_quantize import one_onnx_export  # noqa: F401 - the reference's ONNX export made once for the module
from test_run import _fake_bench, write_recipe

from effkit import artifacts, workloads
from effkit.bench import speculative as bs
from effkit.bench.deliverable import deliverable
from effkit.bench.stage import BenchStep
from effkit.config import BenchConfig
from effkit.engines import speculative as spec
from effkit.pipeline import make_plan
from effkit.stage import Plan, costs

NEW = 16


@pytest.fixture
def picks_k4(monkeypatch):
    """`choose_k` picking k=4 with a choice record, as if measured."""
    picked = spec.KChoice("ngram", 4, {"picked": "k4", "label": "decided", "samples": {"plain": [[1.0]],
                                                                                       "k4": [[2.0]]}}, {})
    monkeypatch.setattr(spec, "choose_k", lambda *a, **k: picked)
    return picked


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train_tiny):
    return train_tiny(tmp_path_factory.mktemp("bench-spec"), "spec")


def test_the_speculative_artifact_is_checked_exact_and_carries_its_draft_statistics(reference, picks_k4, tmp_path):
    from effkit.artifacts.loader import load_any, load_command

    cfg = BenchConfig.from_flat(speculative=True, quick=True)
    paths, why = bs.add(cfg, tmp_path, [artifacts_path := Path(reference)], NEW)
    # the reference's own weight-only form is the target where the run has no weight-only artifact
    assert why == {} and paths == [artifacts_path, tmp_path / bs.tag_of(bs.REF_INT4)]
    folder = paths[-1]
    what = artifacts.read_meta(folder)[bs.ROW_KEY]
    assert what["target"].startswith("the dense reference, ONNX graph with 4-bit block-quantized weights")
    assert "blocks of 32" in what["target"] and (folder / "quantization.json").is_file()
    assert what["k"] == 4 and what["prompts"]["count"] == workloads.DECODE_B1.prompts
    assert what["exact"].startswith(f"{workloads.DECODE_B1.prompts} prompts x {NEW} tokens")
    assert what["tokens_per_prompt"] == NEW and what["new_tokens"] == NEW * workloads.DECODE_B1.prompts
    assert 0 <= what["acceptance_rate"] <= 1 and 1 <= what["tokens_per_target_forward"] <= 5
    assert 0 <= what["draft_share_of_time"] < 1 and what["choice"] == picks_k4.choice
    model = load_any(folder)  # plain ONNX Runtime with effkit's loop and the measured k: the settings travel
    assert model.speculative == {"draft": "ngram", "k": 4} and "k=4" in load_command(folder)
    rows = [{"tag": "train", "stage": "train", "artifact": reference, "flags": []},
            {"tag": folder.name, "stage": "quantize", "artifact": str(folder), "flags": []}]
    bs.annotate(rows)
    assert bs.ROW_KEY not in rows[0] and rows[1][bs.ROW_KEY] == what and rows[0]["flags"] == []
    assert rows[1]["flags"][0].startswith(f"speculative: ngram draft, k=4 (chosen on this CPU), exact on "
                                          f"{workloads.DECODE_B1.prompts} held-out prompts x {NEW} tokens")
    # the next bench makes it again (the earlier one is never benched beside the new one); a bench not asked for
    # one benches it as it finds it; one on too small a share removes it (its reference may have been retrained)
    assert bs.add(cfg, tmp_path, [artifacts_path, folder], NEW)[0] == [artifacts_path, folder]
    assert bs.add(cfg.replace(speculative=None), tmp_path, [artifacts_path, folder], NEW) == (
        [artifacts_path, folder], {})
    small = cfg.replace(peer_share=bs.cost()["from_share"] / 2)
    assert bs.add(small, tmp_path, [artifacts_path, folder], NEW) == ([artifacts_path],
                                                                    {bs.SPEC_TAG: bs.left_out(small)})
    assert not folder.exists()


def test_a_speculative_artifact_that_diverges_is_a_failure_that_says_where(reference, picks_k4, tmp_path,
                                                                             monkeypatch):
    real = spec.speculative_loop

    def off_by_one(new_verifier, ids, max_new_tokens, *a, **k):
        out, stats = real(new_verifier, ids, max_new_tokens, *a, **k)
        out = out.copy()
        out[:, ids.shape[1] + 3] += 1  # new token 3 is not the target's
        return out, stats

    monkeypatch.setattr(spec, "speculative_loop", off_by_one)
    paths, why = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path,
                        [p := Path(reference)], NEW)
    # the weight-only form first, then the fp32 export: each a failure that says where
    int4 = bs.tag_of(bs.REF_INT4)
    assert paths == [p] and not (tmp_path / bs.SPEC_TAG).exists() and not (tmp_path / int4).exists()
    for tag in (int4, bs.SPEC_TAG):
        assert why[tag].startswith(f"failed: {tag} (n-gram draft, k=4) on held-out prompt 0")
        assert "diverged from the target's greedy tokens at new token 3" in why[tag]


def test_plain_decoding_measured_faster_leaves_no_speculative_artifact(reference, monkeypatch, tmp_path):
    monkeypatch.setattr(spec, "choose_k", lambda *a, **k: spec.KChoice("ngram", 0, {"picked": "plain",
                                                                                    "label": "decided"}, {}))
    paths, why = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path,
                        [p := Path(reference)], NEW)
    tag = bs.tag_of(bs.REF_INT4)  # and no fp32 target either: slower still
    assert paths == [p] and list(why) == [tag] and why[tag].startswith("not run: plain decoding")
    assert not (tmp_path / tag).exists() and not (tmp_path / bs.SPEC_TAG).exists()


def test_the_deliverable_ships_the_speculative_artifact_only_where_it_measured_faster(tmp_path, corpus_dir):
    plan = make_plan(str(write_recipe(tmp_path, corpus_dir, extra_run="max_loss_increase = 0.02")))
    ref, stages = [100.0] * 24, {bs.SPEC_TAG: "export", "peer-a": "peer", "peer-b": "peer"}
    faster = _fake_bench({"train": ref, "q": [130.0] * 24, bs.SPEC_TAG: [180.0] * 24, "peer-a": [120.0] * 24,
                          "peer-b": [110.0] * 24}, {"train": 0.0, "q": 0.005, bs.SPEC_TAG: 0.0, "peer-a": 0.0,
                                                    "peer-b": 0.0}, stages=stages, sizes={bs.SPEC_TAG: 1.0})
    ship = deliverable(plan, faster)
    assert ship["tag"] == bs.SPEC_TAG and ship["verdict"] == "decided"
    assert ship["lossless"]["tag"] == bs.SPEC_TAG  # the best lossless artifact too
    # judged against the fastest peer in the deliverable's own rounds: 1.5x, decided
    against = ship["vs_fastest_peer"]
    assert against["peer"] == "peer-a" and against["ratio"]["verdict"] == "faster"
    assert against["ratio"]["ratio"] == pytest.approx(1.5, rel=0.02) and "peer-a: 1.5" in ship["line"]
    slower = _fake_bench({"train": ref, "q": [130.0] * 24, bs.SPEC_TAG: [90.0] * 24},
                         {"train": 0.0, "q": 0.005, bs.SPEC_TAG: 0.0}, stages=stages, sizes={bs.SPEC_TAG: 1.0})
    ship = deliverable(plan, slower)
    assert ship["tag"] == "q" and ship["choice"]["ratios"][bs.SPEC_TAG]["verdict"] == "slower"
    tied = _fake_bench({"train": ref, bs.SPEC_TAG: [100.0] * 24}, {"train": 0.0, bs.SPEC_TAG: 0.0}, stages=stages,
                       sizes={bs.SPEC_TAG: 1.05})
    assert deliverable(plan, tied)["tag"] == "train"  # a tie is not faster: the smaller, the dense model, ships


def test_a_small_budget_share_leaves_the_speculative_artifact_out_with_a_reason(tmp_path, corpus_dir):
    need = bs.cost()["from_share"]
    cfg = BenchConfig.from_flat(speculative=True, peer_share=need / 2)
    assert bs.left_out(cfg).startswith(f"not run: budget share {need / 2:.0%}") and "stage_costs.json" in \
        bs.left_out(cfg)
    assert bs.left_out(cfg.replace(peer_share=need)) is None and bs.runs(cfg.replace(peer_share=need))
    assert bs.left_out(BenchConfig.from_flat()) is None and not bs.runs(BenchConfig.from_flat())  # off outside run
    # a bench on a small share prices no speculative artifact, and lists it
    assert bs.add(cfg, tmp_path, [tmp_path / "train"], NEW) == ([tmp_path / "train"], {bs.SPEC_TAG: bs.left_out(cfg)})
    plan = make_plan(str(write_recipe(tmp_path, corpus_dir)))
    assert plan.bench.what.speculative  # on in effkit run
    whole = Plan(plan.recipe, plan.run, {**plan.configs, "bench": plan.bench.replace(peers=False, peer_share=1.0)})
    small = Plan(plan.recipe, plan.run, {**plan.configs, "bench": plan.bench.replace(peers=False,
                                                                                     peer_share=need / 2)})
    ms, w = whole.bench.measure, costs()["bench"]
    one = ms.rounds * w["artifact_round"] * ms.gen_tokens / 128 * ms.repeats / 3 + w["artifact"]
    assert BenchStep().work(whole) - BenchStep().work(small) == pytest.approx(
        one + bs.cost()["choose_k"] * ms.gen_tokens / 128)
    from effkit.bench.stage import STAGE

    assert STAGE.with_share(small, need / 2)["speculative"].startswith("not run: budget share")
    assert STAGE.with_share(whole, 1.0)["speculative"] == "made and benched"
    from effkit.pipeline import FEWEST_SHARE

    # every share a time budget gives `effkit run`'s stages makes it: the run weighs the lossless artifact
    assert STAGE.with_share(whole, FEWEST_SHARE)["speculative"] == "made and benched"


@pytest.mark.slow
def test_the_bench_times_the_speculative_artifact_beside_the_others(reference, picks_k4):
    """`effkit bench --speculative`: the speculative artifact's row in bench.json, in the same rounds as the
    reference, with its draft's statistics and its exactness."""
    from effkit.bench import run_bench

    runs = Path(reference).parent.parent
    report = run_bench(BenchConfig.from_flat(paths=(reference,), speculative=True, quick=True, rounds=2, repeats=1,
                                             train_steps=0, runs_dir=str(runs),
                                             reports_dir=str(runs.parent / "reports")), progress=False)
    rows = {r["tag"]: r for r in report["artifacts"]}
    assert list(rows) == [Path(reference).name, bs.tag_of(bs.REF_INT4)]
    row = rows[bs.tag_of(bs.REF_INT4)]
    assert row["speculative"]["k"] == 4 and {"acceptance_rate", "tokens_per_target_forward",
                                             "draft_share_of_time"} <= set(row["speculative"])
    for w in workloads.of_kind("decode"):
        assert row[w.figure] > 0 and len(report["samples"][w.measure][row["tag"]]) >= 2
    assert "speculative" not in rows[Path(reference).name] and report["not_run"] == {}
    assert report["prompts"]["count"] == workloads.DECODE_B1.prompts  # every contender on the held-out prompts


@pytest.fixture(scope="module")
def weight_only_targets(reference, tmp_path_factory):
    """The reference as a weight-only ONNX Runtime artifact (MatMulNBits, 4 bits, blocks of 32, int8 compute where
    this CPU has it) and as a dynamic int8 one, both effkit artifacts of its run."""
    import copy

    from transformers import AutoTokenizer

    from effkit.engines.onnxruntime import export as ox
    from effkit.engines.onnxruntime.int4 import int8_compute_unavailable, quantize_int4
    from effkit.model import load_model

    tmp, tok = tmp_path_factory.mktemp("targets"), AutoTokenizer.from_pretrained(reference)
    level = 1 if int8_compute_unavailable() else 4
    made = []
    for name, kw in (("quantize-onnxruntime-int4", {"int4": True, "int4_quantize": lambda s, d: quantize_int4(
            s, d, block_size=32, accuracy_level=level)}), ("quantize-onnxruntime", {"int8": True})):
        (folder := tmp / name).mkdir()
        ox.write_artifact(folder, copy.deepcopy(load_model(reference).eval()), tok, fused=False,
                          **{"int8": False, **kw})
        artifacts.write_meta(folder, "quantize", {"backend": name}, {}, data=artifacts.data_section(Path(reference)),
                             parent=reference)
        made.append(folder)
    return made


def test_a_weight_only_target_gets_its_own_speculative_artifact_on_the_same_prompts(reference, weight_only_targets,
                                                                                   monkeypatch, tmp_path):
    int4, int8 = weight_only_targets
    seen = []

    def recording(model, ids, *a, **k):
        seen.append([p.tolist() for p in ids])
        return spec.KChoice("ngram", 4, {"picked": "k4", "label": "decided"}, {})

    monkeypatch.setattr(spec, "choose_k", recording)
    ref = Path(reference)
    assert bs.targets([ref, int8, int4]) == [int4]  # dynamic int8 is no target
    paths, why = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path, [ref, int8, int4], NEW)
    tag = bs.tag_of(int4)
    assert why == {} and paths == [ref, int8, int4, tmp_path / tag]  # the run's own target: no other written
    n = workloads.DECODE_B1.prompts
    from transformers import AutoTokenizer

    held_out = bs.prompts(ref, artifacts.data_section(ref), AutoTokenizer.from_pretrained(ref))
    assert len(seen) == 1 and seen[0] == [q.tolist() for q in held_out] and len(seen[0]) == n
    what = artifacts.read_meta(tmp_path / tag)[bs.ROW_KEY]
    assert what["target"].startswith("quantize-onnxruntime-int4: ONNX Runtime int4 (weight-only")
    assert what["exact"] == f"{n} prompts x {NEW} tokens equal to the target's" and what["k"] == 4
    assert "plain batched decoding" in what["batch_12"]
    assert artifacts.read_meta(tmp_path / tag)["speculative_of"] == str(int4)
    assert (tmp_path / tag / "quantization.json").exists() == (int4 / "quantization.json").exists()
    assert bs.targets(paths) == [int4]  # a speculative artifact is never a target again
    rows = [{"tag": tag, "stage": "quantize", "artifact": str(tmp_path / tag), "flags": [],
             workloads.DECODE_B12.figure: 321.0}]
    bs.annotate(rows)
    assert rows[0][bs.ROW_KEY]["batch_12_tokens_per_s"] == 321.0
    assert rows[0]["flags"][0].endswith("decode b12 times that (321.0 tokens/s)")
    # the next bench replaces both
    again, _ = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path, paths, NEW)
    assert again == paths


def test_a_weight_only_target_that_diverges_is_refused_and_says_where(reference, weight_only_targets, picks_k4,
                                                                     monkeypatch, tmp_path):
    int4, _ = weight_only_targets
    real_loop, real_write, current = spec.speculative_loop, bs.write_target, {}

    def recording(cfg, folder, reference, tokenizer, target):
        current["target"] = target
        return real_write(cfg, folder, reference, tokenizer, target)

    def off_by_one_on_int4(new_verifier, ids, max_new_tokens, *a, **k):
        out, stats = real_loop(new_verifier, ids, max_new_tokens, *a, **k)
        if current["target"] is not None:
            out = out.copy()
            out[:, ids.shape[1] + 5] += 1
        return out, stats

    monkeypatch.setattr(bs, "write_target", recording)
    monkeypatch.setattr(spec, "speculative_loop", off_by_one_on_int4)
    ref = Path(reference)
    paths, why = bs.add(BenchConfig.from_flat(speculative=True, quick=True), tmp_path, [ref, int4], NEW)
    tag = bs.tag_of(int4)
    assert paths == [ref, int4, tmp_path / bs.SPEC_TAG] and not (tmp_path / tag).exists()
    assert set(why) == {tag} and why[tag].startswith(f"failed: {tag} (n-gram draft, k=4) on held-out prompt 0")
    assert "diverged from the target's greedy tokens at new token 5" in why[tag]
