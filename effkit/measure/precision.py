"""`--amp auto`: the training precision chosen by measurement, not by a rule about CPUs.

On CUDA, auto is bf16 autocast (fp16 with GradScaler where the GPU has no bf16). On a CPU, whether bf16 autocast
beats fp32 depends on the instructions the CPU has (AVX512-BF16, AMX) and on the model's shape, so effkit
times training steps of both by the decision rule (`effkit.measure.choice`: a tie within the precision goes to
fp32) on the model's shape cut to at most `PROBE_BLOCKS` blocks: the same width, heads, vocabulary, batch and
block, random weights (every block does the same work, so the ratio is the model's; the head and embeddings weigh
a little more in it). A probe of the whole model trained two private copies beside it (gpt2-medium: 497 s and
13.9 GB resident on a 2-core Zen 4 EPYC; gpt2-large was killed at 17.9 GB on 24 GiB). The result is cached per
machine, thread count, torch version and probed shape, like the GEMM peak, and every report says what was
measured. A CPU whose flags show no native bf16 is not probed: fp32, "bf16 not run: <reason>" (`cpu_choice`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from effkit.measure import choice, hardware, machine_cache, stats, timing

# the decision rule, with a short screen (a step is long) and no far screen: the probe reports bf16's paired ratio
PROBE = choice.Rule(rounds=3, budget_s=30.0, far=math.inf)
PROBE_BLOCKS = 4  # the probe's depth: a gpt2-xl probe trains 4 of its 48 blocks (0.14B parameters, not 1.5B)


def probe_config(config):
    """`config` (a `GPT2Config`) with at most PROBE_BLOCKS blocks: the shape the probe trains."""
    c = copy.deepcopy(config)
    c.n_layer = min(config.n_layer, PROBE_BLOCKS)
    return c


def probe_key(config, batch: int, block: int) -> str:
    """Machine (CPU model, features, threads, torch), shape (layers, width, heads, vocabulary, batch, block) and
    the rule's version."""
    inner = config.n_inner or 4 * config.n_embd
    shape = f"L{config.n_layer}-d{config.n_embd}-h{config.n_head}-i{inner}-v{config.vocab_size}-b{batch}-t{block}"
    machine = f"{hardware.describe_device(torch.device('cpu'))}|{'+'.join(hardware.cpu_flags()) or 'no-flags'}|" \
              f"torch {torch.__version__}"
    return f"{machine}|{shape}|{choice.RULE_VERSION}"


def choose(timers: dict[str, Callable[[], float]], rule: choice.Rule = PROBE) -> dict[str, Any]:
    """`fp32` or `bf16` (functions returning seconds per step) by the decision rule (`effkit.measure.choice`); a tie
    within the precision goes to fp32 (its loss is the one the model was built for)."""
    c = choice.choose(timers, False, rule, prefer=lambda n: n != "fp32")
    level = c.record["level"]
    n = min(len(c.samples["fp32"]), len(c.samples["bf16"]))
    cmp = stats.paired_ratio(c.samples["fp32"][:n], c.samples["bf16"][:n], level=level)
    if c.verdict == choice.UNDECIDED:
        cmp["undecided"] = True
    return {"picked": c.picked, "verdict": c.label, "stopping": c.record, "choice": c.to_dict(),
            "samples": c.samples,  # every step time of every sample: the ratio and the pick can be recomputed
            "probe_seconds": sum(t for v in c.samples.values() for rnd in v for t in rnd),
            "bf16_vs_fp32_time": cmp, "fp32_step_s": stats.median_of_rounds(c.samples["fp32"]),
            "bf16_step_s": stats.median_of_rounds(c.samples["bf16"]),
            "how": f"forward + backward + AdamW of the model's shape on fixed random tokens, fp32 and bf16 autocast "
                   f"interleaved; {rule.describe()}; a tie goes to fp32; probe_seconds: the timed steps, warm-up "
                   "excluded"}


def step_seconds(model: torch.nn.Module, batch: int, block: int, dtype: torch.dtype | None) -> Callable[[], float]:
    """Seconds of one training step of a private copy of `model` under autocast `dtype` (None: fp32)."""
    tokens_per_s = timing.train_step_timers(model, (batch,), block, dtype)[batch]
    return lambda: batch * block / tokens_per_s()


def _measure(config, batch: int, block: int) -> dict[str, Any]:
    """fp32 and bf16 autocast training steps of a randomly initialised model of `config`, by the rule."""
    from effkit.model.gpt2 import build_from_config

    model = build_from_config(config)
    return choose({"fp32": step_seconds(model, batch, block, None),
                   "bf16": step_seconds(model, batch, block, torch.bfloat16)})


def cpu_choice(config, batch: int, block: int,
               measure: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The cached choice for this machine and shape (`config`: the model's `GPT2Config`, or the model), measured
    the first time on the shape cut to PROBE_BLOCKS blocks (`measure` overrides the measurement, for tests). A CPU
    whose flags show no native bf16 gets fp32 with nothing timed: bf16 is emulated there, and timing it costs a
    probe many times slower than fp32 only to confirm it."""
    config = getattr(config, "config", config)  # a model: its config (its weights are not used)
    probed = probe_config(config)
    key = probe_key(probed, batch, block)
    if reason := hardware.no_native_bf16():
        return {"picked": "fp32", "not_run": f"bf16 not run: {reason}", "cpu_flags": hardware.cpu_flags(),
                "probe_seconds": 0.0, "key": key, "cached": False, "measured": "nothing timed: the CPU's flags"}
    if measure is None:
        measure = lambda: _measure(probed, batch, block)  # noqa: E731
    choice, cached = machine_cache.machine_cached("amp_probe", key,
                                                  lambda: {**measure(), "cpu_flags": hardware.cpu_flags()})
    depth = (f"the model's shape cut to {probed.n_layer} of its {config.n_layer} blocks (random weights)"
             if probed.n_layer < config.n_layer else "the model's shape (random weights)")
    return {**choice, "key": key, "cached": cached, "probed": depth,
            "measured": machine_cache.cache_note("amp_probe", key) if cached else "measured now"}


def amp_as_trained(o, config: Callable[[], Any], block: int, p) -> tuple[Any, str]:
    """`o` (an OptimConfig) with `--amp auto` resolved on a CPU as training resolves it (`cpu_choice` on the model's
    `config()`, with the threads a process of `p`, a ParallelConfig, trains with; measured once per machine and
    shape and cached, so training reads the same choice): a step priced in fp32 where auto trains in bf16 autocast
    would be another run's step. (the OptimConfig, its precision in words)."""
    import os

    if o.amp is not None or torch.cuda.is_available():
        return o, (o.amp_dtype if o.amp else "fp32") if o.amp is not None else "fp32 for --amp auto"
    before = torch.get_num_threads()
    torch.set_num_threads(p.threads or max(1, (os.cpu_count() or 1) // max(1, p.nproc)))
    try:
        picked = cpu_choice(config(), o.batch_size, block)["picked"]
    finally:
        torch.set_num_threads(before)
    return (o.replace(amp=True, amp_dtype="bf16") if picked == "bf16" else o.replace(amp=False),
            f"{picked} (--amp auto's choice on this CPU)")
