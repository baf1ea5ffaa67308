"""`effkit train --plan`: the per-rank peak memory of a training configuration, predicted before anything is
allocated, and `--plan --fit`: the cheapest combination of memory tricks that fits.

How: the model is built under PyTorch's `FakeTensorMode` (tensors with shapes and no storage) and two training
steps of one rank's share (its micro-batch, its pipeline stage's blocks, its tensor-parallel slice of each block)
run under `torch.distributed._tools.mem_tracker.MemTracker`, which records every storage the forward, backward
and optimizer step create, by kind (parameters, gradients, optimizer state, activations, temporaries). Nothing is
allocated, so a plan for a model larger than the machine costs seconds.

What is simulated and what is computed:
- single process, ddp and pp are simulated as they run: ddp adds its gradient buckets (one more copy of the
  gradients); pp simulates the first stage's blocks (with the embeddings, LM head and loss: an upper bound),
  with up to `microbatches` micro-batches of activations in flight;
- the model's blocks are simulated at 2 and 4 and extrapolated per block (`simulate_layers`);
- FSDP shards parameters, gradients and optimizer state by the data-parallel degree and, with
  `reshard_after_forward`, gathers one block at a time (one block's full parameters and gradients on top);
  tensor parallelism splits the four block matrices by the tp degree (activations are counted whole, an upper
  bound); both are applied to the simulated single-rank figures by those factors;
- 8-bit AdamW keeps 2 B per element of each tensor of at least 4,096 elements (bitsandbytes) plus one fp32 scale
  per block of 256, and fp32 moments for smaller tensors;
- a process's own runtime on a CPU (the math libraries' buffers kept after their first use: MKL's GEMM packing
  buffers, oneDNN's caches; the allocator's pools) is not a tensor, and is part of the measured resident set: it
  is measured once per machine and shape (`runtime`): a one-block model of the same width, vocabulary, batch,
  optimizer, precision and checkpointing runs three real training steps in a fresh process, and what its
  resident set grows beyond the simulation of the same one-block steps is the runtime (it depends on the GEMM
  shapes, not on the depth). Cached in the effkit cache; on a GPU the measured peak counts tensors only.

The measured peak of a training run (`PeakMemory`) is the increase over the training steps, with the model
already built and placed; the plan gives both that figure (`steps_bytes`) and the absolute one (`total_bytes`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from effkit.errors import EffkitError
from effkit.stageplan import StagePlan, what_fits

BNB_MIN_8BIT = 4096  # bitsandbytes keeps fp32 moments for smaller tensors
BLOCK = 256  # 8-bit block size: one fp32 scale per block and moment

METHOD = ("two training steps of one rank's share simulated under FakeTensorMode with PyTorch's MemTracker "
          "(no storage allocated; 2- and 4-block models, extrapolated per block); FSDP and TP shards applied by "
          "their degrees; 8-bit moments counted at 2 B per element plus a 4 B scale per 256; on a CPU the process "
          "runtime (libraries' buffers) measured once per machine and shape by three real steps of a one-block "
          "model in a fresh process, beyond their simulation")
RUNTIME_STEPS = 3
STEP_ROUNDS = 7  # timed steps of the one- and two-block models each, in turns, for the step time


def device_memory(device: torch.device) -> tuple[str, int | None]:
    """The device and how much memory it has: a GPU's total, or the machine's available RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return torch.cuda.get_device_name(device), total
    try:
        import psutil

        return "CPU RAM (available now)", psutil.virtual_memory().available
    except ImportError:
        return "CPU RAM", None


def _model_config(cfg) -> Any:
    from transformers import AutoConfig, GPT2Config

    from effkit.model import check_preset, is_pretrained_source

    name = cfg.model.name
    if is_pretrained_source(name):
        return AutoConfig.from_pretrained(name)
    return GPT2Config(vocab_size=cfg.data.vocab_size, **check_preset(name))


AUTOCAST_KEPT = "autocast's weight copies, kept by the allocator"


def autocast_copies(model_config, layers: int) -> int:
    """Bytes of the 16-bit copies autocast makes of a model's matrices in a forward (`layers` blocks: attention's
    two, the MLP's two; the head over the vocabulary)."""
    d, inner = model_config.n_embd, model_config.n_inner or 4 * model_config.n_embd
    return 2 * (layers * (4 * d * d + 2 * d * inner) + model_config.vocab_size * d)


