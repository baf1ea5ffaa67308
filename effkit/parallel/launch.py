"""Starting the processes of a multi-process run through Accelerate's launcher, and mapping their failures
to one clear line.

CPU: gloo, `ACCELERATE_USE_CPU=1` (without it `accelerate launch` on a CPU-only machine starts N processes that
each think they are alone); GPU: nccl, one GPU per process. Each process runs one job of the child-process protocol
(`python -m effkit.child JOB`, see `effkit.child`), which calls `effkit.worker.train_rank`: it joins the process
group (`runtime.init_distributed`) and trains.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from effkit.child import Job
from effkit.config import ParallelConfig
from effkit.errors import EffkitError, WorkerFailed

WORKER_TARGET = "effkit.worker:train_rank"


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def nproc_per_node(p: ParallelConfig) -> int:
    """--nproc resolved on this machine (0 = one per GPU, or 2 on CPU), checked against its GPUs."""
    nproc = p.nproc or default_nproc()
    if nproc < 1:
        raise EffkitError(f"--nproc must be at least 1 (got {nproc})")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise EffkitError(f"--nproc {nproc} asks for more processes than this machine's "
                          f"{torch.cuda.device_count()} GPU(s); use --nproc {torch.cuda.device_count()} or fewer")
    return nproc


def launch_command(p: ParallelConfig, job: Job) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command line and environment (also shown by `effkit run --dry-run`)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(p.nproc * p.nnodes),
           "--num_machines", str(p.nnodes), "--machine_rank", str(p.node_rank),
           "--main_process_ip", p.master_addr, "--main_process_port", str(p.master_port),
           "--mixed_precision", "no", "--dynamo_backend", "no", "--max_restarts", "0", "--monitor_interval", "1",
           "--multi_gpu", *job.module_args()]  # multi_gpu = torchrun, CPU too
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(p.threads or 1))
    return cmd, env


def wait_for_master(p: ParallelConfig) -> None:
    """Before launching: the master address must resolve, and a node other than 0 waits (up to
    `p.connect_timeout` s) until node 0 listens on it, so a wrong address fails in one line instead of hanging."""
    import socket
    import time

    try:
        socket.getaddrinfo(p.master_addr, p.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise EffkitError(f"--master-addr {p.master_addr!r} does not resolve ({e}); give node 0's address") from None
    if p.nnodes == 1 or p.node_rank == 0:
        return
    deadline = time.monotonic() + p.connect_timeout
    while True:
        try:
            with socket.create_connection((p.master_addr, p.master_port), timeout=min(5.0, p.connect_timeout)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise EffkitError(f"node 0 did not answer at {p.master_addr}:{p.master_port} within "
                                  f"{p.connect_timeout:g} s ({e.strerror or e}); start node 0 first, check "
                                  "--master-addr/--master-port and the firewall, or raise --connect-timeout") from None
            time.sleep(0.5)


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kwargs: dict[str, Any], p: ParallelConfig, run_name: str, target: str = WORKER_TARGET) -> Any:
    """Run `train_rank(**kwargs)` (or `target`'s function) in `p.nproc` processes per node; wait; return what rank 0
    returned (None where it runs on another node); raise a one-line error naming the rank that failed first. One
    machine: the rendezvous takes a free port (as `torchrun --standalone`), so two runs on one machine do not collide
    on --master-port. The job folder (the call, per-rank error records, the launcher's log) is temporary: removed
    after a success and named in the error after a failure, so a failed launch leaves nothing in the run's folder."""
    if p.nnodes == 1:
        p = p.replace(master_port=free_port())
    wait_for_master(p)
    job = Job.create(target, kwargs, prefix=f"effkit-launch-{run_name}-")
    log = job.folder / "launch.log"
    cmd, env = launch_command(p, job)
    with log.open("w") as err:  # the launcher's and workers' stderr: warnings, and tracebacks on a crash
        proc = subprocess.run(cmd, env=env, stderr=err)
    if proc.returncode != 0:
        raise_worker_failure(job, proc.returncode, log)
    result = job.result() if job.result_path.is_file() else None  # rank 0's, where it runs on this node
    job.remove()
    return result


# torchrun's failure summary: "rank      : 1 (local_rank: 1)" then "exitcode  : -9 (pid: 123)  (SIGKILL)"
_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG[A-Z]+)\))?\s*\n")


def killed_ranks(log: Path) -> dict[int, str]:
    """Ranks the launcher saw die by a signal (they could not record an error themselves): {rank: signal}."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {int(rank): sig or f"signal {-int(code)}" for rank, code, sig in _FAILURE.findall(text) if int(code) < 0}


# what a process prints as it aborts: a C++ exception nobody caught, or the interpreter's own fatal error
_FATAL = re.compile(r"^(terminate called [^\n]*|\s*what\(\):[^\n]*|Fatal Python error:[^\n]*)$", re.M)


def fatal_reason(log: Path) -> str:
    """What a dying process printed about why, as ' (terminate called ...)'; empty when it printed nothing."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = [m.strip() for m in _FATAL.findall(text)]
    return f" ({' '.join(found[-2:])})" if found else ""


def raise_worker_failure(job: Job, code: int, log: Path) -> None:
    """Name the rank that failed first: one killed by a signal (the others then lose their peer), else the
    earliest error a rank recorded itself."""
    failures = job.failures()
    recorded = {r["rank"] for r in failures}
    killed = {r: sig for r, sig in killed_ranks(log).items() if r not in recorded}
    if killed:
        # the launcher stops the surviving ranks with SIGTERM: a rank killed by another signal is the cause
        first = min({r for r, sig in killed.items() if sig not in ("SIGTERM", "signal 15")} or killed)
        others = sorted({*killed, *recorded} - {first})
        tail = f" (then rank {', '.join(map(str, others))})" if others else ""
        raise WorkerFailed(f"rank {first} was killed by {killed[first]}{fatal_reason(log)}; the other processes "
                           f"were stopped{tail}; launcher log in {log}")
    if not failures:
        raise WorkerFailed(f"the distributed launch failed (exit code {code}) before any rank reported an error; "
                           f"see {log}")
    first = failures[0]  # the root cause; the others typically lost their peer
    others = [str(r["rank"]) for r in failures[1:]]
    tail = f" (then rank {', '.join(others)})" if others else ""
    if first["kind"] == "user":  # bad input: the one line says all; the job folder is not named, so not kept
        job.remove()
        raise EffkitError(f"rank {first['rank']}: {first['message']}{tail}")
    raise WorkerFailed(f"rank {first['rank']} failed: {first['message']}; the other processes were stopped{tail}; "
                       f"traceback in {log}")
