"""Starting the processes of a multi-process run, and mapping their failures to one clear line.

Each node's ranks are forked from `effkit.child`'s server (not started as fresh interpreters that each import torch
and transformers again) with the environment `accelerate launch` (torchrun under it) gives a rank, and watched here
as torchrun's agent watches them (`run_ranks`). CPU: gloo, `ACCELERATE_USE_CPU=1` (without it Accelerate in a rank
on a CPU-only machine thinks it is alone); GPU: nccl, one GPU per process. Each process runs one job of the
child-process protocol (`effkit.child`), which calls `effkit.worker.train_rank`: it joins the process group
(`runtime.init_distributed`) and trains. `launch_command` is the same launch by hand, through `accelerate launch`.
"""

from __future__ import annotations

import os
import re
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


def launch_env(p: ParallelConfig) -> dict[str, str]:
    """The ranks' environment: this process', and what Accelerate's launcher would add."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", ACCELERATE_MIXED_PRECISION="no",
               ACCELERATE_DYNAMO_BACKEND="NO")
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(p.threads or 1))
    return env


def launch_command(p: ParallelConfig, job: Job) -> tuple[list[str], dict[str, str]]:
    """The same launch by hand: the `accelerate launch` command line and its environment (shown by `effkit run
    --dry-run`)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(p.nproc * p.nnodes),
           "--num_machines", str(p.nnodes), "--machine_rank", str(p.node_rank),
           "--main_process_ip", p.master_addr, "--main_process_port", str(p.master_port),
           "--mixed_precision", "no", "--dynamo_backend", "no", "--max_restarts", "0", "--monitor_interval", "1",
           "--multi_gpu", *job.module_args()]  # multi_gpu = torchrun, CPU too
    return cmd, launch_env(p)


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
    on --master-port. The job folder (the call, per-rank error records, the ranks' log) is temporary: removed
    after a success and named in the error after a failure, so a failed launch leaves nothing in the run's folder."""
    if p.nnodes == 1:
        p = p.replace(master_port=free_port())
    wait_for_master(p)
    job = Job.create(target, kwargs, prefix=f"effkit-launch-{run_name}-")
    log = job.folder / "launch.log"
    exits = run_ranks(p, job, log)
    if exits:
        raise_worker_failure(job, exits, log)
    result = job.result() if job.result_path.is_file() else None  # rank 0's, where it runs on this node
    job.remove()
    return result


STOP_GRACE_S = 10.0  # how long a rank stopped after another failed may take to exit before it is killed


def rank_env(p: ParallelConfig, local_rank: int) -> dict[str, str]:
    """A rank's environment: `launch_env`'s and the variables torchrun gives each rank; its process group meets at
    the master address, where rank 0 holds the store (`init_process_group`'s env://, as a static rendezvous)."""
    return {**launch_env(p), "RANK": str(p.node_rank * p.nproc + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(p.nproc * p.nnodes), "LOCAL_WORLD_SIZE": str(p.nproc), "GROUP_RANK": str(p.node_rank),
            "MASTER_ADDR": p.master_addr, "MASTER_PORT": str(p.master_port)}


def run_ranks(p: ParallelConfig, job: Job, log: Path) -> dict[int, int]:
    """This node's ranks of `job`, forked from `effkit.child`'s server, watched as torchrun's agent watches them:
    when one fails the others are stopped (SIGTERM, then SIGKILL after STOP_GRACE_S); Ctrl-C here stops them too.
    Their stderr goes to `log`, their stdout to this process'. {rank: exit code} of the ranks that failed (negative:
    killed by that signal), empty on success."""
    from multiprocessing.connection import wait

    from effkit import child

    with log.open("w") as err:
        procs = {p.node_rank * p.nproc + i: child.start(job, rank_env(p, i), 1, err.fileno())
                 for i in range(p.nproc)}
        try:
            running = set(procs)
            while running:
                wait([procs[r].sentinel for r in running])
                running = {r for r in running if procs[r].exitcode is None}
                if any(procs[r].exitcode for r in procs if r not in running):
                    break
        finally:
            stopped = stop(procs)
    return {r: proc.exitcode for r, proc in procs.items() if proc.exitcode and r not in stopped}


def stop(procs: dict[int, Any]) -> set[int]:
    """Stop the processes still running (SIGTERM, then SIGKILL for those still there after STOP_GRACE_S); the keys
    of those it stopped."""
    import time

    alive = [q for q in procs.values() if q.exitcode is None]
    for q in alive:
        q.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for q in alive:
        q.join(max(0.0, deadline - time.monotonic()))
        if q.exitcode is None:
            q.kill()
            q.join()
    return {r for r, q in procs.items() if q in alive}


# what a process prints as it aborts: a C++ exception nobody caught, or the interpreter's own fatal error
_FATAL = re.compile(r"^(terminate called [^\n]*|\s*what\(\):[^\n]*|Fatal Python error:[^\n]*)$", re.M)


def fatal_reason(log: Path) -> str:
    """What a dying process printed about why, as ' (terminate called ...)'; empty when it printed nothing."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = [m.strip() for m in _FATAL.findall(text)]
    return f" ({' '.join(found[-2:])})" if found else ""


def signal_name(code: int) -> str:
    """SIGKILL for exit code -9."""
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def raise_worker_failure(job: Job, exits: dict[int, int], log: Path) -> None:
    """Name the rank that failed first (`exits`: {rank: exit code} of the failed ones): one killed by a signal (the
    others then lose their peer, and could not record anything), else the earliest error a rank recorded itself."""
    failures = job.failures()
    recorded = {r["rank"] for r in failures}
    killed = {r: signal_name(c) for r, c in exits.items() if c < 0 and r not in recorded}
    if killed:
        # the surviving ranks are stopped with SIGTERM: a rank killed by another signal is the cause
        first = min({r for r, sig in killed.items() if sig != "SIGTERM"} or killed)
        others = sorted({*killed, *recorded} - {first})
        tail = f" (then rank {', '.join(map(str, others))})" if others else ""
        raise WorkerFailed(f"rank {first} was killed by {killed[first]}{fatal_reason(log)}; the other processes "
                           f"were stopped{tail}; the ranks' log in {log}")
    if not failures:
        raise WorkerFailed(f"the distributed launch failed (exit codes {exits}) before any rank reported an "
                           f"error; see {log}")
    first = failures[0]  # the root cause; the others typically lost their peer
    others = [str(r["rank"]) for r in failures[1:]]
    tail = f" (then rank {', '.join(others)})" if others else ""
    if first["kind"] == "user":  # bad input: the one line says all; the job folder is not named, so not kept
        job.remove()
        raise EffkitError(f"rank {first['rank']}: {first['message']}{tail}")
    raise WorkerFailed(f"rank {first['rank']} failed: {first['message']}; the other processes were stopped{tail}; "
                       f"traceback in {log}")