def _opt_state_8bit(params: list[torch.Tensor]) -> int:
    return sum(2 * n + 2 * 4 * math.ceil(n / BLOCK) if n >= BNB_MIN_8BIT else 8 * n
               for n in (p.numel() for p in params))


SIMULATIONS = "memplan_simulation"  # the effkit cache's file of simulations already run (a function of the shapes)


def simulate(model_config, batch: int, block: int, *, checkpointing: bool, optim: str = "adamw",
             amp_dtype: torch.dtype | None = None, layers: int | None = None) -> dict[str, int]:
    """Bytes by kind at the peak of the second of two simulated training steps of `batch` blocks of `block`
    tokens on a model with `layers` blocks (default: all). Kept in the effkit cache by model configuration, shapes
    and torch version: a simulation is a function of them, and it takes seconds that every later plan of the same
    configuration saves."""
    import json

    from effkit.measure.machine_cache import machine_cached

    # all of it (dropout, for one, changes what a step saves) but where the model came from: copies share shapes
    config = {k: v for k, v in model_config.to_dict().items() if k not in ("_name_or_path", "architectures")}
    if optim == "adamw8bit":  # the simulation steps torch's AdamW either way: only the moments' bytes differ
        from transformers import GPT2LMHeadModel
        with torch.device("meta"):  # the parameters' shapes
            model = GPT2LMHeadModel(model_config.__class__.from_dict({**config,
                                                                      "n_layer": layers or config["n_layer"]}))
        out = simulate(model_config, batch, block, checkpointing=checkpointing, amp_dtype=amp_dtype, layers=layers)
        return {**out, "optimizer": _opt_state_8bit([p for p in model.parameters() if p.requires_grad])}
    key = json.dumps({"config": config, "layers": layers, "batch": batch, "block": block, "ckpt": checkpointing,
                      "optim": optim, "amp": str(amp_dtype), "torch": torch.__version__}, sort_keys=True)
    run = dict(checkpointing=checkpointing, optim=optim, amp_dtype=amp_dtype, layers=layers)
    value, _ = machine_cached(SIMULATIONS, key, lambda: _simulate(model_config, batch, block, **run))
    return dict(value)


def _simulate(model_config, batch: int, block: int, *, checkpointing: bool, optim: str = "adamw",
              amp_dtype: torch.dtype | None = None, layers: int | None = None) -> dict[str, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from transformers import GPT2LMHeadModel

    from effkit.measure.evaluation import lm_loss
    from effkit.measure.hardware import autocast_ctx
    from effkit.model import enable_activation_checkpointing
    from effkit.model.gpt2 import _finish

    mc = model_config.__class__.from_dict(model_config.to_dict())
    mc.n_layer = layers if layers is not None else mc.n_layer
    mc._attn_implementation = "sdpa"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _finish(GPT2LMHeadModel(mc))  # effkit's Linear layout, no KV cache, as training builds it
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        x = torch.randint(0, mc.vocab_size, (batch, block))
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for step in range(2):
                with autocast_ctx(torch.device("cpu"), amp_dtype):
                    loss = lm_loss(model(x).logits, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == 0:
                    mt.reset_mod_stats()
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))
    kinds = {"parameters": _MemRefType.PARAM, "gradients": _MemRefType.GRAD, "optimizer": _MemRefType.OPT,
             "activations": _MemRefType.ACT, "temporaries": _MemRefType.TEMP, "buffers": _MemRefType.BUFFER}
    out = {k: int(peak.get(v, 0)) for k, v in kinds.items()}
    out["params_count"] = sum(p.numel() for p in params)
    return out


def _one_block(model_config) -> Any:
    return model_config.__class__.from_dict({**model_config.to_dict(), "n_layer": 1})


