"""Speculative decoding (`effkit.engines.speculative`): exactly the target's greedy tokens in ONNX Runtime (effkit's
loop over the with-past graph) and PyTorch (transformers' prompt lookup), the KV cache rolled back past rejected
drafts, k chosen by the decision rule with its samples kept, and the held-out prompts that judge it."""

import copy
import json

import numpy as np
import pytest
import torch
from conftest import assert_choice_from_samples

from effkit.engines import speculative as spec
from effkit.engines.onnxruntime.graph import onnx_unavailable
from effkit.errors import EffkitError

pytestmark = pytest.mark.skipif(onnx_unavailable() is not None, reason=f"not run: {onnx_unavailable()}")

NEW = 24
REPETITIVE = [11, 12, 13, 14, 15, 16] * 4
NON_REPETITIVE = [int(t) for t in np.random.default_rng(1).permutation(np.arange(20, 500))[:24]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, train_tiny):
    """A tiny trained GPT-2 in PyTorch and its fp32 ONNX export."""
    from transformers import AutoTokenizer

    from effkit.engines.onnxruntime import export as ox
    from effkit.engines.onnxruntime.runtime import OnnxCausalLM
    from effkit.model import load_model

    tmp = tmp_path_factory.mktemp("speculative")
    artifact = train_tiny(tmp, "spec")
    pt, tok = load_model(artifact).eval(), AutoTokenizer.from_pretrained(artifact)
    (onnx := tmp / "onnx").mkdir()
    ox.write_artifact(onnx, copy.deepcopy(pt), tok, int8=False, fused=False)
    return pt, OnnxCausalLM(onnx), onnx


def greedy(model, prompt, **kw):
    ids = torch.tensor([prompt]) if isinstance(prompt[0], int) else torch.tensor(prompt)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, use_cache=True, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


class WrongDraft:
    """A draft that is always wrong: every step's proposal is rejected, so every step rolls the cache back."""

    kind = "model"

    def __init__(self, model):
        self.model = model

    def propose(self, context, k):
        with torch.no_grad():
            right = int(self.model(torch.as_tensor(context)[None]).logits[0, -1].argmax())
        return np.asarray([(right + 1) % 512] * k, np.int64)


def test_the_ngram_draft_proposes_what_followed_the_last_ngram():
    d = spec.NgramDraft()
    assert d.propose(np.array([1, 2, 3, 4, 9, 1, 2]), 4).tolist() == [3, 4, 9, 1]
    assert d.propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 5).tolist() == [3, 1, 2, 3, 1]  # a loop goes on
    assert d.propose(np.array([5, 1, 7, 2, 7]), 2).tolist() == [2, 7]  # the most recent occurrence, one token long
    assert d.propose(np.array([1, 2, 3]), 3).tolist() == []  # nothing repeats: nothing proposed


@pytest.mark.parametrize("prompt", [REPETITIVE, NON_REPETITIVE], ids=["repetitive", "non-repetitive"])
def test_speculative_decoding_gives_exactly_the_targets_greedy_tokens(models, prompt):
    pt, ort, _ = models
    plain = greedy(ort, prompt)
    assert greedy(pt, prompt) == plain  # the two engines agree without drafts
    assert greedy(ort, prompt, prompt_lookup_num_tokens=4) == plain
    stats = ort.speculative_stats.to_dict()
    assert stats["new_tokens"] == NEW and stats["target_forwards"] + stats["accepted"] == NEW
    assert greedy(pt, prompt, prompt_lookup_num_tokens=4) == plain  # transformers' own prompt lookup
    if prompt is REPETITIVE:  # the draft was used: fewer target forwards than tokens
        assert stats["accepted"] > 0 and stats["tokens_per_target_forward"] > 1
    # rows of a batch run one after another, each its own greedy text
    two = [REPETITIVE, NON_REPETITIVE]
    assert greedy(ort, two, prompt_lookup_num_tokens=3) == greedy(ort, two)


