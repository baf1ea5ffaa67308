"""Width and depth pruning (Torch-Pruning, whole blocks) and distillation from the dense parent."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from effkit.config import PruneConfig, TrainConfig
from effkit.errors import EffkitError
from effkit.measure import evaluation
from effkit.model import build_model, load_model, save_model
from effkit.prune.depth import block_importance, prune_blocks
from effkit.prune.distill import Distiller, kl_to_teacher
from effkit.prune.stage import run_prune
from effkit.prune.width import prune_width, valid_width


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_tiny):
    tmp = tmp_path_factory.mktemp("structured")
    return tmp, train_tiny(tmp, "s")


def prune_cfg(tmp, artifact, **kw):
    base = dict(source=artifact, rounds=2, finetune_steps=2, batch_size=4, latency_repeats=1, latency_rounds=2,
                calib_batches=1, control=False, runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"))
    return PruneConfig.from_flat(fixed_rounds=True, **{**base, **kw})


def ids(n=2, t=16, vocab=512):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(1))


def same_as_plain_transformers(model, tmp_path):
    """Save effkit's in-memory model, load it with plain from_pretrained: same logits, same parameter count."""
    save_model(model, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        diff = (plain(ids()).logits - model.eval()(ids()).logits).abs().max()
    assert diff < 1e-5
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in model.parameters())
    return plain


def test_width_pruned_model_is_a_valid_gpt2_that_plain_transformers_reproduces(tmp_path):
    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512).eval()  # n_embd 64, 2 heads, n_inner 256
    pruned, done = prune_width(model, 32)
    assert done["removed_channels"] == 32 and done["head_dim"] == 16
    c = pruned.config
    assert (c.n_embd, c.n_head, c.n_inner) == (32, 2, 256)  # the MLP width is kept, made explicit
    plain = same_as_plain_transformers(pruned, tmp_path)
    assert plain.transformer.wte.weight.data_ptr() == plain.lm_head.weight.data_ptr()  # still tied
    # parameters match the config: a fresh GPT-2 of that config has exactly as many
    from transformers import GPT2LMHeadModel
    assert sum(p.numel() for p in GPT2LMHeadModel(c).parameters()) == sum(p.numel() for p in pruned.parameters())


def test_every_head_keeps_the_same_dimensions_in_q_and_k(tmp_path):
    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512).eval()
    n, hd = 64, 32
    pruned, _ = prune_width(model, 32)
    # the kept residual channels: columns of the token embedding that survived
    wte0, wte1 = model.transformer.wte.weight, pruned.transformer.wte.weight
    cols = [int((wte0 - wte1[:, j:j + 1]).abs().sum(0).argmin()) for j in range(wte1.shape[1])]
    assert (wte0[:, cols] == wte1).all()
    scale = math.sqrt(16 / 32)
    for b0, b1 in zip(model.transformer.h, pruned.transformer.h, strict=True):
        w0, w1 = b0.attn.c_attn.weight[:, cols], b1.attn.c_attn.weight
        q0, k0, v0 = w0[:n], w0[n:2 * n], w0[2 * n:]
        q1, k1, v1 = w1[:32], w1[32:64], w1[64:]
        for h in range(2):
            # each kept k row is an original k row of the same head; the q row beside it is the same dimension
            for j in range(16):
                src = int((k0[h * hd:(h + 1) * hd] - k1[h * 16 + j]).abs().sum(1).argmin()) + h * hd
                assert torch.allclose(k0[src], k1[h * 16 + j])
                assert torch.allclose(q0[src] * scale, q1[h * 16 + j], atol=1e-6)
            for j in range(16):  # value dimensions stay within their head
                src = int((v0 - v1[h * 16 + j]).abs().sum(1).argmin())
                assert h * hd <= src < (h + 1) * hd and torch.allclose(v0[src], v1[h * 16 + j])


def test_depth_pruning_removes_the_block_that_costs_least_to_skip(tmp_path):
    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512).eval()
    with torch.no_grad():  # block 1 adds nothing to the residual stream: skipping it costs nothing
        for lin in (model.transformer.h[1].attn.c_proj, model.transformer.h[1].mlp.c_proj):
            lin.weight.zero_()
            lin.bias.zero_()
    calib = [ids(4, 32)]
    importance = block_importance(model, calib)
    assert abs(importance[1]) < 1e-6 and importance[0] > 1e-4
    pruned, done = prune_blocks(model, 1, calib)
    assert done["removed"] == [1] and pruned.config.n_layer == 1
    torch.testing.assert_close(pruned.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)
    same_as_plain_transformers(pruned, tmp_path)


