"""`effkit train --parallel auto`: every parallel layout of `nproc x nnodes` processes that fits per rank, ranked by
its predicted step time, on this machine or on a described one (`--simulate`).

A layout is the data-parallel (replicas or shards), tensor and pipeline degrees whose product is the world size,
the pipeline's schedule and micro-batches, and the memory tricks it needs (8-bit AdamW states, activation
checkpointing). Every layout trains the same global batch, `--batch-size` x processes (what every process trains
under ddp), so their step times compare: a layout with data-parallel degree d trains batch x world / d blocks per
rank. Each is planned by `effkit.memplan.predict` (one rank's peak; the machine's memory shared by the processes
on it); one that does not fit as asked is planned again with the tricks, cheapest first (8-bit states cost no
compute, checkpointing a forward more), and one that fits with none of them is listed as not fitting and never
timed. A fitting layout's step is predicted as

    compute + communication + pipeline bubble

- compute: a rank's work in four parts. What grows with its batch: the FLOPs of its blocks (split by the tensor
  degree; the heaviest pipeline stage's; a forward more with checkpointing) and of the vocabulary head (on the
  last stage; whole on every tensor-parallel rank, which replicates it), at the rate the runtime probe's extra
  sequence costs. What a forward and backward cost whatever the batch (reading the weights, writing their
  gradients, dispatching the kernels), paid once per micro-batch: the whole model's, less the optimizer's, in
  proportion to the parameters the rank computes with (the vocabulary matrix, which every pipeline stage holds,
  and its blocks split by the tensor degree; FSDP's whole: it gathers them). The optimizer step and clipping, once
  per step, in proportion to the parameters the rank updates (FSDP's split by the data degree). And what each
  DTensor parameter adds to them (fsdp's and tp's parameters are DTensors: PyTorch's foreach AdamW, a norm
  all-reduced per tensor), per tensor and per element (the foreach kernels against the fused one's). The runtime
  probe times the one-block model's training step at PROBE_BATCH and twice it (`memplan.runtime`, in every
  launched rank at once with the threads a rank gets, in turns, PROBE_MIN_S of steps each at least, medians; cached
  per machine and shape); each extends to the whole model by a block's forward and backward at that batch
  (`machine.time_layers`, in turns in the same launch) and its optimizer step, per further block (not by a
  two-block step less the one-block's, as `train --plan` does: a difference of two whole steps, whose noise the
  blocks multiply; docs/benchmarks.md). What the second batch adds is the rate of what grows with the batch; what
  the two whole-model steps leave beyond it (their mean), the seconds that do not grow; the optimizer's seconds
  per parameter and per DTensor parameter are timed in the same launch (`machine.time_optimizer`). A
  tensor-parallel block costs more than the plain block's work split by the degree: its kernels are as many as the
  plain block's (only narrower) and each op on a DTensor is dispatched through its sharding rules; what a forward
  and backward of one block tensor-parallel over the ranks take beyond the plain block's / the degree and its four
  all-reduces (priced below) is paid per block per micro-batch (`machine.time_layers`, in the same launch at the
  probe's batch, cached per machine and shape). On a described machine: the FLOPs at the peak times its
  efficiency, nothing fixed.
- communication: each collective the layout runs in a step (DDP's gradient all-reduce; FSDP's all-gathers, forward
  and backward, and reduce-scatter per block; tensor parallelism's activation all-reduces, two per block each way;
  the pipeline's sends of activations and their gradients, and the tied head's gradient all-reduced between the
  first and the last stage) priced by a latency + bytes / bandwidth line per collective: on this machine fitted to
  a timing of all_reduce, all_gather and reduce_scatter at a few sizes on the backend, in the probe's launch, once
  per machine and cached (`machine_cached`); in a simulation the ring algorithm's cost on the described links,
  inter-node where the group spans nodes. DDP all-reduces its gradients in buckets while the backward runs: the
  buckets the blocks fill are hidden behind the blocks' backward (two thirds of their compute) as far as it lasts,
  and the last bucket, which holds the token embedding tied to the head (complete only once the backward ends),
  is not hidden; where the ranks' threads take every CPU core, none is (gloo's all-reduce runs on the rank's core,
  taking it from the backward: it hides only beside a device's own stream or a spare core). FSDP's and tensor
  parallelism's collectives are counted whole (nothing overlapped). FSDP2 also copies each unit's parameters into
  and out of its flat all-gather buffer, its gradients into the reduce-scatter's, and runs its hooks: what a
  forward and backward of one sharded block take beyond the plain block's and its two all-gathers and
  reduce-scatter on the fitted lines is paid per unit (the blocks and the root) per micro-batch
  (`machine.time_layers`, timed with the tensor-parallel block).
- bubble: a pipeline's busiest stage works throughout its m micro-batches; the fill and the drain wait on every
  other stage, one micro-batch's forward and backward each (the first stage, holding no head, is lighter than
  the last): sum of the other stages' work / m. With equal stages this is GPipe's idle share (p - 1) / (m + p - 1)
  of the step (1F1B alike; it keeps fewer micro-batches in flight, which the memory plan counts). The fill and the
  drain (the busiest stage's first or last micro-batch, the bubble) run while ranks wait, at a rank's pace alone,
  faster on a CPU, whose ranks share memory bandwidth and caches: by a one-block training step's time in all ranks
  at once over its time in one alone (`machine.time_layers`; past 2 stages an upper bound); 1 on a described
  machine."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError
from effkit.parallel.machine import (  # noqa: F401  (the probe's settings: read where the ranking is)
    PROBE_BATCH,
    PROBE_MIN_S,
    PROBE_ROUNDS,
    Hardware,
    Link,
    _block_params,
    _vocab_params,
    this_machine,
)

TRICKS = ((), ("adamw8bit",), ("checkpointing",), ("adamw8bit", "checkpointing"))  # cheapest first
TRIAL_ROUNDS = 3  # paired rounds of the trial of the best-predicted layouts
# a trial run's first steps, not in its sample: the first builds the optimizer's state, the second rebuilds DDP's
# buckets in the order the gradients arrived; the ranking predicts the steps of a training run after them
TRIAL_WARMUP_STEPS = 2


# presets: vendor figures (peak dense bf16, memory, NVLink per direction, one InfiniBand NIC per GPU)
PRESETS: dict[str, dict[str, Any]] = {
    "a100-nvlink": dict(devices_per_node=8, memory_gib=80, peak_tflops=312, efficiency=0.5, intra_gbps=300,
                        intra_latency_us=5, inter_gbps=25, inter_latency_us=10),  # HDR 200 Gb/s per GPU
    "h100-nvlink": dict(devices_per_node=8, memory_gib=80, peak_tflops=989, efficiency=0.5, intra_gbps=450,
                        intra_latency_us=5, inter_gbps=50, inter_latency_us=10),  # NDR 400 Gb/s per GPU
    "a100-pcie": dict(devices_per_node=8, memory_gib=40, peak_tflops=312, efficiency=0.5, intra_gbps=25,
                      intra_latency_us=10, inter_gbps=12.5, inter_latency_us=15),
}
DESCRIPTION_KEYS = set(PRESETS["a100-nvlink"])


def simulated_hardware(spec: str) -> Hardware:
    """A described machine: a preset's name, a JSON file, or inline JSON with DESCRIPTION_KEYS (a preset's
    `"preset"` key takes its values as defaults)."""
    if spec in PRESETS:
        d, name = dict(PRESETS[spec]), spec
    else:
        try:
            d = json.loads(Path(spec).read_text() if Path(spec).is_file() else spec)
        except (json.JSONDecodeError, OSError, ValueError):
            raise EffkitError(f"--simulate {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON "
                              "description (a file or inline)") from None
        if not isinstance(d, dict):
            raise EffkitError(f"--simulate: the description must be a JSON object with {sorted(DESCRIPTION_KEYS)}")
        name = str(d.pop("name", "described machine"))
        d = {**PRESETS.get(str(d.pop("preset", "")), {}), **d}
    if unknown := set(d) - DESCRIPTION_KEYS:
        raise EffkitError(f"--simulate: unknown keys {sorted(unknown)}; the description has {sorted(DESCRIPTION_KEYS)}")
    if missing := DESCRIPTION_KEYS - set(d):
        raise EffkitError(f"--simulate: {name} lacks {sorted(missing)}; give them or a \"preset\" to start from")
    if not all(isinstance(v, (int, float)) and v > 0 for v in d.values()):
        raise EffkitError(f"--simulate: every figure of {name} must be a positive number")
    intra = Link(d["intra_latency_us"] * 1e-6, d["intra_gbps"] * 1e9)
    inter = Link(d["inter_latency_us"] * 1e-6, d["inter_gbps"] * 1e9)
    return Hardware(name, int(d["devices_per_node"]), int(d["memory_gib"] * 2**30), d["peak_tflops"] * 1e12,
                    d["efficiency"], {"all": intra}, {"all": inter},
                    how={"description": json.dumps(d, sort_keys=True)})


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """One way to lay out the processes: the effkit mode, its degrees, the pipeline's schedule and micro-batches,
    and the memory tricks (`adamw8bit`, `checkpointing`) added to what was asked."""

    mode: str
    dp: int
    tp: int = 1
    pp: int = 1
    schedule: str = ""
    microbatches: int = 1
    tricks: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.mode in ("fsdp", "fsdp+tp", "pp+fsdp")

    def describe(self) -> str:
        how = " (sharded)" if self.sharded else " (replicas)" if self.dp > 1 else ""
        pipe = f", {self.schedule} x{self.microbatches}" if self.pp > 1 else ""
        return f"{self.mode}: dp {self.dp}{how} x tp {self.tp} x pp {self.pp}{pipe}"

    def config(self, cfg, global_batch: int):
        """`cfg` (a TrainConfig) trained in this layout: its flags applied, the global batch split by dp."""
        p, o, m = cfg.parallel, cfg.optim, cfg.model
        return cfg.replace(
            parallel=p.replace(mode=self.mode, tp_size=self.tp if self.mode == "fsdp+tp" else 0,
                               pp_size=self.pp if self.mode == "pp+fsdp" else 0,
                               pp_schedule=self.schedule or p.pp_schedule,
                               microbatches=self.microbatches if self.pp > 1 else p.microbatches),
            optim=o.replace(batch_size=global_batch // self.dp,
                            optim="adamw8bit" if "adamw8bit" in self.tricks else o.optim),
            model=m.replace(activation_checkpointing=m.activation_checkpointing or "checkpointing" in self.tricks))

    def flags(self, global_batch: int) -> str:
        """The `effkit train` flags that train this layout."""
        f = [f"--parallel {self.mode}", f"--batch-size {global_batch // self.dp}"]
        f += [f"--tp-size {self.tp}"] if self.mode == "fsdp+tp" else []
        f += [f"--pp-size {self.pp}"] if self.mode == "pp+fsdp" else []
        f += [f"--pp-schedule {self.schedule} --microbatches {self.microbatches}"] if self.pp > 1 else []
        f += ["--optim adamw8bit"] if "adamw8bit" in self.tricks else []
        f += ["--activation-checkpointing"] if "checkpointing" in self.tricks else []
        return " ".join(f)


def enumerate_layouts(world: int, n_head: int, n_layer: int, global_batch: int) -> tuple[list[Layout], list[str]]:
    """Every layout effkit runs on `world` processes for a model of `n_head` heads and `n_layer` blocks and a global
    batch of `global_batch` blocks (pipelines: 1, 2 and 4 micro-batches per stage where the batch divides), and
    the ones it cannot run, each with why."""
    degrees = [("ddp", world, 1, 1), ("fsdp", world, 1, 1), ("tp", 1, world, 1), ("pp", 1, 1, world)]
    degrees += [("fsdp+tp", world // t, t, 1) for t in range(2, world) if world % t == 0]
    degrees += [("pp+fsdp", world // s, 1, s) for s in range(2, world) if world % s == 0]
    out, skipped = [], []
    for mode, dp, tp, pp in degrees:
        layout = Layout(mode, dp, tp, pp)
        why = (f"tp {tp} does not divide the {n_head} heads" if n_head % tp else
               f"{pp} stages for {n_layer} blocks" if pp > n_layer else
               f"dp {dp} does not divide the global batch {global_batch}" if global_batch % dp else "")
        if why:
            skipped.append(f"{layout.describe()}: {why}")
        elif pp == 1:
            out.append(layout)
        else:
            per_rank = global_batch // dp
            ms = [k * pp for k in (1, 2, 4) if per_rank % (k * pp) == 0]
            if not ms:
                skipped.append(f"{layout.describe()}: no micro-batch count of at least {pp} divides {per_rank}")
            out += [replace(layout, schedule=s, microbatches=m) for s in ("gpipe", "1f1b") for m in ms]
    return out, skipped


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The pipeline's idle share of a step with equal stages: (p - 1) / (m + p - 1) for p stages and m
    micro-batches (GPipe, 1F1B)."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_seconds(stage_s: list[float], microbatches: int) -> tuple[float, float]:
    """A pipeline's (busy, bubble) seconds for stages whose forward and backward of all `microbatches` take
    `stage_s`: the busiest stage works throughout, and the fill and the drain wait on every other stage once per
    micro-batch (m x t_busiest + the others' t per micro-batch: GPipe's bubble when the stages are equal)."""
    busiest = max(stage_s)
    return busiest, (sum(stage_s) - busiest) / microbatches


DDP_BUCKET_BYTES = (1 << 20, 25 << 20)  # DistributedDataParallel's first gradient bucket and the others (its caps)


def ddp_buckets(mc, nbytes: int = 4) -> list[int]:
    """Bytes of DDP's gradient buckets, in the order they are all-reduced: the parameter tensors in the order
    their gradients are complete (ln_f, the blocks from the last, each tensor in backward order, then the position
    embedding, and the token embedding last: the tied head's gradient is complete only once the embedding's
    backward adds to it), a bucket closed once it reaches its cap."""
    d, inner = mc.n_embd, mc.n_inner or 4 * mc.n_embd
    block = [inner * d + d, d * inner + inner, 2 * d, d * d + d, 3 * d * d + 3 * d, 2 * d]
    buckets, cap = [0], DDP_BUCKET_BYTES[0]
    for n in [2 * d, *block * mc.n_layer, mc.n_positions * d, mc.vocab_size * d]:
        buckets[-1] += n * nbytes
        if buckets[-1] >= cap:
            buckets, cap = [*buckets, 0], DDP_BUCKET_BYTES[1]
    return [b for b in buckets if b]


def predict_step(layout: Layout, mc, block: int, global_batch: int, grad_accum: int, hw: Hardware,
                 amp: bool) -> dict[str, float]:
    """One training step of `layout` on `hw`, in seconds: compute, communication and the pipeline's bubble (see
    the module's text)."""
    from effkit.memplan import step_flops

    tokens = global_batch // layout.dp * block  # per rank per micro-step
    L, p, rate = mc.n_layer, layout.pp, hw.peak_flops * hw.efficiency
    stages = [L * (i + 1) // p - L * i // p for i in range(p)]  # `pipeline.stage_layers`'s blocks per stage
    recompute = 4 / 3 if "checkpointing" in layout.tricks else 1
    head = step_flops(mc, 0, tokens, block) / rate
    per_block = (step_flops(mc, 1, tokens, block) - step_flops(mc, 0, tokens, block)) * recompute / layout.tp / rate
    m = layout.microbatches if p > 1 else 1
    whole = _vocab_params(mc) + L * _block_params(mc)

    def held(blocks: int) -> float:  # a rank's share of the parameters: every stage holds a vocabulary matrix
        return (_vocab_params(mc) + blocks * _block_params(mc) / layout.tp) / whole

    tp_block = hw.tp_block_s if layout.tp > 1 else 0.0
    busy, bubble = pipeline_seconds([m * (hw.fixed_s * held(n) + n * tp_block) + n * per_block + head * (i == p - 1)
                                     for i, n in enumerate(stages)], m)
    if p > 1:  # the fill and the drain (a micro-batch of the busiest stage, the bubble) run while ranks wait
        busy, bubble = busy - busy / m * (1 - 1 / hw.solo_speedup), bubble / hw.solo_speedup
    blocks = max(stages)  # the heaviest stage's (all on one stage: the whole model)
    dtensors = 12 * blocks + 4 if layout.sharded else 8 * blocks if layout.tp > 1 else 0
    updated = held(blocks) * whole / (layout.dp if layout.sharded else 1)  # the parameters this rank updates
    in_dtensors = updated if layout.sharded else blocks * _block_params(mc) / layout.tp if layout.tp > 1 else 0
    compute = busy * grad_accum + hw.optimizer_s * updated / whole + hw.dtensor_s * dtensors \
        + hw.dtensor_param_s * in_dtensors
    act = tokens * mc.n_embd * (2 if amp else 4)
    gpn, world = hw.devices_per_node, layout.dp * layout.tp * p
    dp_spans, tp_spans = layout.dp * layout.tp > gpn, layout.tp > gpn
    pp_spans = layout.dp * layout.tp >= gpn and world > gpn
    stage = blocks * _block_params(mc) / layout.tp + _vocab_params(mc)

    def cost(kind: str, nbytes: float, n: int, spans: bool, times: float = 1) -> float:
        return times * hw.link(kind, spans).seconds(kind, nbytes, n)

    comm = 0.0
    if layout.mode == "ddp":  # the last bucket after the backward; the others while the blocks' backward runs
        *others, last = [cost("all_reduce", b, layout.dp, dp_spans) for b in ddp_buckets(mc)]
        comm += last + max(0.0, sum(others) - (2 / 3 * L * per_block if hw.overlaps else 0.0))
    if layout.sharded:  # per block and the root: gathered forward and backward each micro-step, reduced once
        units, gathers = blocks + 1, 2 * grad_accum * (layout.microbatches if p > 1 else 1)
        pbytes = 2 if amp else 4
        comm += cost("all_gather", pbytes * stage / units, layout.dp, dp_spans, gathers * units)
        comm += cost("reduce_scatter", pbytes * stage / units, layout.dp, dp_spans, units)
        comm += hw.fsdp_unit_s * units * gathers / 2  # FSDP2's unsharding and resharding of each unit, per pass
    if layout.tp > 1:  # two all-reduces per block forward and two backward (one more forward when recomputed)
        comm += cost("all_reduce", act, layout.tp, tp_spans, blocks * (6 if recompute > 1 else 4) * grad_accum)
    if p > 1:  # each stage receives every micro-batch's activations and sends back their gradients; the tied
        m = layout.microbatches  # head's gradient summed with the embedding's on the first stage
        comm += cost("send", act / m, 2, pp_spans, 2 * m * grad_accum)
        comm += cost("all_reduce", 4 * mc.vocab_size * mc.n_embd, 2, pp_spans) if mc.tie_word_embeddings else 0
    bubble *= grad_accum
    return {"step_s": compute + comm + bubble, "compute_s": compute, "comm_s": comm, "bubble_s": bubble}


# ----------------------------------------------------------------------------- the ranking


def rank(cfg, simulate: str = "") -> dict[str, Any]:
    """The ranking `--parallel auto` chooses from: every layout (`enumerate_layouts`) planned, the tricks tried
    where it does not fit as asked, and the fitting ones ranked by predicted step time; on this machine, or on the
    machine `simulate` describes (`simulated_hardware`: on paper)."""
    import torch

    from effkit import memplan
    from effkit.parallel.launch import nproc_per_node
    from effkit.stageplan import what_fits

    start = time.perf_counter()
    p, o = cfg.parallel, cfg.optim
    mc = memplan._model_config(cfg)
    if simulate:
        hw = simulated_hardware(simulate)
        world, device, runtime_bytes = (p.nproc or hw.devices_per_node) * p.nnodes, torch.device("meta"), None
    else:
        world = nproc_per_node(p) * p.nnodes
        (hw, runtime_bytes), device = this_machine(cfg, mc, world), torch.device("cpu")
    global_batch = o.batch_size * world
    layouts, skipped = enumerate_layouts(world, mc.n_head, mc.n_layer, global_batch)

    def plan_of(layout: Layout):
        c = layout.config(cfg, global_batch)
        c = c.replace(parallel=c.parallel.replace(nproc=world // p.nnodes))
        plan = memplan.predict(c, device, runtime_bytes=runtime_bytes, model_config=mc, batch_from=o.batch_size)
        plan.device, plan.device_bytes = hw.name, hw.memory_bytes
        return plan

    rows = []
    for base in layouts:
        tricks = [t for t in TRICKS if ("adamw8bit" not in t or o.optim == "adamw")
                  and ("checkpointing" not in t or not cfg.model.activation_checkpointing)]
        for tried in what_fits([(" ".join(t), replace(base, tricks=t)) for t in tricks], plan_of):
            layout = tried.option
            row = {"layout": layout.describe(), "flags": layout.flags(global_batch), "fits": tried.fits,
                   "per_rank_bytes": tried.plan.required_bytes, "usable_bytes": tried.plan.usable_bytes,
                   "tricks": list(layout.tricks), **asdict(layout)}
            if tried.fits:  # a layout that does not fit is never priced, nor timed
                row |= predict_step(layout, mc, cfg.data.block_size, global_batch, o.grad_accum, hw, o.amp)
            rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], r.get("step_s", 0)))
    return {"world": world, "nnodes": p.nnodes, "model": cfg.model.name, "global_batch": global_batch,
            "block_size": cfg.data.block_size, "simulated": hw.simulated, "hardware": hw.to_dict(),
            "layouts": rows, "not_runnable": skipped, "elapsed_s": time.perf_counter() - start,
            "method": __doc__.split("\n\n", 1)[1]}


