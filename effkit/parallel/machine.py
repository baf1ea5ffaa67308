"""The machine `--parallel auto` ranks layouts for (`Hardware`), and this one's (`this_machine`), measured in
launched ranks: its collectives on the backend (all-reduce, all-gather, reduce-scatter at a few sizes, fitted per
collective by a ring `Link`: latency + bytes / bandwidth), an optimizer step's seconds per parameter and what a
parameter held as a DTensor adds (`time_optimizer`), a block's forward and backward plain, tensor-parallel and
sharded and a one-block training step in every rank and in one alone (`time_layers`), and the runtime probe's
steps (`memplan.probe_runtime`) at two batches, all in one launch whose ranks start while the parent makes its
simulations and time only once it is done (they would slow each other)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
# bytes per rank's tensor timed for each collective: the sizes the layouts send (a tensor-parallel block's
# activations, DDP's buckets (`auto.DDP_BUCKET_BYTES`), a sharded block's parameters), so that the fitted line's
# slope is set where their seconds are; the smallest messages' times swing by several times between launches
SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
REPEATS = 5
LAYER_ROUNDS, LAYER_MIN_S = 6, 0.2  # `time_layers`: rounds in turns, and seconds of calls each variant adds up to
# its warm-up calls, untimed: a tensor-parallel block's first calls run slower (DTensor's sharding propagation is
# cached per op and shape), and the fastest of them sets how many calls a round makes
LAYER_WARMUP = 3
DTENSOR_PARAMS = 32  # small parameter tensors of the optimizer step timed plain and as DTensors
OPTIMIZER_PARAMS = 1 << 22  # parameters of the optimizer step timed for its cost per parameter
GO_WAIT_S = 600  # the longest a measuring rank waits for its parent's go before timing anyway
COLLECTIVES = "parallel_collectives"  # the machine cache's file of measured collectives
PROBE_BATCH = 1  # blocks per step of the ranking's runtime probe: its FLOP rate carried to every layout's batch
PROBE_ROUNDS, PROBE_MIN_S = 4, 0.5  # its steps' rounds in turns (two batches), and the seconds they add up to each


@dataclass(frozen=True)
class Link:
    """A link's cost for the ring algorithms: `latency_s` per step, `bandwidth` bytes/s (bus bandwidth)."""

    latency_s: float
    bandwidth: float

    def seconds(self, kind: str, nbytes: float, n: int) -> float:
        """One `kind` collective of a tensor of `nbytes` (the whole one: all-gathered, all-reduced, sent) among n."""
        if n <= 1:
            return 0.0
        steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "send": 1}[kind]
        share = nbytes if kind == "send" else nbytes / n
        return steps * (self.latency_s + share / self.bandwidth)