def probe_runtime(model_config: dict[str, Any], batch: int, block: int, checkpointing: bool, optim: str,
                  amp: str | None, steps: int = RUNTIME_STEPS, threads: int = 0, rounds: int = STEP_ROUNDS,
                  min_s: float = 0.0, batches: tuple[int, ...] = (1,), agree: Any = None, blocks: int = 2) -> dict:
    """How much the resident set grows over `steps` real training steps of the one-block model `model_config`
    (measured as training measures it: the model built and placed first) at `batch` times the first of `batches`;
    then, outside that measure, the seconds of its steps and (with `blocks` 2) of a two-block model's at each of
    `batches`, in turns (`medians_in_turns`: `rounds` rounds, each model's steps adding up to `min_s` at least,
    `agree`d among processes; what `predicted_step_seconds` extends to the whole model), on `threads` threads (0:
    torch's default, as training), in a process of its own. {"bytes", "step_s", "step2_s" (None with `blocks` 1)}
    at `batch`; "more": the step seconds at the further batches ("bytes" None: the memory plan reads the first
    batch's, the ranking only their seconds)."""
    import time

    from transformers import GPT2Config, GPT2LMHeadModel

    from effkit import optim as optimizers
    from effkit.measure.memory import PeakMemory
    from effkit.measure.timing import medians_in_turns
    from effkit.model import enable_activation_checkpointing
    from effkit.model.gpt2 import _finish

    torch.manual_seed(0)
    if threads:
        torch.set_num_threads(threads)
    mc = GPT2Config.from_dict(model_config)
    mc._attn_implementation = "sdpa"

    def build(layers: int):
        mc.n_layer = layers
        model = _finish(GPT2LMHeadModel(mc))
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        return model, optimizers.build_optimizer(model, optim, 1e-4, 0.1)[0]

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
    cpu, models = torch.device("cpu"), {1: build(1)}

    def step(layers: int, rows: int) -> float:
        (model, opt), t = models[layers], time.perf_counter()
        optimizers.training_step(model, opt, torch.randint(0, mc.vocab_size, (rows, block)), dtype)
        return time.perf_counter() - t

    with PeakMemory(cpu) as mem:
        for _ in range(steps):
            step(1, batches[0] * batch)
    grown = [mem.peak_bytes] + [None] * (len(batches) - 1)
    if blocks == 2:
        models[2] = build(2)  # the time a block adds; in turns, outside the memory's sampling thread
    timed = medians_in_turns({(n, k): lambda n=n, k=k: step(n, k * batch) for k in batches for n in models},
                             rounds, min_s, agree=agree)
    out = [{"bytes": b, "step_s": timed[1, k], "step2_s": timed.get((2, k))} for b, k in zip(grown, batches,
                                                                                            strict=True)]
    return {**out[0], "more": out[1:]} if len(out) > 1 else out[0]


CACHE = "memplan_runtime"


