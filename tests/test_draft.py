"""Drafts for speculative decoding: `effkit prune --mode draft`, its record, and assisted generation in PyTorch."""

import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from effkit import cli
from effkit.artifacts import data_section, read_meta
from effkit.config import DataConfig, PruneConfig
from effkit.data import prepare
from effkit.engines.pytorch import ENGINE, Assisted, check_vocabulary
from effkit.errors import EffkitError
from effkit.prune import draft as draft_mod
from effkit.prune.distill import Distiller
from effkit.prune.options import DraftOptions
from effkit.prune.stage import run_prune


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, train_tiny):
    """A tiny target, its draft (one round, distilled), and every batch the distillation read."""
    tmp = tmp_path_factory.mktemp("draft")
    target = train_tiny(tmp, "d")
    seen = []
    call = Distiller.__call__

    def spy(self, logits, batch):
        seen.append(batch.detach().cpu().clone())
        return call(self, logits, batch)

    cfg = PruneConfig.from_flat(source=target, mode="draft", target=0.5, rounds=1, finetune_steps=3, batch_size=4,
                                latency_repeats=1, latency_rounds=2, calib_batches=1, control=False,
                                draft_narrow=0.5, draft_prompts=3, draft_new_tokens=12, fixed_rounds=True,
                                runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Distiller, "__call__", spy)
        report = run_prune(cfg, progress=False)
    return tmp, target, report["artifact"], seen


def test_draft_is_a_smaller_model_of_the_same_vocabulary_and_records_its_target(drafted):
    tmp, target, draft, _ = drafted
    t, d = AutoModelForCausalLM.from_pretrained(target), AutoModelForCausalLM.from_pretrained(draft)
    assert d.config.n_layer == t.config.n_layer // 2 and d.config.n_inner == 128  # half the blocks, half the MLP
    assert d.num_parameters() < t.num_parameters()
    assert d.config.vocab_size == t.config.vocab_size
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == AutoTokenizer.from_pretrained(target).get_vocab()
    check_vocabulary(target, draft)  # its own target's: accepted
    rec = read_meta(draft)["metrics"]["draft"]
    assert rec["target"] == target and rec["target_digest"] == draft_mod.target_digest(target)
    assert rec["k"] == 4 and rec["prompts"] == 3 and rec["new_tokens"] == 12
    assert 0 <= rec["acceptance_rate"] <= 1 and 1 <= rec["tokens_per_target_forward"] <= 5
    assert rec["cost"]["cost_ratio"]["ratio"] > 0 and rec["cost"]["draft_s_per_token"] > 0
    assert rec["projected_speedup"] == pytest.approx(
        rec["tokens_per_target_forward"] / (1 + 4 * rec["cost"]["cost_ratio"]["ratio"]))


def test_draft_distillation_reads_no_held_out_block(drafted):
    _, target, _, seen = drafted
    blocks = prepare(DataConfig.from_dict(data_section(target)), tokenizer_from=target).blocks
    train = {tuple(r) for r in blocks.train.tolist()}
    held_out = {tuple(r) for r in blocks.eval.tolist()}
    rows = [tuple(r) for b in seen for r in b.tolist()]
    assert len(seen) == 3  # one batch per fine-tuning step, every one distilled
    assert all(r in train for r in rows)
    assert not held_out & set(rows)


def test_acceptance_counts_what_a_k_token_loop_accepts(drafted):
    # matches at 0,1 then a miss: step 1 accepts 2 of 4 (the target gives the 3rd); step 2 accepts 4 of 4
    assert draft_mod.accepted_runs([True, True, False, True, True, True, True, True], 4) == (6, 8, 2)
    assert draft_mod.accepted_runs([False] * 3, 2) == (0, 5, 3)  # the last step has one token left to propose
    _, target, _, _ = drafted
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    prompts = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    seq = draft_mod.target_greedy(model, prompts, 16)
    own = draft_mod.acceptance(model, seq, 8, 4)  # the target as its own draft agrees everywhere
    assert own["acceptance_rate"] == 1.0 and own["tokens_per_target_forward"] == 4.0


def test_a_draft_of_another_vocabulary_is_refused(drafted, tmp_path):
    _, target, draft, _ = drafted
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(other)
    for call in (lambda: check_vocabulary(target, other), lambda: ENGINE.with_draft(target, other, "cpu")):
        with pytest.raises(EffkitError, match="another tokenizer") as e:
            call()
        assert "\n" not in str(e.value)


def test_draft_options_are_checked():
    with pytest.raises(EffkitError, match="--draft-narrow"):
        DraftOptions(draft_narrow=1.0)
    with pytest.raises(EffkitError, match="--draft-k"):
        DraftOptions(draft_k=0)


@pytest.mark.parametrize("k", [1, 4])
def test_assisted_generation_is_the_targets_greedy_output(drafted, k):
    _, target, draft, _ = drafted
    assisted = ENGINE.with_draft(target, draft, "cpu", k=k).eval()
    assert isinstance(assisted, Assisted) and assisted.draft.generation_config.num_assistant_tokens == k
    plain = AutoModelForCausalLM.from_pretrained(target).eval()
    calls = []
    assisted.draft.register_forward_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, plain.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        want = plain.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        got = assisted.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)
    assert calls  # the draft proposed tokens: assisted generation ran


def generate_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", "generate", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_generate_with_a_draft_streams_the_targets_greedy_text(drafted, capsys, monkeypatch):
    _, target, draft, _ = drafted
    base = ["--from", target, "--prompt", "The Congress shall", "--max-new-tokens", "24", "--device", "cpu"]
    code, plain, _ = generate_cli(base, capsys, monkeypatch)
    assert code == 0 and plain.strip()
    code, assisted, _ = generate_cli([*base, "--draft", draft, "--draft-k", "3"], capsys, monkeypatch)
    assert code == 0 and assisted == plain
    code, _, err = generate_cli([*base, "--draft", draft, "--compile"], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "--compile and --draft" in err