@dataclass(frozen=True)
class Hardware:
    """The machine layouts are ranked for: devices per node, each device's memory and peak FLOP/s, the fraction of
    the peak a training step's matrices reach, and the links within a node and between nodes (one `Link` for
    every collective; a measured machine has one per collective, fitted)."""

    name: str
    devices_per_node: int
    memory_bytes: int
    peak_flops: float
    efficiency: float
    intra: dict[str, Link]
    inter: dict[str, Link]
    simulated: bool = True
    how: dict[str, str] = field(default_factory=dict)
    # measured machines: the whole model's forward and backward seconds that do not grow with the batch, its
    # optimizer step's seconds, what a DTensor parameter adds to the optimizer step (per tensor, per element), and
    # what a block's forward and backward cost beyond the model's terms when tensor-parallel and when sharded
    fixed_s: float = 0.0
    optimizer_s: float = 0.0
    dtensor_s: float = 0.0
    dtensor_param_s: float = 0.0
    tp_block_s: float = 0.0
    fsdp_unit_s: float = 0.0
    solo_speedup: float = 1.0  # a rank's pace alone over all ranks' at once (sharing memory and caches: a CPU)
    overlaps: bool = True  # whether a rank's collectives run beside its compute (a device's stream, a spare core)

    def link(self, kind: str, spans_nodes: bool) -> Link:
        links = self.inter if spans_nodes else self.intra
        return links.get(kind) or links.get("all_gather") or next(iter(links.values()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _block_params(mc) -> int:
    d, inner = mc.n_embd, mc.n_inner or 4 * mc.n_embd
    return 4 * d * d + 2 * d * inner + 9 * d + inner  # attention and MLP matrices, their biases, two LayerNorms


def _vocab_params(mc) -> int:
    return (mc.vocab_size + mc.n_positions + 2) * mc.n_embd  # both embeddings (the head tied to one) and ln_f


def time_collectives(sizes: list[int], repeats: int) -> dict[str, list[list[float]]]:
    """In each rank of a joined process group: the seconds of each collective on the backend, per size (the median
    of `repeats` after a warm-up; the slowest rank's), {kind: [[bytes of the whole tensor, seconds], ...]}."""
    import torch
    import torch.distributed as dist

    n, out = dist.get_world_size(), {}
    for kind in KINDS:
        out[kind] = []
        for size in sizes:
            x = torch.ones(size // 4)
            whole = torch.empty(n * x.numel())
            run = {"all_reduce": lambda x, whole: dist.all_reduce(x),
                   "all_gather": lambda x, whole: dist.all_gather_into_tensor(whole, x),
                   "reduce_scatter": lambda x, whole: dist.reduce_scatter_tensor(x, whole)}[kind]
            run(x, whole)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t = time.perf_counter()
                run(x, whole)
                times.append(time.perf_counter() - t)
            slowest = torch.tensor([statistics.median(times)])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out[kind].append([float(size * (1 if kind == "all_reduce" else n)), slowest.item()])
    return out


def time_optimizer(repeats: int) -> dict[str, float]:
    """In each rank of a joined process group, the slowest rank's medians of `repeats` of a training step's
    gradient clipping and AdamW step (as `ParallelRun.clip_grad_norm` and `optim.build_optimizer` run them):
    "param_s", the seconds per parameter of plain tensors (the fused AdamW, a local norm) large enough that only
    their size counts; "dtensor_s", what a parameter tensor adds when it is a DTensor sharded over every rank (as
    fsdp and tp hold them: PyTorch's foreach AdamW, a norm all-reduced per tensor), on tensors small enough that
    only the per-tensor cost counts; "dtensor_param_s", what each element of large DTensor parameters adds per
    rank (the foreach kernels against the fused one's)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh, n = init_device_mesh("cpu", (dist.get_world_size(),)), dist.get_world_size()

    def seconds(sharded: bool, count: int, numel: int) -> float:
        params = [torch.nn.Parameter(distribute_tensor(torch.ones(numel), mesh, [Shard(0)]) if sharded
                                     else torch.ones(numel)) for _ in range(count)]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=not sharded)
        times = []
        for _ in range(repeats + 1):
            for p in params:
                p.grad = torch.ones_like(p)
            dist.barrier()
            t = time.perf_counter()
            for p in params:
                norm = (p.grad.to_local() if sharded else p.grad).float().pow(2).sum()
                if sharded:
                    dist.all_reduce(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    small = 64 * n
    dtensor = seconds(True, DTENSOR_PARAMS, small) - seconds(False, DTENSOR_PARAMS, small)
    plain = seconds(False, 4, OPTIMIZER_PARAMS // 4) / OPTIMIZER_PARAMS
    large = seconds(True, 4, n * OPTIMIZER_PARAMS // 4) / OPTIMIZER_PARAMS  # each rank's shard: OPTIMIZER_PARAMS
    timed = torch.tensor([plain, dtensor / DTENSOR_PARAMS, large - plain])
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    return {"param_s": timed[0].item(), "dtensor_s": max(timed[1].item(), 0.0),
            "dtensor_param_s": max(timed[2].item(), 0.0)}


def _local_width(block, n: int) -> None:
    """`block` (effkit's Linear GPT-2 block) cut to the widths one of `n` tensor-parallel ranks computes: its
    heads and MLP columns split by n, plain tensors (what a tensor-parallel block would cost without DTensor)."""
    from torch import nn

    attn, mlp = block.attn, block.mlp
    d, inner = attn.c_attn.in_features, mlp.c_fc.out_features
    attn.c_attn, attn.c_proj = nn.Linear(d, 3 * d // n), nn.Linear(d // n, d)
    mlp.c_fc, mlp.c_proj = nn.Linear(d, inner // n), nn.Linear(inner // n, d)
    attn.split_size //= n
    attn.num_heads //= n


def agreed(calls: list[int]) -> list[int]:
    """The most calls of each contender any rank of the process group would time (`timing.medians_in_turns`): every
    rank then runs the same ones, their collectives matched and the ranks busy together, as they train."""
    import torch
    import torch.distributed as dist

    most = torch.tensor(calls)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return most.tolist()


def time_layers(model_config: dict[str, Any], batch: int, block: int) -> dict[str, float]:
    """In each rank of a joined process group, the slowest rank's medians of forward and backward passes of one block of
    `model_config` on `batch` x `block` tokens, timed in turns after LAYER_WARMUP calls each (`timing.medians_in_turns`:
    LAYER_ROUNDS rounds, at least LAYER_MIN_S of passes each): plain ("plain_s"; "plain2_s" at twice the batch: what a
    block adds to the runtime probe's one-block step at its two batches), cut to one tensor-parallel rank's widths
    ("local_s"), tensor-parallel over every rank as `apply_tp` lays it out ("tp_s": DTensor's dispatch and its
    activations' all-reduces), sharded by FSDP2 over every rank as `apply_fsdp` wraps a block ("fsdp_s": its parameters
    all-gathered forward and backward, their gradients reduce-scattered, as FSDP2 issues them); and a training step of
    the one-block model (its vocabulary too, `optim.training_step`) in every rank at once ("step_s") and in rank 0 alone
    while the others wait at a barrier ("alone_s": the pace of a pipeline's fill and drain, where ranks wait on a stage;
    everything else here runs in all ranks at once, sharing the machine's memory bandwidth and caches)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from effkit.measure.timing import medians_in_turns
    from effkit.model.gpt2 import _finish
    from effkit.optim import build_optimizer, training_step
    from effkit.parallel.parallelize import apply_tp

    torch.manual_seed(0)
    mesh, n = init_device_mesh("cpu", (dist.get_world_size(),)), dist.get_world_size()
    mc = GPT2Config.from_dict({**model_config, "n_layer": 1, "vocab_size": n})  # the block alone runs: no vocabulary
    mc._attn_implementation = "sdpa"

    def one_block():
        model = _finish(GPT2LMHeadModel(mc)).train()
        return model, model.transformer.h[0]

    def seconds(module, rows: int = batch) -> Callable[[], float]:
        def once() -> float:
            x = torch.randn(rows, block, mc.n_embd, requires_grad=True)
            dist.barrier()
            t = time.perf_counter()
            module(x).sum().backward()
            return time.perf_counter() - t
        return once

    whole = GPT2Config.from_dict({**model_config, "n_layer": 1})
    whole._attn_implementation = "sdpa"
    stepped = _finish(GPT2LMHeadModel(whole)).train()
    opt = build_optimizer(stepped, "adamw", 1e-4, 0.1)[0]

    def training(ranks: int) -> Callable[[], float]:  # a step in the first `ranks` ranks, the others waiting
        def once() -> float:
            x = torch.randint(0, whole.vocab_size, (batch, block))
            dist.barrier()
            t = time.perf_counter()
            if (mine := dist.get_rank() < ranks):
                training_step(stepped, opt, x)
            seconds = time.perf_counter() - t
            if ranks < n:
                dist.barrier()
            return seconds if mine else 0.0  # the maximum over the ranks below: the stepping ranks'
        return once

    _local_width(local := one_block()[1], n)
    model, tp = one_block()
    apply_tp(model, mesh)
    fully_shard(fsdp := one_block()[1], mesh=mesh, reshard_after_forward=True)
    blocks = {"plain_s": one_block()[1], "local_s": local, "tp_s": tp, "fsdp_s": fsdp}
    passes = {**{k: seconds(m) for k, m in blocks.items()}, "plain2_s": seconds(blocks["plain_s"], 2 * batch),
              "step_s": training(n), "alone_s": training(1)}
    timed = medians_in_turns(passes, LAYER_ROUNDS, LAYER_MIN_S, warmup=LAYER_WARMUP, agree=agreed)
    slowest = torch.tensor(list(timed.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(timed, slowest.tolist(), strict=True))


def _fit(points: list[list[float]], kind: str, n: int) -> Link:
    """The ring `Link` whose cost line (least squares, seconds on bytes) passes nearest the timed points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs), 1e-15)
    intercept = max(my - slope * mx, 0.0)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return Link(intercept / steps, 1 / (slope * n / steps))


def measure_rank(go: str, probe: dict[str, Any] | None, sizes: list[int], repeats: int,
                 layers: dict[str, Any] | None = None) -> dict[str, Any]:
    """One launched rank's share of this machine's measurements: its libraries imported, it waits for `go` (the
    parent's simulations done, which would slow these timings), joins the process group, runs the runtime probe
    (`memplan.probe_runtime`, every rank at once, as they train; the slowest rank's step times) at the probe's
    batch ("probe") and at twice it ("probe2": what a sequence more adds), its four models in turns in one call,
    and times the collectives (`time_collectives`), the optimizer step (`time_optimizer`) and, with `layers`
    (`time_layers`'s arguments), a block plain, tensor-parallel and sharded ("layers")."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel  # noqa: F401  (imported before `go`: the probe's model)

    from effkit.memplan import probe_runtime

    deadline = time.monotonic() + GO_WAIT_S
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.init_process_group("gloo")
    try:
        out: dict[str, Any] = {}
        if probe:
            probed = probe_runtime(**probe, batches=(1, 2), agree=agreed)
            both = [probed, *probed.pop("more")]
            slowest = torch.tensor([[p["step_s"], p["step2_s"] or 0.0] for p in both], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            for name, p, (one, two) in zip(("probe", "probe2"), both, slowest.tolist(), strict=True):
                out[name] = {**p, "step_s": one, "step2_s": two if p["step2_s"] is not None else None}
        out["collectives"], out["optimizer"] = time_collectives(sizes, repeats), time_optimizer(repeats)
        if layers:
            out["layers"] = time_layers(**layers)
    finally:
        dist.destroy_process_group()
    return out


def launch_measuring(world: int, threads: int, probe: dict[str, Any] | None,
                     meanwhile: Callable[[], Any] = lambda: None, layers: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """`measure_rank` in `world` processes of `threads` threads started here (the environment a launcher gives
    them, without one: its start-up is not needed to measure), `meanwhile()` run here while they start (in a
    thread: the first start of effkit's fork server imports the libraries in a process of its own, beside it).
    {"probe", "probe2": `probe_runtime`'s results (with `probe`), "collectives": `time_collectives`'s,
    "optimizer": `time_optimizer`'s, "layers": `time_layers`'s (with `layers`)}."""
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from effkit.child import Job, start
    from effkit.errors import WorkerFailed
    from effkit.parallel.launch import free_port

    go = Path(tempfile.mkdtemp(prefix="effkit-measure-go-")) / "go"
    job = Job.create("effkit.parallel.machine:measure_rank",
                     {"go": str(go), "probe": probe, "sizes": list(SIZES), "repeats": REPEATS, "layers": layers},
                     prefix="effkit-measure-")
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    log = job.folder / "ranks.log"
    with log.open("w") as err, ThreadPoolExecutor(1) as starting:
        procs = starting.submit(lambda: [start(job, dict(env, RANK=str(r), LOCAL_RANK=str(r)), stderr=err.fileno())
                                         for r in range(world)])
        try:
            meanwhile()
        finally:
            go.touch()
            codes = [p.join() or p.exitcode for p in procs.result()]
    go.unlink()
    go.parent.rmdir()
    if any(codes):
        failures = job.failures()
        why = failures[0]["message"] if failures else f"exit codes {codes}"
        raise WorkerFailed(f"measuring this machine for --parallel auto failed: {why}; see {log}")
    result = job.result()
    job.remove()
    return result


def measured_collectives(world: int, threads: int, measure: Callable[[], dict[str, Any]]
                         ) -> tuple[dict[str, Link], dict[str, float], str]:
    """This machine's collectives among `world` processes on the CPU backend (gloo), fitted per collective, and
    its optimizer step (`time_optimizer`); timed once (`measure()`: `launch_measuring`'s result) and cached per
    machine; (links, the optimizer's seconds, how they were obtained)."""
    import torch

    from effkit.measure.machine_cache import cache_note, machine_cached

    key = f"gloo|world {world}|threads {threads}|torch {torch.__version__}|sizes {list(SIZES)}|optimizer per element"
    timed, cached = machine_cached(COLLECTIVES, key, lambda: {**measure()["collectives"], **measure()["optimizer"]})
    links = {kind: _fit(timed[kind], kind, world) for kind in KINDS}
    optimizer = {k: timed[k] for k in ("param_s", "dtensor_s", "dtensor_param_s")}
    fitted = "; ".join(f"{k} {links[k].latency_s * 1e6:.0f} us + {links[k].bandwidth / 1e9:.2f} GB/s" for k in KINDS)
    note = cache_note(COLLECTIVES, key) if cached else "measured now, cached per machine"
    return links, optimizer, (
        f"gloo among {world} processes, timed at {len(SIZES)} sizes and fitted per ring step: {fitted}; the "
        f"optimizer step {optimizer['param_s'] * 1e9:.2f} ns per parameter, {optimizer['dtensor_s'] * 1e3:.2f} ms "
        f"more per DTensor parameter, {optimizer['dtensor_param_s'] * 1e9:.2f} ns more per element of one ({note})")


def measured_layers(world: int, threads: int, layers: dict[str, Any], links: dict[str, Link], param_bytes: int,
                    measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, float], str, dict[str, float]]:
    """What a block's forward and backward cost beyond `--parallel auto`'s other terms, from `time_layers`'s
    timings among `world` ranks of the block `layers` describes (`measure()`: `launch_measuring`'s result; cached
    per machine and shape): tensor-parallel, over the plain block's split by the degree and its activations' four
    all-reduces ("tp_block_s"); sharded, over the plain block and its `param_bytes` all-gathered twice and
    reduce-scattered once ("fsdp_unit_s"); each collective on the fitted `links`, none below zero; and how much
    faster the one-block model's training step runs in one rank alone than in all at once ("solo_speedup", 1 at
    least). ({field: value}, how they were obtained, the timings)."""
    import json

    import torch

    from effkit.measure.machine_cache import cache_note, machine_cached

    mc = layers["model_config"]
    shape = {k: mc.get(k) for k in ("vocab_size", "n_embd", "n_head", "n_inner")}
    key = (f"gloo|world {world}|threads {threads}|torch {torch.__version__}|{json.dumps(shape, sort_keys=True)}|"
           f"b{layers['batch']}x{layers['block']}|layers|in turns {LAYER_ROUNDS}, {LAYER_MIN_S} s, "
           f"warm-up {LAYER_WARMUP}|alone|plain x2")
    timed, cached = machine_cached(COLLECTIVES, key, lambda: measure()["layers"])
    act = layers["batch"] * layers["block"] * mc["n_embd"] * 4
    tp_comm = 4 * links["all_reduce"].seconds("all_reduce", act, world)
    fsdp_comm = (2 * links["all_gather"].seconds("all_gather", param_bytes, world)
                 + links["reduce_scatter"].seconds("reduce_scatter", param_bytes, world))
    tp = max(0.0, timed["tp_s"] - timed["plain_s"] / world - tp_comm)
    fsdp = max(0.0, timed["fsdp_s"] - timed["plain_s"] - fsdp_comm)
    solo = max(1.0, timed["step_s"] / timed["alone_s"])
    ms = {k: f"{v * 1e3:.1f} ms" for k, v in timed.items()}
    note = cache_note(COLLECTIVES, key) if cached else "measured now, cached per machine and shape"
    return {"tp_block_s": tp, "fsdp_unit_s": fsdp, "solo_speedup": solo}, (
        f"a block's forward and backward at batch {layers['batch']} among {world} ranks: plain {ms['plain_s']} "
        f"({ms['plain2_s']} at twice the batch), "
        f"at one rank's tensor-parallel widths {ms['local_s']}, tensor-parallel {ms['tp_s']} (its all-reduces "
        f"{tp_comm * 1e3:.1f} ms on the fitted line), sharded {ms['fsdp_s']} (its collectives {fsdp_comm * 1e3:.1f} "
        f"ms): {tp * 1e3:.1f} ms more per tensor-parallel block, {fsdp * 1e3:.1f} ms more per sharded unit; the "
        f"one-block model's training step {ms['step_s']} in every rank at once, {ms['alone_s']} in one while the "
        f"others wait: {solo:.2f}x the pace alone ({note})"), timed


def this_machine(cfg, mc, world: int) -> tuple[Hardware, int | None]:
    """This machine as the ranking prices it: the runtime probe's one-block steps (PROBE_BATCH sequences and twice
    it, in every launched rank at once with the threads a rank gets) extended to the whole model by a block's
    measured pass at each batch and its optimizer step, as the FLOP rate of what a sequence adds and the seconds
    that do not grow with the batch, its memory shared by the processes on it, and its collectives and DTensor
    step measured (`measured_collectives`); all measured in one launch (`launch_measuring`) and cached per
    machine. Also the process runtime's bytes."""
    import json
    import os

    import torch

    from effkit import memplan

    p, o, d = cfg.parallel, cfg.optim, cfg.data
    nproc, threads = world // p.nnodes, p.threads or 1
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}[o.amp_dtype] if o.amp else None
    kw = dict(checkpointing=cfg.model.activation_checkpointing, optim=o.optim, amp_dtype=amp)

    def simulations() -> None:  # what the probe's runtime bytes and the layouts' plans read, made as ranks start
        memplan.simulate(memplan._one_block(mc), PROBE_BATCH, d.block_size, **kw)
        memplan.simulate_layers(mc, o.batch_size, d.block_size, mc.n_layer, o.batch_size, **kw)

    measured: dict[str, Any] = {}
    layers = {"model_config": json.loads(memplan._one_block(mc).to_json_string()), "batch": PROBE_BATCH,
              "block": d.block_size}

    def measure(probe: dict[str, Any] | None) -> dict[str, Any]:
        measured.update(measured or launch_measuring(world, threads, probe, simulations, layers))
        return measured

    probing = dict(kw, probe=True, threads=threads, rounds=PROBE_ROUNDS, min_s=PROBE_MIN_S, blocks=1)
    runtime_bytes, how, (one_s, _) = memplan.runtime(mc, PROBE_BATCH, d.block_size, **probing,
                                                     run_probe=lambda a: measure(a)["probe"])
    _, _, (one2_s, _) = memplan.runtime(mc, 2 * PROBE_BATCH, d.block_size, **probing, memory=False,
                                        run_probe=lambda a: measure({**a, "batch": PROBE_BATCH})["probe2"])
    links, optimizer, comm_how = measured_collectives(world, threads, lambda: measure(None))
    block_s, block_how, passes = measured_layers(world, threads, layers, links, 4 * _block_params(mc),
                                                 lambda: measure(None))
    a_block = optimizer["param_s"] * _block_params(mc)  # each block more: its pass and its optimizer step
    one, two = (s + (mc.n_layer - 1) * (passes[k] + a_block) for s, k in ((one_s, "plain_s"), (one2_s, "plain2_s")))
    flops = memplan.step_flops(mc, mc.n_layer, PROBE_BATCH * d.block_size, d.block_size)
    per_batch = min(max(two - one, one / 20), one)  # what the second batch adds, kept in range: still two timings
    rate, fixed = flops / per_batch, max(0.0, (one + two) / 2 - 1.5 * per_batch)
    optimizer_s = min(optimizer["param_s"] * (_vocab_params(mc) + mc.n_layer * _block_params(mc)), fixed)
    _, avail = memplan.device_memory(torch.device("cpu"))
    cores = os.cpu_count() or 1
    busy = nproc * (p.threads or max(1, cores // nproc))  # the threads training gives each rank (`train_in_processes`)
    hw = Hardware("this machine (CPU)", nproc, (avail or 0) // nproc, rate, 1.0, links, links, simulated=False,
                  fixed_s=fixed - optimizer_s, optimizer_s=optimizer_s, dtensor_s=optimizer["dtensor_s"], **block_s,
                  dtensor_param_s=optimizer["dtensor_param_s"], overlaps=cores > busy,
                  how={"compute": f"{rate / 1e9:.2f} GFLOP/s per rank for the work that grows with the batch; "
                                  f"{fixed * 1e3:.0f} ms per step that does not ({optimizer_s * 1e3:.0f} ms of it "
                                  f"the optimizer's): the runtime probe's steps of the one-block model at batches "
                                  f"{PROBE_BATCH} and {2 * PROBE_BATCH} in turns ({PROBE_ROUNDS} rounds, "
                                  f"{PROBE_MIN_S:g} s of steps each at least; medians), {threads} thread(s), in "
                                  f"each of the {nproc} ranks at once (the slowest's), extended to {mc.n_layer} "
                                  f"blocks by a block's pass at each batch and its optimizer step ({how})",
                       "collectives": f"{comm_how}; {nproc} ranks x {busy // nproc} thread(s) on {cores} cores: "
                                      f"{'a core' if cores > busy else 'none'} to spare for gloo's threads",
                       "layouts' blocks": block_how,
                       "memory": f"available RAM / {nproc} processes"})
    return hw, runtime_bytes