def runtime(model_config, batch: int, block: int, *, checkpointing: bool, optim: str = "adamw",
            amp_dtype: torch.dtype | None = None, probe: bool = True, env: dict[str, str] | None = None,
            threads: int = 0, rounds: int = STEP_ROUNDS, min_s: float = 0.0, run_probe: Any = None,
            memory: bool = True, blocks: int = 2) -> tuple[int | None, str, Any]:
    """The process runtime's bytes at the peak on this CPU for this shape (see the module's text; None without `memory`:
    no simulation), how it was obtained, and the probe's step seconds of one and two blocks on `threads` threads
    (`probe_runtime`: `rounds` rounds, at least `min_s` of steps each; the two-block step None with `blocks` 1: a
    caller that times a block otherwise); (None, why, None) when not cached and `probe` is
    off. The probe runs in a fresh process (one forked from a process that imported the libraries measures their code
    pages again: 5 MiB more on gpt2-nano), `env` on top of this one's (the allocator's settings change what the resident
    set keeps); in `run_probe(args)` if given."""
    import json
    import os

    from effkit.child import run_isolated
    from effkit.measure.hardware import describe_device
    from effkit.measure.machine_cache import cache_note, machine_cached

    mc = _one_block(model_config)
    amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype)
    args = dict(model_config=json.loads(mc.to_json_string()), batch=batch, block=block, checkpointing=checkpointing,
                optim=optim, amp=amp, threads=threads, rounds=rounds, min_s=min_s, blocks=blocks)
    malloc = {k: v for k, v in {**os.environ, **(env or {})}.items() if k.startswith("MALLOC_")}
    shape = {k: args["model_config"].get(k) for k in ("vocab_size", "n_embd", "n_head", "n_inner", "n_positions")}
    key = (f"{describe_device(torch.device('cpu'))}|torch {torch.__version__}|{json.dumps(shape, sort_keys=True)}|"
           f"b{batch}x{block}|ckpt {checkpointing}|{optim}|{amp}|{json.dumps(malloc, sort_keys=True)}|"
           f"threads {threads}|v4{'' if rounds == STEP_ROUNDS else f'|rounds {rounds}'}"
           f"{f'|floor {min_s}' * bool(min_s)}{'|launched' * bool(run_probe)}{'|one block' * (blocks == 1)}")
    measure = (lambda: run_probe(args) if run_probe else run_isolated(
        "effkit.memplan:probe_runtime", args, what="the memory plan's runtime probe", env=env)) if probe else None
    probed, cached = machine_cached(CACHE, key, measure)
    if probed is None:
        return None, "not measured on this machine for this shape yet (effkit train --plan measures it)", None
    if not memory:
        return None, "the probe's steps only", (probed["step_s"], probed["step2_s"])
    measured = probed["bytes"]
    sim = simulate(mc, batch, block, checkpointing=checkpointing, optim=optim, amp_dtype=amp_dtype)
    sim_steps = sum(v for k, v in sim.items() if k not in ("params_count", "parameters", "buffers"))
    how = (f"one-block probe: {measured / 2**20:,.1f} MiB measured over {RUNTIME_STEPS} steps, "
           f"{sim_steps / 2**20:,.1f} MiB of it tensors ({cache_note(CACHE, key) if cached else 'measured now'})")
    return max(0, int(measured) - sim_steps), how, (probed["step_s"], probed["step2_s"])


def step_flops(model_config, layers: int, tokens: int, block: int) -> float:
    """FLOPs of a training step of `tokens` tokens in blocks of `block` on `layers` blocks of `model_config`: six
    per token per matrix weight (forward and backward; the head over the vocabulary included) and the attention's
    twelve per token per layer per position of the block (PaLM's accounting)."""
    d, inner = model_config.n_embd, model_config.n_inner or 4 * model_config.n_embd
    matrices = layers * (4 * d * d + 2 * d * inner) + model_config.vocab_size * d
    return tokens * (6 * matrices + 12 * layers * d * block)


def predicted_step_seconds(model_config, layers: int, block: int, probe_s: tuple[float, float]) -> float:
    """A training step of the whole model (`layers` blocks) predicted from the runtime probe's steps of one and
    two blocks (same width, vocabulary, batch, block, optimizer and precision): the one-block step and, for each
    further block, what the second block added, kept within half and twice a block's share of the one-block
    step by FLOPs (a difference of two short timings is noisy)."""
    one, two = probe_s
    flops = step_flops(model_config, 1, 1, block)
    per_block = (step_flops(model_config, 2, 1, block) - flops) / flops * one
    added = min(max(two - one, per_block / 2), 2 * per_block)
    return one + (layers - 1) * added


def step_time(cfg) -> tuple[float | None, str]:
    """One training step of `cfg` (a TrainConfig) on this machine, before training: the step `effkit train --plan`
    prints (`predict`'s: the runtime probe's steps of one and two blocks extended to the model by
    `predicted_step_seconds`, times the accumulation; `--amp auto` resolved first, as training resolves it), which
    `effkit run`'s time budget is fitted with; (None, why) where none is predicted."""
    if cfg.parallel.launched:
        return None, "a launched (multi-process) training is not predicted before it starts"
    from effkit.measure.precision import amp_as_trained

    optim, amp = amp_as_trained(cfg.optim, lambda: _model_config(cfg), cfg.data.block_size, cfg.parallel)
    seconds = predict(cfg.replace(optim=optim), probe=True).step_s
    if seconds is None:
        return None, "no step time predicted here (the runtime probe times one process on a CPU)"
    return seconds, (f"predicted from {STEP_ROUNDS} steps of a one- and a two-block model of its shape, {amp}, "
                     "as `effkit train --plan` predicts it (cached per machine and shape)")


