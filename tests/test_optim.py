"""--optim: 8-bit AdamW trains like AdamW, resumes exactly, and the report says which library ran it; fp16's
scaler state survives a checkpoint and its overflow decision is agreed across ranks; TF32 and the MFU peak are
chosen by the precision actually used and the exact GPU name."""

import csv
from pathlib import Path

import pytest
import torch

from effkit import optim
from effkit.checkpoint import _flatten_optimizer, _unflatten_optimizer, load_checkpoint, save_checkpoint
from effkit.errors import EffkitError, Interrupted
from effkit.measure import hardware, roofline
from effkit.train import make_scaler, train

pytest.importorskip("bitsandbytes")  # the dev extra installs it: a broken install fails below instead


def losses(report):
    path = Path(report["config"]["run"]["reports_dir"]) / report["run"] / "train_steps.csv"
    return [float(r["loss"]) for r in csv.DictReader(path.open())]


def test_adamw8bit_trains_within_2_percent_of_adamw_and_resumes_exactly(tiny_cfg):
    kw = dict(max_steps=30, warmup_steps=5, lr=3e-3)
    base = train(tiny_cfg(run_name="adamw", **kw), progress=False)
    eight = train(tiny_cfg(run_name="a8", optim="adamw8bit", **kw), progress=False)
    assert "bitsandbytes" in eight["what_ran"]["optimizer"] and "AdamW8bit" in eight["what_ran"]["optimizer"]
    assert eight["what_ran"]["optimizer"].startswith("adamw8bit")
    assert base["what_ran"]["optimizer"].startswith("adamw: torch.optim.AdamW")
    assert losses(eight) != losses(base)  # the 8-bit moments really ran
    assert eight["metrics"]["eval_loss"] == pytest.approx(base["metrics"]["eval_loss"], rel=0.02)
    assert losses(eight)[-1] < losses(eight)[0] - 0.5  # it learned

    def stop_at_12(step, loss):
        if step == 12:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="step 12"):
        train(tiny_cfg(run_name="a8cut", optim="adamw8bit", **kw), on_step=stop_at_12, progress=False)
    resumed = train(tiny_cfg(run_name="a8cut", resume=True), progress=False)
    assert resumed["what_ran"]["resumed_from_step"] == 12
    assert losses(resumed) == pytest.approx(losses(eight), rel=1e-6, abs=1e-7)


def test_optimizer_state_with_nested_dicts_and_tensor_subclasses_round_trips(tmp_path):
    """bitsandbytes nests its 8-bit state in a dict; torchao's moments are tensor subclasses: both go through
    safetensors and JSON and come back equal."""
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    tensors, meta = _flatten_optimizer(sd)
    assert any(k.endswith("/state1") for k in tensors) and tensors[next(k for k in tensors
                                                                        if k.endswith("/state1"))].dtype == torch.uint8
    back = _unflatten_optimizer(tensors, meta)
    inner = back["state"][0]["__bnb_optimizer_quant_state__"]
    assert torch.equal(inner["state1"], sd["state"][0]["__bnb_optimizer_quant_state__"]["state1"])
    opt2 = bnb.optim.AdamW8bit([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    opt2.load_state_dict(back)

    sub = pytest.importorskip("torchao.optim.subclass_8bit")
    state8 = sub.OptimState8bit.zeros((64, 256), signed=True)
    state8.codes.random_(0, 255)
    fake = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": state8}},
            "param_groups": [{"lr": torch.tensor(0.01), "params": [0]}]}
    tensors, meta = _flatten_optimizer(fake)
    assert "0.exp_avg#codes" in tensors and meta["subclasses"]["0.exp_avg"]["parts"] == ["codes", "scale", "qmap"]
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(1)}, fake, {"base_lrs": [torch.tensor(0.01)]}, 3,
                    {"config": {}, "rows": []})
    back = load_checkpoint(tmp_path / "ck")
    got = back["optimizer"]["state"][0]["exp_avg"]
    assert type(got) is sub.OptimState8bit and torch.equal(got.codes, state8.codes)
    assert torch.equal(got.dequantize(), state8.dequantize())
    assert torch.is_tensor(back["optimizer"]["param_groups"][0]["lr"])  # torchao needs a tensor lr back
    assert float(back["scheduler"]["base_lrs"][0]) == pytest.approx(0.01)


def test_unknown_optimizer_is_one_line(tiny_cfg):
    with pytest.raises(EffkitError, match="unknown --optim .*; choose one of adamw, adamw-fused, adamw8bit"):
        tiny_cfg(optim="sgd").validate()