def choose(cfg, plan: bool, time_steps: Callable[[list[Any]], list[list[float]]] | None = None
           ) -> tuple[Any, dict | None]:
    """`--parallel auto` resolved before training: (the configuration to train or plan, the ranking made; None
    where there is nothing to choose: one process). With `plan`, the ranking only; else the best-predicted
    `--auto-top` fitting layouts are timed side by side (`trial`, with `time_steps`: configurations' step times)
    and training goes on with the winner."""
    from effkit.parallel.launch import nproc_per_node

    p = cfg.parallel
    if p.simulate and not (plan and p.mode == "auto"):
        raise EffkitError("--simulate ranks the layouts on paper and trains nothing: effkit train --parallel auto "
                          "--plan --simulate a100-nvlink [options]")
    if (p.nproc if p.simulate else nproc_per_node(p)) * p.nnodes == 1:
        print("--parallel auto: one process, nothing to choose; training in this process")
        return cfg.replace(parallel=p.replace(mode="none", nproc=1)), None
    ranking = rank(cfg, p.simulate)
    if plan:
        return cfg, ranking
    fitting = [r for r in ranking["layouts"] if r["fits"]][: p.auto_top]
    if not fitting:
        raise EffkitError(f"--parallel auto: no layout of {ranking['world']} processes fits per rank, even with "
                          "8-bit AdamW and activation checkpointing; `--parallel auto --plan` lists them")
    best, why = trial(cfg, fitting, ranking["global_batch"], time_steps) if len(fitting) > 1 and time_steps else (
        fitting[0], "the only one fitting" if len(fitting) == 1 else "predicted fastest (--auto-top 1: not timed)")
    ranking["chosen"] = {"layout": best["layout"], "flags": best["flags"], "why": why}
    print(f"--parallel auto: {best['layout']} [{best['flags']}]: {why}")
    return _layout_of(best).config(cfg, ranking["global_batch"]), ranking


