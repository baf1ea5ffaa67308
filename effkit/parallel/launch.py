"""Starting processes (through Accelerate's launcher) and joining the process group inside each one.

CPU: gloo, `ACCELERATE_USE_CPU=1` (without it `accelerate launch` on a CPU-only machine starts N processes that
each think they are alone); GPU: nccl, one GPU per process. The world size is always read back from the process
group, never trusted from the flag.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from effkit.errors import EffkitError, WorkerFailed
from effkit.parallel.runtime import Runtime

ERRORS_DIR = ".errors"


def init_distributed(timeout_s: float = 300.0) -> Runtime:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    real_world = dist.get_world_size()
    if real_world != world:
        raise EffkitError(f"WORLD_SIZE says {world} processes but the process group has {real_world}")
    return Runtime(device=device, rank=dist.get_rank(), world_size=real_world, local_rank=local_rank,
                   dp_size=real_world, dp_rank=dist.get_rank(), backend=backend)


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def plan_processes(cfg, n_head: int) -> tuple[int, int]:
    """Validate --nproc / --tp-size against the machine and the model; return (nproc per node, tp size)."""
    nproc = cfg.nproc or default_nproc()
    if nproc < 1:
        raise EffkitError(f"--nproc must be at least 1 (got {nproc})")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise EffkitError(f"--nproc {nproc} asks for more processes than this machine's "
                          f"{torch.cuda.device_count()} GPU(s); use --nproc {torch.cuda.device_count()} or fewer")
    world = nproc * cfg.nnodes
    tp = 1
    if cfg.parallel == "tp":
        tp = world if not cfg.tp_size else cfg.tp_size
        if tp != world:
            raise EffkitError(f"--parallel tp uses all {world} processes for tensor parallelism (--tp-size {tp} "
                              "given); use --parallel fsdp+tp to combine data and tensor parallelism")
    elif cfg.parallel == "fsdp+tp":
        tp = cfg.tp_size or min(world, 2)
        if world % tp:
            raise EffkitError(f"--parallel fsdp+tp needs --nproc x nodes ({world}) divisible by --tp-size {tp}")
    elif cfg.tp_size not in (0, 1):
        raise EffkitError(f"--tp-size {cfg.tp_size} only applies to --parallel tp or fsdp+tp")
    if n_head % tp:
        raise EffkitError(f"tensor-parallel size {tp} does not divide the model's {n_head} attention heads; "
                          f"choose a tp size that divides {n_head}")
    return nproc, tp


def launch(cfg, run_dir: Path) -> int:
    """Run `effkit.parallel.worker` in nproc processes through `accelerate launch`; wait; map failures to a
    clear message. Returns the launcher's exit code (0 on success)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    errors = run_dir / ERRORS_DIR
    shutil.rmtree(errors, ignore_errors=True)
    cfg_path = run_dir / "launch-config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    cmd, env = launch_command(cfg, cfg_path, errors)
    log = run_dir / "launch.log"  # the launcher's and workers' stderr: warnings, and tracebacks on a crash
    with log.open("w") as err:
        proc = subprocess.run(cmd, env=env, stderr=err)
    if proc.returncode != 0:
        raise_worker_failure(errors, proc.returncode, log)
    return proc.returncode


def launch_command(cfg, cfg_path: Path, errors: Path) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command line and environment for `cfg` (also shown by `effkit run --dry-run`)."""
    cpu = not torch.cuda.is_available()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cfg.nproc * cfg.nnodes),
           "--num_machines", str(cfg.nnodes), "--machine_rank", str(cfg.node_rank),
           "--main_process_ip", cfg.master_addr, "--main_process_port", str(cfg.master_port),
           "--mixed_precision", "no", "--dynamo_backend", "no", "--max_restarts", "0", "--monitor_interval", "1",
           "--multi_gpu", "-m", "effkit.parallel.worker", str(cfg_path)]  # multi_gpu = torchrun, CPU too
    env = dict(os.environ, EFFKIT_ERRORS_DIR=str(errors), TOKENIZERS_PARALLELISM="false")
    if cpu:
        env["ACCELERATE_USE_CPU"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads or 1))
    return cmd, env


def raise_worker_failure(errors: Path, code: int, log: Path) -> None:
    reports = sorted(errors.glob("rank*.json")) if errors.is_dir() else []
    if not reports:
        raise WorkerFailed(f"the distributed launch failed (exit code {code}) before any rank reported an error; "
                           f"see {log}")
    failures = sorted((json.loads(p.read_text()) for p in reports), key=lambda r: r["time"])
    first = failures[0]  # the root cause; the others typically lost their peer
    others = [str(r["rank"]) for r in failures[1:]]
    tail = f" (then rank {', '.join(others)})" if others else ""
    if first["kind"] == "user":
        raise EffkitError(f"rank {first['rank']}: {first['message']}{tail}")
    raise WorkerFailed(f"rank {first['rank']} failed: {first['message']}; the other processes were stopped{tail}; "
                       f"traceback in {log}")


def _n_head(model: str) -> int | None:
    from effkit.model import check_preset, is_pretrained_source

    if not is_pretrained_source(model):
        return check_preset(model)["n_head"]
    config = Path(model) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("n_head")
    return None  # a hub id: checked when the model is loaded


def train_in_processes(cfg) -> dict:
    """Validate the process layout here (one line, exit 2), then start the processes through Accelerate."""
    from effkit.artifacts import new_run_name

    if cfg.parallel == "none":
        raise EffkitError("--nproc/--nnodes > 1 need a parallel mode: add --parallel ddp (or fsdp, tp, fsdp+tp)")
    if cfg.cpu_offload and not torch.cuda.is_available():
        raise EffkitError("--cpu-offload moves FSDP parameters from GPU to CPU; there is no GPU here, drop it")
    n_head = _n_head(cfg.model)
    cfg.nproc, _ = plan_processes(cfg, n_head if n_head is not None else 1)
    if not torch.cuda.is_available() and not cfg.threads:
        cfg.threads = max(1, (os.cpu_count() or 1) // cfg.nproc)
    cfg.run_name = cfg.run_name or new_run_name(cfg.model)
    from effkit.train import prepare_data

    prepare_data(cfg)  # bad data fails here in one line, and the tokenizer / token caches are built once
    launch(cfg, Path(cfg.runs_dir) / cfg.run_name)
    report_path = Path(cfg.reports_dir) / cfg.run_name / "train.json"
    return json.loads(report_path.read_text())


def train_any(cfg, **kwargs) -> dict:
    """`effkit train`: in this process, or in launched processes when a parallel mode or several are asked."""
    if cfg.parallel != "none" or cfg.nproc > 1 or cfg.nnodes > 1:
        return train_in_processes(cfg)
    from effkit.train import train

    return train(cfg, **kwargs)