def test_8bit_library_follows_the_parameters():
    """Plain tensors go to bitsandbytes; DTensors (fsdp/tp), which its kernels do not take, to torchao."""
    model = torch.nn.Linear(64, 64)
    _, lib = optim.build_optimizer(model, "adamw8bit", 1e-3, 0.1)
    assert lib.startswith("bitsandbytes")
    _, lib = optim.build_optimizer(model, "adamw", 1e-3, 0.1)
    assert "fused" in lib
    pytest.importorskip("torchao.optim")
    opt, lib = optim.get("adamw8bit").build([{"params": list(model.parameters())}], 1e-3, True)
    assert lib.startswith("torchao") and torch.is_tensor(opt.param_groups[0]["lr"])


# ---------------------------------------------------------------------------------------------- fp16 scaler

def test_scaler_skips_a_step_when_another_rank_overflowed(monkeypatch):
    """Across processes the scaler all-reduces its found-inf flag: this rank's gradients are finite, a fake
    all-reduce reports another rank's overflow, and the step is skipped here too (the scale backs off)."""
    import torch.distributed.fsdp.sharded_grad_scaler as sgs

    calls = []

    class Done:
        def wait(self):
            pass

    def fake_all_reduce(t, *a, **k):  # another rank found an inf
        calls.append(t.clone())
        t.fill_(1.0)
        return Done()

    monkeypatch.setattr(sgs.dist, "all_reduce", fake_all_reduce)
    scaler = make_scaler(torch.device("cpu"), enabled=True, distributed=True)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * 2).sum()).backward()
    scale_before = scaler.get_scale()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert calls and float(calls[0].sum()) == 0.0  # this rank itself saw no overflow
    assert torch.equal(w.detach(), torch.ones(4))  # skipped
    assert scaler.get_scale() == scale_before * 0.5
    assert type(make_scaler(torch.device("cpu"), enabled=True, distributed=False)).__name__ == "GradScaler"


def test_checkpoint_round_trips_the_scaler_state(tmp_path):
    from types import SimpleNamespace

    from effkit.checkpoint import Checkpointer

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):  # two good steps: the growth tracker counts them
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    par = SimpleNamespace(full_state_dict=lambda: {"w": w.detach()}, optimizer_state=lambda o: o.state_dict(),
                          rt=SimpleNamespace(is_main=True, barrier=lambda: None))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(2, par, opt, sched, {}, [], scaler=scaler)
    loaded = ck.load()
    fresh = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=3)
    fresh.load_state_dict(loaded.scaler)
    assert fresh.state_dict() == scaler.state_dict()
    assert loaded.scaler["_growth_tracker"] == 2 and loaded.scaler["scale"] == 1024.0
    ck.save(2, par, opt, sched, {}, [], scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert ck.load().scaler is None  # no scaler, nothing saved


# ---------------------------------------------------------------------------------------------- TF32 and peaks

def test_mfu_peak_follows_the_precision_and_the_exact_gpu_name(monkeypatch):
    assert roofline.matmul_precision(None, tf32=True) == "tf32"
    assert roofline.matmul_precision(None, tf32=False) == "fp32"
    assert roofline.matmul_precision(torch.bfloat16, tf32=False) == "bf16"
    sxm, src = roofline.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    pcie, _ = roofline.gpu_peak_flops("NVIDIA H100 PCIe", "bf16")
    assert sxm > pcie and "data sheet" in src and "NVIDIA H100 80GB HBM3" in src
    assert roofline.gpu_peak_flops("NVIDIA L40", "bf16")[0] != roofline.gpu_peak_flops("NVIDIA L4", "bf16")[0]
    tf32, _ = roofline.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "tf32")
    fp32, _ = roofline.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32")
    assert tf32 == 8 * fp32
    assert roofline.gpu_peak_flops("NVIDIA H100", "bf16")[0] is None  # a prefix is not a name
    assert roofline.gpu_peak_flops("Tesla T4", "tf32")[0] is None

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    dev = torch.device("cuda", 0)
    assert roofline.peak_flops(dev, torch.float32, tf32=True)[0] == tf32
    assert roofline.peak_flops(dev, torch.float32, tf32=False)[0] == fp32


def test_tf32_is_set_only_where_the_gpu_has_it(monkeypatch):
    assert hardware.set_tf32(torch.device("cpu"), True) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert hardware.tf32_supported(torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert hardware.tf32_supported(torch.device("cuda", 0)) is True
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        assert hardware.set_tf32(torch.device("cuda", 0), True) is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert hardware.set_tf32(torch.device("cuda", 0), False) is False
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:  # process-wide switches: later tests (torch.export) must see them as they were
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before
