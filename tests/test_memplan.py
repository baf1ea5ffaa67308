"""The memory plan: simulated on fake tensors (nothing allocated), its two-point extrapolation equal to the full
simulation, the same accounting as real tensors, the tricks moving it the way they must, and every training
report putting it beside the measured peak."""

import contextlib
import json
import subprocess
import sys

import pytest
from transformers import GPT2Config

from effkit import memplan
from effkit.config import TrainConfig

MC = GPT2Config(vocab_size=512, n_layer=3, n_embd=64, n_head=2, n_positions=64)


def total(d):
    return sum(v for k, v in d.items() if k != "params_count")


@pytest.mark.slow
def test_extrapolation_from_2_and_4_blocks_equals_the_full_simulation():
    deep = GPT2Config(vocab_size=512, n_layer=6, n_embd=64, n_head=2, n_positions=64)
    full = memplan.simulate(deep, 4, 32, checkpointing=True)
    ext = memplan.simulate_layers(deep, 4, 32, 6, checkpointing=True)
    assert total(ext) == pytest.approx(total(full), rel=0.03)
    full = memplan.simulate(MC, 4, 32, checkpointing=False)
    assert full["optimizer"] == pytest.approx(2 * full["parameters"], rel=1e-3)  # AdamW: two fp32 moments


def test_fake_simulation_counts_what_real_tensors_hold(monkeypatch):
    """The same two training steps on real tensors, tracked the same way, peak at the same bytes."""
    fake = memplan._simulate(MC, 4, 32, checkpointing=True)  # the simulation itself, not its cached result
    from torch._subclasses import fake_tensor

    monkeypatch.setattr(fake_tensor, "FakeTensorMode", lambda **k: contextlib.nullcontext())
    real = memplan._simulate(MC, 4, 32, checkpointing=True)
    assert total(real) == pytest.approx(total(fake), rel=0.02)


def test_a_simulation_runs_once_per_shape(monkeypatch):
    """A plan simulates two training steps (seconds); the same shape's next plan reads the result back."""
    first = memplan.simulate(MC, 2, 16, checkpointing=False, layers=2)
    monkeypatch.setattr(memplan, "_simulate", lambda *a, **k: pytest.fail("simulated again"))
    assert memplan.simulate(MC, 2, 16, checkpointing=False, layers=2) == first
    named = MC.__class__.from_dict({**MC.to_dict(), "_name_or_path": "runs/t/train", "architectures": ["GPT2"]})
    assert memplan.simulate(named, 2, 16, checkpointing=False, layers=2) == first  # a saved copy of the shape
    with pytest.raises(pytest.fail.Exception):  # another shape is simulated
        memplan.simulate(MC, 2, 16, checkpointing=True, layers=2)


def test_tricks_move_the_plan_the_way_they_must(tiny_cfg):
    base = memplan.predict(tiny_cfg(batch_size=8))
    eight = memplan.predict(tiny_cfg(batch_size=8, optim="adamw8bit"))
    ac = memplan.predict(tiny_cfg(batch_size=8, activation_checkpointing=True))
    small = memplan.predict(tiny_cfg(batch_size=2))
    assert eight.parts["optimizer"] < base.parts["optimizer"] / 2  # 2 B instead of 8 on the matrices
    assert eight.parts["activations"] == base.parts["activations"]
    assert ac.parts["activations"] < base.parts["activations"]
    assert small.parts["activations"] < base.parts["activations"]
    fsdp = memplan.predict(tiny_cfg(batch_size=8, parallel="fsdp", nproc=2))
    assert fsdp.parts["optimizer"] == base.parts["optimizer"] // 2
    assert fsdp.parts["parameters"] < base.parts["parameters"]
    assert base.steps_bytes == base.total_bytes - base.parts["parameters"] - base.parts["buffers"]


def test_autocast_weight_copies_are_counted_where_the_allocator_keeps_them(tiny_cfg):
    """On a CPU, bf16 autocast's copies of the matrices, freed in the backward, stay in glibc's heap through the
    optimizer step (gpt2-xl at batch 2: 3.0 GiB there, 2.4 GiB above the plan before this part): a plan whose
    peak is that step counts them, in the same bytes as the model's own matrices; fp32 training has none."""
    import torch

    from effkit.model import build_model

    def copies(plan):
        return plan.parts.get(memplan.AUTOCAST_KEPT, 0)

    model = build_model("gpt2-nano", vocab_size=512)
    matrices = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert memplan.autocast_copies(model.config, model.config.n_layer) == 2 * sum(matrices.values())
    cpu = torch.device("cpu")  # glibc's: what a GPU's caching allocator keeps is another matter
    bf16 = memplan.predict(tiny_cfg(batch_size=1, block_size=8, amp=True), cpu)
    r = bf16.parts
    assert copies(bf16) > 0  # the plan covers the optimizer step with the copies beside it
    assert sum(r.values()) - r.get("runtime", 0) >= (2 * r["parameters"] + r["optimizer"]
                                                     + memplan.autocast_copies(model.config, 2))
    assert copies(memplan.predict(tiny_cfg(batch_size=1, block_size=8), cpu)) == 0  # fp32 (amp=False)
    assert copies(memplan.predict(tiny_cfg(batch_size=1, block_size=8, amp=None), cpu)) > 0  # auto may choose bf16