def simulate_layers(model_config, batch: int, block: int, layers: int, batch_from: int = 0, **kw) -> dict[str, int]:
    """`simulate` for a model of `layers` blocks, from two small simulations (2 and 4 blocks): each block adds
    its parameters, their moments and its saved activations, so every kind at the peak grows on a line the two
    fix (a 1-block model peaks in another phase and is not used). The peak can move from the end of the forward
    pass (activations) to the optimizer step (parameters, full gradients, moments) as the model grows: the
    larger of the two is the plan. Minutes of fake execution for a 48-block model become seconds. `batch_from`:
    simulated at that batch for any depth, activations and temporaries scaled to `batch` (`--parallel auto`)."""
    if layers <= 4 and not batch_from:
        return simulate(model_config, batch, block, layers=layers, **kw)
    at = batch_from or batch
    a = simulate(model_config, at, block, layers=2, **kw)
    b = simulate(model_config, at, block, layers=4, **kw)
    grow = {k: batch / at if k in ("activations", "temporaries") else 1 for k in a}
    line = {k: max(0, int((a[k] + (layers - 2) * (b[k] - a[k]) // 2) * grow[k])) for k in a}
    at_step = {**line, "gradients": line["parameters"], "activations": 0}
    return max(line, at_step, key=lambda d: sum(v for k, v in d.items() if k != "params_count"))


def _stage_share(cfg, dims, mc, notes: list[str]) -> tuple[int, int, int]:
    """(micro-batch, blocks, micro-batches of activations in flight) of the rank planned: with pp, the first
    stage (the embeddings, its blocks, up to `microbatches` in flight); else the whole model's batch."""
    o, p = cfg.optim, cfg.parallel
    if not dims.pp_enabled:
        return o.batch_size, mc.n_layer, 1
    layers = math.ceil(mc.n_layer / dims.pp)
    micro = o.batch_size // max(1, p.microbatches)
    in_flight = min(p.microbatches, dims.pp) if p.pp_schedule == "1f1b" else p.microbatches
    notes.append(f"pp: stage of {layers} blocks, {in_flight} micro-batch(es) of {micro} in flight")
    return micro, layers, in_flight


def _sharded_states(sim: dict[str, int], mc, dims, p, layers: int, device: torch.device,
                    notes: list[str]) -> dict[str, int]:
    """One rank's parameters, gradients and optimizer state: the simulated single-rank figures split by tp's and
    FSDP's degrees, DDP's gradient buckets added, all of them off the GPU with cpu offload."""
    states = {k: sim[k] for k in ("parameters", "gradients", "optimizer")}
    embed_bytes = (mc.vocab_size + mc.n_positions) * mc.n_embd * 4
    block_share = (sim["parameters"] - embed_bytes) / layers  # one block's parameter bytes
    if dims.tp > 1:  # the four block matrices (nearly all of a block) split by tp; activations kept whole
        matrices = 12 * mc.n_embd * mc.n_embd * 4 / block_share
        for k in states:
            states[k] = int(states[k] - layers * block_share * matrices * (1 - 1 / dims.tp) * states[k]
                            / max(1, sim["parameters"]))
        block_share *= 1 - matrices * (1 - 1 / dims.tp)
        notes.append(f"tp: block matrices / {dims.tp}; activations counted whole (an upper bound)")
    if dims.dp_shard and dims.dp > 1:
        for k in states:
            states[k] = states[k] // dims.dp
        gathered = int(block_share) * (1 if p.reshard_after_forward else layers)
        states["parameters"] += gathered  # the unsharded block being computed
        states["gradients"] += int(block_share)  # its full gradient before the reduce-scatter
        notes.append(f"fsdp: model states / {dims.dp}, plus {'one block' if p.reshard_after_forward else 'all blocks'}"
                     " gathered")
    if dims.dp_replicate and dims.dp > 1 and p.sync == "ddp" and not dims.pp_enabled:
        states["gradients"] += sim["parameters"]  # DDP's gradient buckets: one more copy of the gradients
        notes.append("ddp: gradient buckets (one more copy of the gradients)")
    if p.cpu_offload and device.type == "cuda":
        notes.append("cpu offload: sharded parameters, gradients and optimizer state live in CPU memory")
        for k in states:
            states[k] = 0
    return states


def _autocast_kept(states: dict[str, int], sim: dict[str, int], mc, layers: int, per_rank: dict[str, int]) -> int:
    """What the allocator still holds of autocast's weight copies at the optimizer step, beyond the peak counted
    (`per_rank`): the rank's share of the copies (by its shards) over that step's parameters, gradients and
    moments."""
    share = states["parameters"] / max(1, sim["parameters"])  # of the whole model's, by the shards
    at_step = (states["parameters"] + max(states["gradients"], states["parameters"]) + states["optimizer"]
               + sim["temporaries"] + sim["buffers"])
    return max(0, at_step + int(share * autocast_copies(mc, layers)) - sum(per_rank.values()))


def _planned(cfg, sim: dict[str, int], dims, world: int) -> dict[str, Any]:
    """The configuration a training plan is of, as its table's title and `--plan`'s time line read it."""
    o, d = cfg.optim, cfg.data
    tokens = o.batch_size * o.grad_accum * dims.dp * d.block_size
    return {"model": cfg.model.name, "params": sim["params_count"] if dims.tp == 1 and not dims.pp_enabled else None,
            "parallel": cfg.parallel.mode, "world": world, "batch_size": o.batch_size, "block_size": d.block_size,
            "activation_checkpointing": cfg.model.activation_checkpointing, "optim": o.optim,
            "amp": o.amp_dtype if o.amp else ("auto" if o.amp is None else "fp32"),
            "steps": min([s for s in (o.max_steps, math.ceil(o.max_tokens / tokens) if o.max_tokens else 0)
                          if s > 0] or [0])}


def _scope(c: dict[str, Any]) -> str:
    return (f"{c['model']}, {c['parallel']} x{c['world']}, batch {c['batch_size']} x {c['block_size']} tokens, "
            f"{c['optim']}, {c['amp']}, activation checkpointing {'on' if c['activation_checkpointing'] else 'off'}"
            "; per rank")


FIT_HINT = "`effkit train --plan --fit` proposes what would"


def predict(cfg, device: torch.device | None = None, probe: bool = False, runtime_bytes: int | None = None,
            env: dict[str, str] | None = None, model_config=None, batch_from: int = 0) -> StagePlan:
    """The plan of `cfg` (a TrainConfig) for one rank of the layout it asks for. On a CPU its runtime term comes
    from `runtime_bytes` when given, else from the cache, measured first when `probe` (`env`: the probe's).
    `model_config`: the model's shape, when it is not the one `cfg` names (a pruned student); `simulate_layers`
    says what `batch_from` does."""
    from effkit.parallel import ParallelDims
    from effkit.parallel.launch import nproc_per_node

    o, p, d = cfg.optim, cfg.parallel, cfg.data
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mc = model_config or _model_config(cfg)
    nproc = nproc_per_node(p) if p.launched else 1
    world = nproc * p.nnodes
    dims = ParallelDims.build(p.replace(nproc=nproc), world, mc.n_head, mc.n_layer)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}[o.amp_dtype] if o.amp else None
    notes: list[str] = []
    micro, layers, in_flight = _stage_share(cfg, dims, mc, notes)
    sim = simulate_layers(mc, micro, d.block_size, layers, batch_from, checkpointing=cfg.model.activation_checkpointing,
                          optim=o.optim, amp_dtype=amp)
    states = _sharded_states(sim, mc, dims, p, layers, device, notes)
    step_s = None
    acts = sim["activations"] * in_flight
    per_rank = {**states, "activations": acts, "temporaries": sim["temporaries"], "buffers": sim["buffers"]}
    if device.type == "cpu" and (amp is not None or o.amp is None):  # autocast (or auto, which may choose it)
        if kept := _autocast_kept(states, sim, mc, layers, per_rank):
            per_rank[AUTOCAST_KEPT] = kept
    if device.type == "cpu":
        if runtime_bytes is None:
            runtime_bytes, how, probe_s = runtime(mc, micro, d.block_size,
                                                  checkpointing=cfg.model.activation_checkpointing, optim=o.optim,
                                                  amp_dtype=amp, probe=probe, env=env, threads=p.threads)
            if probe_s and world == 1:  # one process: its step priced from the probe's
                step_s = predicted_step_seconds(mc, layers, d.block_size, probe_s) * o.grad_accum
        else:
            how = "as measured for the configuration asked"
        notes.append(f"runtime (libraries' buffers, per process): {how}")
        if runtime_bytes is not None:
            per_rank["runtime"] = runtime_bytes
    if o.amp is None:
        notes.append("--amp auto: planned in fp32, with the weight copies bf16 autocast leaves in the allocator at "
                     "the optimizer step (bf16's activations are about half, its forward holds the copies too)")
    if AUTOCAST_KEPT in per_rank:
        notes.append(f"{AUTOCAST_KEPT}: the forward's 16-bit copies of the matrices, freed in the backward into "
                     "blocks half the size of the fp32 gradients that follow, so glibc still holds them at the "
                     "optimizer step (gpt2-xl, batch 2, bf16: 3.0 GiB measured there, 2.8 counted)")
    conf = _planned(cfg, sim, dims, world)
    name, avail = device_memory(device)
    return StagePlan("train", per_rank, name, avail, notes, [FIT_HINT], METHOD, scope=_scope(conf), config=conf,
                     steps_bytes=sum(per_rank.values()) - per_rank["parameters"] - per_rank["buffers"], step_s=step_s)


def fit(cfg, device: torch.device | None = None,
        budget_bytes: int | None = None) -> tuple[StagePlan, Any, list[str]]:
    """The cheapest change of `cfg` whose plan fits (`what_fits`): as asked; 8-bit AdamW (moments 8 -> 2 B/param,
    no extra compute); activation checkpointing (one more forward); both; then halving the micro-batch with twice
    the accumulation (same global batch, more steps' overhead). Returns (plan, config, the changes made), the plan
    saying what `--fit` found; the last candidate's when none fits."""
    o, m = cfg.optim, cfg.model
    candidates: list[tuple[list[str], Any]] = [([], cfg)]
    if o.optim != "adamw8bit":
        candidates.append((["--optim adamw8bit"], cfg.replace(optim=o.replace(optim="adamw8bit"))))
    if not m.activation_checkpointing:
        candidates.append((["--activation-checkpointing"], cfg.replace(model=m.replace(activation_checkpointing=True))))
        if o.optim != "adamw8bit":
            candidates.append((["--optim adamw8bit", "--activation-checkpointing"],
                               cfg.replace(optim=o.replace(optim="adamw8bit"),
                                           model=m.replace(activation_checkpointing=True))))
    last_changes, last_cfg = candidates[-1]
    b, acc = last_cfg.optim.batch_size, last_cfg.optim.grad_accum
    while b > 1:
        b, acc = b // 2, acc * 2
        candidates.append((last_changes + [f"--batch-size {b} --grad-accum {acc}"],
                           last_cfg.replace(optim=last_cfg.optim.replace(batch_size=b, grad_accum=acc))))
    first = predict(cfg, device, probe=True)
    found = what_fits([(" ".join(changes), (changes, c)) for changes, c in candidates],  # the runtime measured for
                      lambda option: first if not option[0] else predict(  # the configuration asked stands for all
                          option[1], device, runtime_bytes=first.parts.get("runtime")), limit=budget_bytes)[-1]
    (changes, chosen), plan = found.option, found.plan
    if not found.fits:
        plan.tricks = ["nothing effkit can change on one rank fits; use more processes with --parallel fsdp (or a "
                       "GPU with more memory), or a smaller model"]
    else:
        plan.notes.append(f"--fit: add {found.flags}" if changes else "--fit: fits as asked; nothing to change")
    return plan, chosen, changes


def predict_quietly(cfg) -> dict[str, Any] | None:
    """The plan to put beside the measured peak in a training report; a run never fails for want of one (a bad
    configuration is refused by training next, in one line, before anything is written)."""
    try:
        return predict(cfg).to_dict()
    except EffkitError:  # a bad configuration: training refuses it next, in its own words
        return None
    except Exception as e:  # noqa: BLE001 - the plan is a prediction; training goes on without it
        print(f"memory plan not made ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
        return None