def test_rejected_drafts_are_rolled_back_out_of_the_kv_cache(models):
    from effkit.engines.onnxruntime.runtime import verifier

    pt, ort, _ = models
    prompt = np.asarray(NON_REPETITIVE, np.int64)
    verify = verifier(ort.session, ort.config)
    first = int(verify(prompt, 0)[-1].argmax())
    verify(np.asarray([first, 7, 8, 9]), len(prompt))  # the cache now holds three drafts after `first`
    after = verify(np.asarray([first, 40]), len(prompt))  # rolled back to the prompt: `first` fed again, then 40
    with torch.no_grad():
        full = pt(torch.tensor([[*NON_REPETITIVE, first, 40]])).logits[0, -2:].numpy()
    np.testing.assert_allclose(after, full, atol=1e-4)
    # a draft that is always wrong leaves the output exact, one token per forward
    assert greedy(ort, NON_REPETITIVE, assistant_model=WrongDraft(pt), num_assistant_tokens=3) == greedy(
        ort, NON_REPETITIVE)
    s = ort.speculative_stats.to_dict()
    assert s["accepted"] == 0 and s["proposed"] > 0 and s["target_forwards"] == NEW


def test_a_divergence_is_an_error_that_says_where():
    assert spec.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert spec.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert spec.first_divergence([1, 2, 3], [1, 2]) == 2
    with pytest.raises(EffkitError, match="diverged from the target's greedy tokens at new token 4"):
        spec.check_exact([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 6], "k4 on prompt 0")


def test_k_is_chosen_by_the_decision_rule_and_travels_with_the_artifact(models, tmp_path):
    import shutil

    from effkit.engines.onnxruntime import ENGINE
    from effkit.engines.onnxruntime.runtime import OnnxCausalLM
    from effkit.measure.choice import Rule

    _, ort, folder = models
    rule = Rule(rounds=3, looks=2, budget_s=0.5, min_sample_s=0.01, h2h_sample_s=0.01)
    chosen = spec.choose_k(ort, [REPETITIVE, NON_REPETITIVE], NEW, ks=(2, 4), rule=rule)
    assert set(chosen.choice["samples"]) == {"plain", "k2", "k4"}
    assert all(len(rounds) >= 3 for rounds in chosen.choice["samples"].values())
    assert_choice_from_samples(chosen.choice)
    assert chosen.k == (0 if chosen.choice["picked"] == "plain" else int(chosen.choice["picked"][1:]))
    assert set(chosen.per_k) == {"k2", "k4"} and chosen.per_k["k4"]["new_tokens"] == 2 * NEW
    shutil.copytree(folder, moved := tmp_path / "onnx")
    spec.write_settings(moved, spec.KChoice("ngram", 4, chosen.choice, chosen.per_k), "2 prompts, batch 1")
    assert json.loads((moved / spec.SETTINGS).read_text())["choice"]["samples"] == chosen.choice["samples"]
    again = OnnxCausalLM(moved)
    assert again.speculative == {"draft": "ngram", "k": 4} and "k=4" in ENGINE.load_command(moved)
    assert greedy(again, REPETITIVE) == greedy(ort, REPETITIVE) and again.speculative_stats is not None
    again.speculative_stats = None
    greedy(again, [REPETITIVE, REPETITIVE])  # a batch decodes plainly unless asked
    greedy(again, REPETITIVE, prompt_lookup_num_tokens=0)  # so does an explicit 0
    assert again.speculative_stats is None


def test_a_k_whose_tokens_diverge_is_never_chosen_and_the_record_says_where():
    from effkit.measure.choice import Rule

    class Drifting:  # a target whose checked tokens differ from its own plain ones at k 4 (as dynamic int8 can)
        def generate(self, ids, max_new_tokens, prompt_lookup_num_tokens=0, **_):
            new = torch.arange(max_new_tokens)[None] + (prompt_lookup_num_tokens == 4) * (
                torch.arange(max_new_tokens) >= 5)
            return torch.cat([ids, new], 1)

    rule = Rule(rounds=3, looks=1, min_sample_s=0.001, h2h_sample_s=0.001)
    chosen = spec.choose_k(Drifting(), [REPETITIVE], 8, ks=(2, 4), rule=rule)
    assert "k4" not in chosen.choice["samples"] and chosen.k != 4
    assert "diverged from the target's greedy tokens at new token 5" in chosen.choice["invalid"]["k4"]


