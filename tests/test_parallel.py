"""Every parallel mode, with 2 gloo processes and the same global batch, follows the single-process loss curve
(fp32), and every mode saves one full Hugging Face artifact with the same logits. Every multi-process test is
guarded by a timeout, so a hang fails fast."""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from effkit.config import TrainConfig
from effkit.train import train

STEPS = 5
GLOBAL_BATCH = 4
# mode name -> (parallel, sync, per-rank batch with 2 processes, other options)
MODES = {
    "ddp": ("ddp", "ddp", GLOBAL_BATCH // 2, {}),
    "all-reduce": ("ddp", "all-reduce", GLOBAL_BATCH // 2, {}),
    "gather-scatter": ("ddp", "gather-scatter", GLOBAL_BATCH // 2, {}),
    "fsdp": ("fsdp", "ddp", GLOBAL_BATCH // 2, {}),
    "tp": ("tp", "ddp", GLOBAL_BATCH, {}),  # both ranks see the same batch
    "fsdp+tp": ("fsdp+tp", "ddp", GLOBAL_BATCH, {}),  # 2 processes: a (dp=1, tp=2) mesh
    # two stages of one block each; both see the same batch, in 4 micro-batches
    "pp-gpipe": ("pp", "ddp", GLOBAL_BATCH, {"pp_schedule": "gpipe", "microbatches": 4}),
    "pp-1f1b": ("pp", "ddp", GLOBAL_BATCH, {"pp_schedule": "1f1b", "microbatches": 4}),
    "pp+fsdp": ("pp+fsdp", "ddp", GLOBAL_BATCH, {"microbatches": 2}),  # 2 processes: a (pp=2, dp=1) mesh
}
# 8-bit AdamW runs: name -> (parallel, per-rank batch, other options)
EIGHT_BIT = {
    "fsdp-8bit": ("fsdp", GLOBAL_BATCH // 2, {}),
    "tp-8bit": ("tp", GLOBAL_BATCH, {}),
    "pp+fsdp-8bit": ("pp+fsdp", GLOBAL_BATCH, {"microbatches": 2}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, base: dict, out_path: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    results = {}
    for name, (parallel, sync, batch, other) in MODES.items():
        cfg = TrainConfig.from_flat(**{**base, "parallel": parallel, "sync": sync, "batch_size": batch,
                                       "run_name": name, "threads": 1, **other})
        report = train(cfg, progress=False)
        if rank == 0:
            results[name] = {"applied": report["what_ran"]["parallel"], "world": report["what_ran"]["world_size"],
                             "detail": report["what_ran"]["parallel_detail"], "artifact": report["artifact"]}
    # 8-bit AdamW on sharded parameters (torchao: DTensor states): row shards (fsdp), column shards (tp) and
    # pipeline stages with fsdp, each interrupted at step 3 and resumed
    from effkit.errors import Interrupted

    def stop_at_3(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    import functools
    from unittest import mock

    for name, (parallel, batch, other) in EIGHT_BIT.items():
        eight = {**base, "parallel": parallel, "batch_size": batch, "threads": 1, "optim": "adamw8bit", **other}
        # torchao compiles its step once per local shard shape, which each layout has its own of: fsdp's runs trace
        # the step on DTensor shards through Dynamo and AOTAutograd as users' compiled step does, without Inductor's
        # code generation (test_optim runs the step Inductor builds); the other layouts run the same step eagerly
        # (their 8-bit states, shards and checkpoints are what they test, and they do not depend on the compiler)
        step = functools.partial(torch.compile, backend="aot_eager") if name == "fsdp-8bit" else lambda fn, **_: fn
        with mock.patch.object(torch, "compile", step):
            report = train(TrainConfig.from_flat(**eight, run_name=name), progress=False)
            try:
                train(TrainConfig.from_flat(**eight, run_name=f"{name}-cut"), on_step=stop_at_3, progress=False)
            except Interrupted:
                pass
            resumed = train(TrainConfig.from_flat(**eight, run_name=f"{name}-cut", resume=True), progress=False)
        if rank == 0:
            results[name] = {"optimizer": report["what_ran"]["optimizer"], "applied": report["what_ran"]["parallel"],
                             "resumed_from": resumed["what_ran"]["resumed_from_step"]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()


def _losses(reports_dir, run):
    import csv

    with open(os.path.join(reports_dir, run, "train_steps.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("parallel")
    base = dict(model="gpt2-nano", data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=4,
                max_steps=STEPS, warmup_steps=2, eval_interval=0, checkpoint_interval=0, warmup_steps_excluded=1,
                runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"), lr=3e-3, amp=False)  # fp32 compared
    single = train(TrainConfig.from_flat(**{**base, "batch_size": GLOBAL_BATCH, "run_name": "single"}), progress=False)
    out = tmp / "results.json"
    mp.start_processes(_worker, args=(_free_port(), base, str(out)), nprocs=2, start_method="spawn")
    return base, single, json.loads(out.read_text())


@pytest.mark.parametrize("mode", list(MODES))
def test_loss_matches_single_process(mode, parallel_runs):
    base, single, results = parallel_runs
    ref = _losses(base["reports_dir"], "single")
    got = _losses(base["reports_dir"], mode)
    assert len(got) == len(ref) == STEPS
    assert got == pytest.approx(ref, rel=2e-5, abs=2e-5), (mode, got, ref)
    assert results[mode]["world"] == 2


@pytest.mark.parametrize("mode, applied", [("ddp", "ddp"), ("all-reduce", "data-parallel (all-reduce)"),
                                           ("gather-scatter", "data-parallel (gather-scatter)"), ("fsdp", "fsdp"),
                                           ("tp", "tp"), ("fsdp+tp", "fsdp+tp"), ("pp-gpipe", "pp"),
                                           ("pp-1f1b", "pp"), ("pp+fsdp", "pp+fsdp")])
def test_mode_is_read_back_from_the_model(mode, applied, parallel_runs):
    _, _, results = parallel_runs
    assert results[mode]["applied"] == applied
    assert results[mode]["detail"]["process_group_world_size"] == 2


def test_sharded_modes_hold_fewer_parameter_bytes(parallel_runs):
    _, _, results = parallel_runs
    full = results["ddp"]["detail"]["param_bytes_this_rank"]
    assert results["fsdp"]["detail"]["param_bytes_this_rank"] < 0.6 * full
    assert results["tp"]["detail"]["param_bytes_this_rank"] < full
    assert results["pp-1f1b"]["detail"]["param_bytes_this_rank"] < full  # rank 0: the embeddings and block 0


@pytest.mark.parametrize("mode, schedule", [("pp-gpipe", "ScheduleGPipe"), ("pp-1f1b", "Schedule1F1B"),
                                            ("pp+fsdp", "Schedule1F1B")])
def test_pipeline_stages_and_the_tied_embedding(mode, schedule, parallel_runs):
    detail = parallel_runs[2][mode]["detail"]
    assert detail["pp_schedule"] == schedule and detail["pp_size"] == 2
    assert detail["stage_of_this_rank"] == 0 and detail["blocks_of_this_rank"] == [0, 1]  # report from rank 0
    # the embedding (first stage) and the LM head (last stage) are two copies of one tied weight: still equal
    assert detail["tied_embedding"].startswith("gradients summed") and detail["tied_copies_max_abs_diff"] == 0.0


def test_saved_artifacts_of_all_modes_give_the_same_logits(parallel_runs):
    _, single, results = parallel_runs
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_model = AutoModelForCausalLM.from_pretrained(single["artifact"]).eval()
    with torch.no_grad():
        ref = ref_model(x).logits
        for mode, r in results.items():
            if "artifact" not in r:
                continue
            logits = AutoModelForCausalLM.from_pretrained(r["artifact"]).eval()(x).logits
            assert torch.allclose(logits, ref, atol=2e-4, rtol=1e-4), mode


@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_8bit_adamw_on_sharded_parameters_trains_and_resumes(name, parallel_runs):
    """torchao's AdamW8bit holds 8-bit states of each rank's shard; its checkpoint (gathered, then re-sharded)
    resumes the run: exactly for row shards (fsdp, whose 8-bit codes are saved), up to the rounding of quantizing
    the saved values again for tensor-parallel column shards; its loss stays within 2% of AdamW's on the same
    mode."""
    base, _, results = parallel_runs
    r = results[name]
    parallel = EIGHT_BIT[name][0]
    assert r["applied"] == parallel and r["optimizer"].startswith("adamw8bit: torchao")
    assert r["resumed_from"] == 3
    eight = _losses(base["reports_dir"], name)
    resumed = _losses(base["reports_dir"], f"{name}-cut")
    exact = pytest.approx(eight, rel=2e-6) if parallel == "tp" else pytest.approx(eight, rel=1e-6, abs=1e-7)
    assert resumed == exact
    adamw = _losses(base["reports_dir"], parallel)
    assert eight != adamw and eight[-1] == pytest.approx(adamw[-1], rel=0.02)


def _cli_args(args, tmp_path):
    import sys

    return [sys.executable, "-m", "effkit", "train", "--model", "gpt2-nano", "--vocab-size", "512", "--block-size",
            "32", "--eval-blocks", "4", "--no-amp", "--warmup-steps", "1", "--eval-interval", "0",
            "--checkpoint-interval", "0",
            "--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "reports"), *args]


@pytest.fixture
def cli_here(tmp_path, capsys, monkeypatch):
    """`effkit train ARGS` through the CLI in this process (its ranks forked from this process' server, as a
    command's are from its own): where the failure handling is what is tested, not a fresh interpreter.
    cli_here(args, env) -> (exit code, what the command printed to stderr)."""
    import sys
    import tempfile

    from effkit import cli

    def run(args, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(tempfile, "tempdir", None)  # $TMPDIR read again
        monkeypatch.setattr(sys, "argv", ["effkit", *_cli_args(args, tmp_path)[3:]])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            cli.main()
        return exc.value.code or 0, capsys.readouterr().err

    return run


def _same_run_as(base: dict) -> list[str]:
    """The command-line options that give a launch the recipe of the module's runs (`parallel_runs`'s `base`), so
    its losses compare with theirs without a reference run of its own."""
    return ["--data", base["data"], "--max-steps", str(base["max_steps"]), "--warmup-steps", str(base["warmup_steps"]),
            "--lr", str(base["lr"])]


@pytest.mark.slow
def test_cli_launches_two_processes(tmp_path, corpus_dir, cli_here):
    code, err = cli_here(["--data", str(corpus_dir), "--parallel", "ddp", "--nproc", "2", "--max-steps", "3",
                          "--batch-size", "2", "--run-name", "cli"])
    assert code == 0, err[-2000:]
    report = json.loads((tmp_path / "reports" / "cli" / "train.json").read_text())
    assert report["what_ran"]["parallel"] == "ddp"
    assert report["what_ran"]["world_size"] == 2  # read back from the process group
    assert len(report["metrics"]["peak_memory_bytes_per_rank"]) == 2
    assert (tmp_path / "runs" / "cli" / "train" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_crashing_rank_stops_the_others_and_is_named(tmp_path, corpus_dir, cli_here):
    import time

    t0 = time.monotonic()
    code, err = cli_here(["--data", str(corpus_dir), "--parallel", "ddp", "--nproc", "2", "--max-steps", "50",
                          "--batch-size", "2", "--run-name", "crash"], env={"EFFKIT_FAULT_INJECT": "1:2"})
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("effkit: error: rank 1 failed: RuntimeError: fault injected at step 2"), err[-2000:]
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 150
    assert not (tmp_path / "runs" / "crash" / "train").exists()


@pytest.mark.parametrize("args, needle", [
    (["--parallel", "tp", "--nproc", "3"], "tensor-parallel size 3 does not divide the model's 2 attention heads"),
    (["--parallel", "fsdp+tp", "--nproc", "2", "--tp-size", "4"], "divisible by --tp-size 4"),
    (["--parallel", "ddp", "--nproc", "-1"], "--nproc must be at least 1"),
    (["--nproc", "2"], "need a parallel mode"),
    (["--parallel", "fsdp", "--cpu-offload"], "there is no GPU here"),
    (["--parallel", "fsdp", "--sync", "all-reduce"], "use it with --parallel ddp"),
    (["--parallel", "pp", "--nproc", "3", "--batch-size", "3", "--microbatches", "3"],
     "3 pipeline stages for a model of 2 blocks"),
    (["--parallel", "pp", "--nproc", "2", "--microbatches", "1", "--batch-size", "4"],
     "1f1b needs at least as many micro-batches as stages"),
    (["--parallel", "pp", "--nproc", "2", "--microbatches", "3", "--batch-size", "4"],
     "--microbatches 3 must divide --batch-size 4"),
    (["--parallel", "pp", "--nproc", "2", "--pp-schedule", "zb"], "unknown --pp-schedule 'zb'"),
    (["--parallel", "pp", "--nproc", "1"], "pipeline parallelism needs at least 2 stages"),
    (["--parallel", "pp+fsdp", "--nproc", "3"], "divisible by --pp-size 2"),
    (["--parallel", "ddp", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in [0, --nnodes)"),
    (["--parallel", "ddp", "--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid"],
     "does not resolve"),
    (["--parallel", "ddp", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--connect-timeout", "1"],
     "node 0 did not answer at 127.0.0.1:1 within 1 s"),
])
def test_bad_process_layouts_fail_before_launch(args, needle, tmp_path, corpus_dir, capsys, monkeypatch):
    import sys

    from effkit import cli

    monkeypatch.setattr(sys, "argv", ["effkit", "train", "--model", "gpt2-nano", "--data", str(corpus_dir),
                                      "--runs-dir", str(tmp_path / "runs"), "--run-name", "bad", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "runs" / "bad").exists()


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_and_nothing_is_left(tmp_path, corpus_dir, cli_here):
    code, err = cli_here(["--data", str(corpus_dir), "--parallel", "ddp", "--nproc", "2", "--max-steps", "50",
                          "--batch-size", "2", "--run-name", "killed"], env={"EFFKIT_FAULT_INJECT": "1:2:kill"})
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("effkit: error: rank 1 was killed by SIGKILL"), err[-2000:]
    assert not (tmp_path / "runs" / "killed").exists()  # the launch files lived in a temporary folder


@pytest.mark.slow
def test_two_nodes_on_localhost_finish_and_match_single_process(tmp_path, parallel_runs):
    import subprocess

    base, _, _ = parallel_runs
    port = str(_free_port())
    nodes = [subprocess.Popen(_cli_args([*_same_run_as(base), "--parallel", "ddp", "--nnodes", "2", "--nproc", "1",
                                         "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port,
                                         "--batch-size", str(GLOBAL_BATCH // 2), "--threads", "1",
                                         "--run-name", "nodes"], tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-1500:] for o in outs]
    assert "node 1: training finished" in outs[1][0]
    report = json.loads((tmp_path / "reports" / "nodes" / "train.json").read_text())
    assert report["what_ran"]["world_size"] == 2 and report["what_ran"]["parallel"] == "ddp"
    ref = _losses(base["reports_dir"], "single")  # the module's single-process run of the same recipe
    assert _losses(str(tmp_path / "reports"), "nodes") == pytest.approx(ref, rel=2e-5, abs=2e-5)


def test_a_multi_node_run_needs_a_run_name(tmp_path, corpus_dir, capsys, monkeypatch):
    import sys

    from effkit import cli

    monkeypatch.setattr(sys, "argv", ["effkit", "train", "--model", "gpt2-nano", "--data", str(corpus_dir),
                                      "--runs-dir", str(tmp_path / "runs"), "--parallel", "ddp", "--nnodes", "2",
                                      "--nproc", "1"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "needs the same --run-name on every node" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_bad_value_found_inside_the_ranks_exits_2_in_one_line(tmp_path, corpus_dir, cli_here):
    (tmp_path / "tmp").mkdir()
    code, err = cli_here(["--data", str(corpus_dir), "--parallel", "ddp", "--nproc", "2", "--max-steps", "20",
                          "--lr", "1e4", "--batch-size", "2", "--run-name", "diverge"],
                         env={"TMPDIR": str(tmp_path / "tmp")})
    assert code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("effkit:")]
    assert len(errors) == 1 and "training diverged" in errors[0] and "lower --lr" in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "diverge").exists() and not (tmp_path / "reports" / "diverge").exists()
    assert not list((tmp_path / "tmp").glob("effkit-*"))  # nor the launch's folder, which the one line does not name


@pytest.mark.slow
def test_a_killed_pipeline_run_resumes_to_the_same_losses(tmp_path, parallel_runs, cli_here, monkeypatch):
    base, _, _ = parallel_runs
    _, _, batch, other = MODES["pp-1f1b"]
    args = [*_same_run_as(base), "--parallel", "pp", "--nproc", "2", "--batch-size", str(batch), "--threads", "1",
            "--pp-schedule", other["pp_schedule"], "--microbatches", str(other["microbatches"]), "--run-name", "cut"]
    code, err = cli_here([*args, "--checkpoint-interval", "2"], env={"EFFKIT_FAULT_INJECT": "1:4:kill"})
    assert code == 1 and "rank 1 was killed by SIGKILL" in err
    monkeypatch.delenv("EFFKIT_FAULT_INJECT")
    code, err = cli_here([*args, "--resume"])
    assert code == 0, err[-2000:]
    # the uninterrupted run: the module's pp-1f1b run of the same recipe
    assert _losses(str(tmp_path / "reports"), "cut") == pytest.approx(_losses(base["reports_dir"], "pp-1f1b"),
                                                                      rel=1e-6, abs=1e-6)


def test_the_rank_killed_from_outside_is_named_not_the_one_the_launcher_stopped(tmp_path):
    from effkit.child import Job
    from effkit.errors import WorkerFailed
    from effkit.parallel.launch import raise_worker_failure

    # the agent's exit codes when rank 1 was killed and the agent then stopped rank 0
    with pytest.raises(WorkerFailed, match=r"^rank 1 was killed by SIGKILL; .*\(then rank 0\)"):
        raise_worker_failure(Job(tmp_path), {0: -15, 1: -9}, tmp_path / "launch.log")


def test_a_rank_that_aborts_is_named_with_what_it_printed(tmp_path):
    from effkit.child import Job
    from effkit.errors import WorkerFailed
    from effkit.parallel.launch import raise_worker_failure

    log = tmp_path / "launch.log"  # a CI run's log (shortened): rank 1 aborted as it exited, rank 0 was then stopped
    log.write_text("""terminate called without an active exception
W1125 15:55:39.203000 3453 api.py:1028] Sending process 3456 closing signal SIGTERM
""")
    with pytest.raises(WorkerFailed, match=r"^rank 1 was killed by SIGABRT \(terminate called without an active "
                                           r"exception\); .*\(then rank 0\)"):
        raise_worker_failure(Job(tmp_path), {0: -15, 1: -6}, log)