def test_kl_is_zero_when_the_teacher_is_the_student():
    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512).eval()
    batch = ids(2, 32)
    with torch.no_grad():
        logits = model(batch).logits
    assert float(kl_to_teacher(logits, logits, 2.0)) == pytest.approx(0.0, abs=1e-6)
    d = Distiller(model, alpha=0.5, temperature=2.0)
    loss = d(logits, batch)
    assert d.last["kl"] == pytest.approx(0.0, abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * float(evaluation.lm_loss(logits, batch)), rel=1e-6)
    other = build_model("gpt2-nano", 512).eval()  # another initialisation: a real KL term
    d2 = Distiller(other, alpha=0.5, temperature=2.0)
    loss2 = d2(logits, batch)
    assert d2.last["kl"] > 1e-3 and float(loss2) == pytest.approx(0.5 * d2.last["cross_entropy"] + 0.5 * d2.last["kl"])


@pytest.mark.parametrize("mode, target, shape", [("width", 0.5, {"n_embd": 32}), ("depth", 0.5, {"n_layer": 1})])
@pytest.mark.slow
def test_structured_rounds_compose_load_in_transformers_and_distill_through_the_loop(trained, mode, target, shape):
    tmp, artifact = trained
    report = run_prune(prune_cfg(tmp, artifact, mode=mode, target=target, distill=True), progress=False)
    assert report["label"] == f"{mode}-distill" and [r["round"] for r in report["curve"]] == [0, 1, 2]
    final = report["curve"][-1]["artifact"]
    meta = json.loads((tmp / "runs" / "s" / f"prune-{mode}-distill-r2" / "effkit.json").read_text())
    assert meta["parent"].endswith(f"prune-{mode}-distill-r1")  # round 2 pruned round 1's model further
    assert meta["metrics"]["prune"]["distill"]["alpha"] == 0.5 and meta["metrics"]["prune"]["distill"]["teacher"]
    plain = AutoModelForCausalLM.from_pretrained(final).eval()
    for k, v in shape.items():
        assert getattr(plain.config, k) == v
    with torch.no_grad():
        diff = (plain(ids()).logits - load_model(final).eval()(ids()).logits).abs().max()
    assert diff < 1e-5
    assert report["curve"][-1]["params"] == sum(p.numel() for p in plain.parameters())
    r1, r2 = report["curve"][1]["block_params_removed"], report["curve"][2]["block_params_removed"]
    # depth: two blocks, 50%: round 1 removes round(0.5) = 0 blocks; width: round 1 keeps 48 of 64 channels, which
    # rounds back to 64 at the default --width-multiple 32, so it cuts nothing and round 2 cuts to 32
    assert 0 < r1 < r2 or mode == "depth" or (mode == "width" and r1 == 0 < r2)
    assert report["curve"][2]["block_params_removed"] > 0.4
    assert (tmp / "reports" / "s" / "prune_loss.png").is_file()


class Recording(Distiller):
    def __call__(self, logits, batch):
        out = super().__call__(logits, batch)
        self.seen.append(dict(self.last))
        return out