def _layout_of(row: dict[str, Any]) -> Layout:
    return Layout(**{k: row[k] for k in ("mode", "dp", "tp", "pp", "schedule", "microbatches")},
                  tricks=tuple(row["tricks"]))


def trial(cfg, rows: list[dict[str, Any]], global_batch: int,
          time_steps: Callable[[list[Any]], list[list[float]]]) -> tuple[dict[str, Any], str]:
    """The layouts of `rows` timed side by side: TRIAL_ROUNDS paired rounds (each runs every layout once for
    `--auto-steps` steps, in an order shuffled from a seed; its steps after the first TRIAL_WARMUP_STEPS are the
    round's sample), decided by the decision rule (`effkit.measure.choice.decide`: Holm's intervals over the pairs;
    a tie or an undecided leader goes to the better prediction). Each row gets its measured step beside its prediction;
    returns (the winner's row, why it won)."""
    import random

    from effkit.measure.choice import Rule, decide

    steps = cfg.parallel.auto_steps
    samples: dict[str, list[list[float]]] = {r["layout"]: [] for r in rows}
    order, rng = list(rows), random.Random(Rule.seed)
    runs = []  # (row, configuration) in the rounds' orders, timed in one go
    for _ in range(TRIAL_ROUNDS):
        rng.shuffle(order)
        for r in order:
            c = _layout_of(r).config(cfg, global_batch)
            runs.append((r, c.replace(optim=c.optim.replace(max_steps=steps, max_tokens=0, time_budget=0))))
    for (r, _), times in zip(runs, time_steps([c for _, c in runs]), strict=True):
        samples[r["layout"]].append(times[TRIAL_WARMUP_STEPS:])
    rule = Rule()
    choice = decide(samples, False, rule.level, rule.precision, prefer=[r["layout"] for r in rows].index)
    for r in rows:
        r["measured_step_s"] = statistics.median(t for rnd in samples[r["layout"]] for t in rnd)
        r["predicted_over_measured"] = r["step_s"] / r["measured_step_s"]
        r["samples_s"] = samples[r["layout"]]
    best = next(r for r in rows if r["layout"] == choice.picked)
    return best, (f"timed against the next {len(rows) - 1} by prediction, {TRIAL_ROUNDS} paired rounds of {steps} "
                  f"steps: {choice.line()}")
