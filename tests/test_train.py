import csv
import json
import math
from pathlib import Path

import pytest
import torch

from effkit.errors import EffkitError
from effkit.train import Interrupted, train


def losses(report):
    path = Path(report["config"]["run"]["reports_dir"]) / report["run"] / "train_steps.csv"
    return [float(r["loss"]) for r in csv.DictReader(path.open())]


def test_same_config_gives_the_same_loss_curve(tiny_cfg, tmp_path):
    a = losses(train(tiny_cfg(run_name="a"), progress=False))
    b = losses(train(tiny_cfg(run_name="b"), progress=False))
    assert len(a) == 6
    assert a == b
    assert a[-1] < a[0]  # it learns


def test_report_artifact_and_latest(tiny_cfg, tmp_path):
    report = train(tiny_cfg(eval_interval=3), progress=False)
    rdir = tmp_path / "reports" / "t"
    for name in ("train.json", "summary.md", "summary.csv", "train_steps.csv", "train_loss.png"):
        assert (rdir / name).is_file(), name
    assert (rdir / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((rdir / "train.json").read_text())
    m = data["metrics"]
    assert math.isclose(m["perplexity"], math.exp(m["eval_loss"]), rel_tol=1e-9)
    assert m["train_tokens_per_s"] > 0 and m["params"] > 0 and m["size_bytes"] > 0
    assert len(m["peak_memory_bytes_per_rank"]) == 1
    assert data["what_ran"]["parallel"] == "none" and data["what_ran"]["world_size"] == 1
    assert {"eval_loss", "train_tokens_per_s", "mfu", "peak_memory"} <= set(data["protocol"])
    assert data["versions"]["torch"] == torch.__version__
    rows = list(csv.DictReader((rdir / "train_steps.csv").open()))
    assert rows[2]["eval_loss"] != "" and rows[-1]["eval_loss"] != ""
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / "runs" / "t").resolve()
    meta = json.loads((tmp_path / "runs" / "t" / "train" / "effkit.json").read_text())
    assert meta["stage"] == "train" and meta["config"]["model"]["name"] == "gpt2-nano"
    assert report["artifact"] == str(tmp_path / "runs" / "t" / "train")


def test_activation_checkpointing_gives_the_same_losses(tiny_cfg):
    plain = train(tiny_cfg(run_name="plain"), progress=False)
    ckpt = train(tiny_cfg(run_name="ckpt", activation_checkpointing=True), progress=False)
    assert ckpt["what_ran"]["activation_checkpointing"] is True
    assert plain["what_ran"]["activation_checkpointing"] is False
    assert losses(ckpt) == pytest.approx(losses(plain), rel=1e-5, abs=1e-6)


def test_bf16_autocast_trains_and_says_so(tiny_cfg):
    report = train(tiny_cfg(run_name="bf16", amp=True, max_steps=3), progress=False)
    assert report["what_ran"]["amp_dtype"] == "bfloat16"
    assert all(math.isfinite(x) for x in losses(report))


def test_fp16_on_cpu_is_refused(tiny_cfg):
    with pytest.raises(EffkitError, match="fp16 autocast does nothing on CPU"):
        train(tiny_cfg(amp=True, amp_dtype="fp16"), progress=False)


def test_resume_after_interrupt_matches_uninterrupted_run(tiny_cfg):
    full = losses(train(tiny_cfg(run_name="full", grad_accum=2), progress=False))

    def stop_at_3(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="step 3"):
        train(tiny_cfg(run_name="cut", grad_accum=2), on_step=stop_at_3, progress=False)
    resumed = train(tiny_cfg(run_name="cut", resume=True), progress=False)
    assert resumed["what_ran"]["resumed_from_step"] == 3
    assert losses(resumed) == pytest.approx(full, rel=1e-6, abs=1e-7)