def test_the_distillation_loss_is_what_the_loop_minimises(trained, corpus_dir):
    """Fine-tuning steps through the one training loop with the hook: the logged loss is the hook's total, which
    includes a non-zero KL term (the teacher differs from the student)."""
    from effkit.parallel import init_runtime
    from effkit.train import finetune

    tmp, artifact = trained
    d = Recording(build_model("gpt2-nano", 512), alpha=0.7, temperature=1.5)
    d.seen = []
    cfg = TrainConfig.from_flat(model=artifact, data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=4,
                                batch_size=4, max_steps=2, warmup_steps=0, eval_interval=0, checkpoint_interval=0,
                                runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"), run_name="probe")
    report = finetune(cfg, load_model(artifact), init_runtime("cpu"), stage="prune", tag="distill-probe",
                      parent=artifact, loss=d, progress=False)
    assert len(d.seen) == 2 and all(s["kl"] > 0 for s in d.seen)
    assert report["metrics"]["final_train_loss"] == pytest.approx(d.seen[-1]["loss"], rel=1e-5)


@pytest.mark.parametrize("kw, needle", [
    (dict(mode="width", target=0.99), "less than one channel per head"),
    (dict(mode="depth", target=0.9), "would remove all 2 blocks"),
    (dict(mode="depth", target=0.1), "removes no block"),
    (dict(mode="row", importance="taylor"), "--importance taylor applies to --mode width"),
    (dict(mode="weight", distill=True), "--distill applies to the structured modes"),
    (dict(mode="width", distill=True, finetune_steps=0), "--distill needs fine-tuning steps"),
    (dict(mode="width", distill=True, distill_alpha=1.5), "--distill-alpha must be between 0 and 1"),
])
def test_bad_structured_input_is_refused_before_anything_is_written(trained, kw, needle):
    tmp, artifact = trained
    before = sorted(p.name for p in (tmp / "runs" / "s").iterdir())
    with pytest.raises(EffkitError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        run_prune(prune_cfg(tmp, artifact, **kw), progress=False)
    assert sorted(p.name for p in (tmp / "runs" / "s").iterdir()) == before


def test_distillation_is_on_by_default_for_the_structured_modes_only():
    modes = ("row", "width", "depth", "weight")
    assert [PruneConfig.from_flat(fixed_rounds=True, mode=m).distilling for m in modes] == [True, True, True, False]
    assert PruneConfig.from_flat(fixed_rounds=True, mode="row").label == "row-distill"
    assert PruneConfig.from_flat(fixed_rounds=True, mode="weight").label == "weight"
    assert not PruneConfig.from_flat(fixed_rounds=True, mode="row", distill=False).distilling  # --no-distill
    assert not PruneConfig.from_flat(fixed_rounds=True,
                                     mode="row", finetune_steps=0).distilling  # nothing to distil without fine-tuning


def test_taylor_importance_needs_calibration_data_and_uses_gradients():
    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512)
    with pytest.raises(EffkitError, match="needs calibration batches"):
        prune_width(model, 32, "taylor", calib=None)
    pruned, done = prune_width(model, 32, "taylor", calib=[ids(4, 32)])
    assert "Taylor" in done["importance"] and pruned.config.n_embd == 32
    by_magnitude, _ = prune_width(model, 32)
    assert not torch.equal(pruned.transformer.wte.weight, by_magnitude.transformer.wte.weight)  # other channels
    assert all(p.grad is None for p in model.parameters())  # the gradients were taken on a copy
    assert valid_width(64, 2, 0.3) == 44  # 44.8 rounded to a multiple of the 2 heads


def test_width_pruning_keeps_a_multiple_of_32_residual_channels_by_default():
    """Every projection reading the residual stream stores rows n_embd long in llama.cpp's blocks of 32: 30% off
    gpt2-nano's 64 channels is 44 at a multiple of its 2 heads, and 32 at the default multiple."""
    from types import SimpleNamespace

    from effkit.prune.structure import Options
    from effkit.prune.width import PRUNER

    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512).eval()
    cfg = PruneConfig.from_flat(fixed_rounds=True, mode="width", target=0.3)  # no option set: the default
    assert PRUNER.plan(cfg, model)["n_embd"].startswith("64 -> 32 (")
    pruned, done, _ = PRUNER.start(cfg, model)(model, 0.3, None)
    assert (pruned.config.n_embd, pruned.transformer.wte.weight.shape[1], done["head_dim"]) == (32, 32, 16)
    # the round's report: the rounded width and the fraction it reached (not the 30% asked)
    assert (done["n_embd"], done["width_multiple"], done["target"], done["fraction_reached"]) == (32, 32, 0.3, 0.5)
    # the width is rounded, the channels are the ones the group importance picks for that width, as before
    by_hand, _ = prune_width(model, 32)
    assert torch.equal(pruned.transformer.wte.weight, by_hand.transformer.wte.weight)
    # 1: rounded to the heads alone, the width effkit kept before the option
    old, done, _ = PRUNER.start(SimpleNamespace(method=cfg.method, options=Options(width_multiple=1)), model)(
        model, 0.3, None)
    assert old.config.n_embd == done["n_embd"] == 44 == valid_width(64, 2, 0.3)
    # heads that do not divide 32 (gpt2-mini's 6): a multiple of both, 96; 270 unrounded
    assert (valid_width(384, 6, 0.3, 32), valid_width(384, 6, 0.3, 1)) == (288, 270)