def test_bad_speculative_input_is_one_line(models, tmp_path):
    _, ort, _ = models
    with pytest.raises(EffkitError, match="greedy"):
        ort.generate(torch.tensor([REPETITIVE]), max_new_tokens=4, do_sample=True, prompt_lookup_num_tokens=2)
    with pytest.raises(EffkitError, match="must propose tokens"):
        ort.generate(torch.tensor([REPETITIVE]), max_new_tokens=4, assistant_model=object())
    with pytest.raises(EffkitError, match="at least 1 draft token"):
        spec.speculative_loop(lambda: None, np.zeros((1, 3), np.int64), 4, spec.NgramDraft(), 0, None)
    (tmp_path / spec.SETTINGS).write_text(json.dumps({"draft": "model", "k": 4}))
    with pytest.raises(EffkitError, match="only n-gram drafts"):
        spec.read_settings(tmp_path)
    (tmp_path / spec.SETTINGS).write_text("{")
    with pytest.raises(EffkitError, match="unreadable"):
        spec.read_settings(tmp_path)


def test_heldout_prompts_are_the_same_cut_of_the_held_out_documents(corpus_dir, models):
    from transformers import AutoTokenizer

    from effkit.data.corpus import load_corpus
    from effkit.measure.generation import heldout_prompts
    from effkit.workloads import DECODE_B1, HELDOUT_PROMPT_TOKENS

    tok = AutoTokenizer.from_pretrained(models[2])
    corpus = load_corpus(str(corpus_dir))
    texts = [t for _, t in corpus.heldout]
    prompts = heldout_prompts(texts, tok, DECODE_B1.prompts, HELDOUT_PROMPT_TOKENS)
    assert len(prompts) == DECODE_B1.prompts and {len(p) for p in prompts} == {HELDOUT_PROMPT_TOKENS}
    assert prompts == heldout_prompts(texts, tok, DECODE_B1.prompts, HELDOUT_PROMPT_TOKENS)
    joined = [t for text in texts for t in tok(text).input_ids]
    assert prompts[0] == joined[:HELDOUT_PROMPT_TOKENS] and prompts[-1] == joined[-HELDOUT_PROMPT_TOKENS:]
    room, n = len(joined) - HELDOUT_PROMPT_TOKENS, len(prompts)
    assert prompts == [joined[room * i // (n - 1):][:HELDOUT_PROMPT_TOKENS] for i in range(n)]  # evenly spaced
    with pytest.raises(EffkitError, match="too few"):
        heldout_prompts(["a b"], tok, 2, 10_000)


@pytest.mark.parametrize("bits,level", [(4, 1), (4, 4), (8, 1), (8, 4)])
def test_a_weight_only_target_is_exact_under_speculation(models, tmp_path, bits, level):
    """MatMulNBits (weight-only, 4 or 8 bits; level 4 quantizes activations per row and block): the logits of k
    tokens checked in one run equal those of k single-token runs to rounding, so the draft leaves the text exact
    (the artifact's own plain greedy tokens); dynamic int8 (one activation scale over the run) does not promise it."""
    import shutil

    from effkit.engines.onnxruntime import ENGINE
    from effkit.engines.onnxruntime.int4 import int8_compute_unavailable, quantize_int4
    from effkit.engines.onnxruntime.runtime import OnnxCausalLM, empty_past, step

    if level == 4 and (why := int8_compute_unavailable()):
        pytest.skip(why)
    _, _, fp32 = models
    shutil.copytree(fp32, folder := tmp_path / "target")
    quantize_int4(fp32 / "model.onnx", folder / "model.onnx", block_size=32, accuracy_level=level, bits=bits)
    assert ENGINE.speculative_target(folder) and not ENGINE.speculative_target(fp32)
    target = OnnxCausalLM(folder)
    seq = np.asarray(NON_REPETITIVE + REPETITIVE, np.int64)
    _, past = step(target.session, seq[None, :30], empty_past(target.config, 1), 0)
    together, _ = step(target.session, seq[None, 30:36], past, 30)
    alone = []
    for j in range(30, 36):
        logits, past = step(target.session, seq[None, j:j + 1], past, j)
        alone.append(logits[0, -1])
    np.testing.assert_allclose(together[0], np.stack(alone), atol=1e-4)
    for prompt in (REPETITIVE, NON_REPETITIVE):
        plain = greedy(target, prompt)
        for k in (2, 4, 6):
            spec.check_exact(plain[0], greedy(target, prompt, prompt_lookup_num_tokens=k)[0], f"k{k}")