@pytest.mark.slow
def test_fit_proposes_the_cheapest_trick_that_fits(tiny_cfg):
    cfg = tiny_cfg(batch_size=8)
    asked = memplan.predict(cfg, probe=True)  # with this machine's runtime, as fit measures it
    assert asked.parts["runtime"] > 0
    plan, _, changes = memplan.fit(cfg, budget_bytes=asked.total_bytes + 1)
    assert changes == []
    plan, chosen, changes = memplan.fit(cfg, budget_bytes=asked.total_bytes - 1)
    assert changes == ["--optim adamw8bit"] and chosen.optim.optim == "adamw8bit"
    assert plan.total_bytes < asked.total_bytes


@pytest.mark.slow
def test_plan_of_a_1_5b_model_allocates_nothing(tmp_path):
    """`--plan` for gpt2-xl (5.8 GiB of fp32 weights) runs on fake tensors: the process stays far below the
    model, and its plan for plain AdamW is over 22 GiB. The one-block runtime probe, a process of its own whose
    resident set is not this one's, answers with a stand-in: its real steps at gpt2-xl's width would only time
    what the probes of the other tests measure on smaller shapes."""
    code = ("import resource, sys; import effkit.child; from effkit.cli import main\n"
            "effkit.child.run_isolated = lambda *a, **k: {'bytes': 700 * 2**20, 'step_s': 1.0, 'step2_s': 1.2}\n"
            "sys.argv = ['effkit', 'train', '--plan', "
            "'--model', 'gpt2-xl', '--block-size', '64', '--batch-size', '1']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rss_gib = int(out.stdout.split("maxrss_kib")[-1]) / 2**20
    import re

    total_mib = float(re.search(r"total\S*\s*│\s*\S*?([\d,]+)", out.stdout).group(1).replace(",", ""))
    assert total_mib > 22_000  # fp32 weights, gradients and AdamW moments alone: 23 GiB
    assert "fits" in out.stdout or "does not fit" in out.stdout  # against this machine's memory
    assert rss_gib < 2.0, rss_gib  # the weights alone would be 5.8 GiB
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()


def test_train_report_puts_the_plan_beside_the_measured_peak(tiny_cfg):
    from effkit.train import Planned, train_any

    cfg = tiny_cfg(run_name="planned")
    plan = memplan.predict(cfg)
    report = train_any(cfg, planned=Planned(plan.to_dict()))
    mp = report["memory_plan"]
    assert mp["predicted_steps_bytes"] == plan.steps_bytes
    assert mp["measured_steps_bytes"] == max(report["metrics"]["peak_memory_bytes_per_rank"])
    saved = json.loads((tmp_path_of(cfg) / "train.json").read_text())
    assert saved["memory_plan"]["predicted_total_bytes"] == plan.total_bytes
    assert "MemTracker" in saved["protocol"]["memory_plan"]


def tmp_path_of(cfg: TrainConfig):
    from pathlib import Path

    return Path(cfg.run.reports_dir) / cfg.run.run_name


def test_the_plan_prices_a_step_from_the_probes_one_and_two_block_steps():
    """The runtime probe times steps of one and two blocks; a step of the whole model is the one-block step plus,
    per further block, what the second added (where that stands out of the noise; else the FLOPs scale it)."""
    probed = memplan.probe_runtime(MC.to_dict() | {"n_layer": 1}, 2, 16, False, "adamw", None, min_s=0.05,
                                   batches=(1, 2))
    assert probed["bytes"] > 0 and probed["step_s"] > 0 and probed["step2_s"] > 0
    (twice,) = probed["more"]  # the same models at twice the batch, timed in turns with them; memory at the first
    assert twice["bytes"] is None and twice["step_s"] > 0 and twice["step2_s"] > 0
    flops_one, flops_two = (memplan.step_flops(MC, n, 1, 16) for n in (1, 2))
    share = (flops_two - flops_one) / flops_one  # a block's share of the one-block step, by FLOPs
    step = memplan.predicted_step_seconds
    assert step(MC, 6, 16, (1.0, 1.0 + 0.8 * share)) == pytest.approx(1.0 + 5 * 0.8 * share)  # what it added
    assert step(MC, 6, 16, (1.0, 1.0)) == pytest.approx(1.0 + 5 * share / 2)  # noise: at least half the share
    assert step(MC, 6, 16, (1.0, 1.0 + 9 * share)) == pytest.approx(1.0 + 5 * 2 * share)  # at most twice
    assert memplan.step_flops(MC, 2, 10, 16) == 10 * memplan.step_flops(MC, 2, 1, 16)
