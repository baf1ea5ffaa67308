"""`--amp auto`: the training precision chosen by measurement, not by a rule about CPUs.

On CUDA, auto is bf16 autocast (fp16 with GradScaler where the GPU has no bf16). On a CPU, whether bf16 autocast
beats fp32 depends on the instructions the CPU has (AVX512-BF16, AMX) and on the model's shape, so effkit
times training steps of both on the actual shape, interleaved and paired under the bench's sequential rule, and
takes bf16 only when it is measurably faster (the interval of the time ratio below 1, Bonferroni-corrected over the
looks). The result is cached per machine, thread count,
torch version and shape, like the GEMM peak, and every report says what was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from effkit.measure import metrics, stats, stopping
from effkit.measure.results import PairedRatio

PROBE = stopping.Stopping(rounds=3, precision=0.03, budget_s=30.0)  # the bench's rule: looks of 3, 6, 12 rounds


def probe_key(config, batch: int, block: int) -> str:
    """Machine (CPU model, features, threads, torch) and shape (layers, width, heads, vocabulary, batch, block)."""
    inner = config.n_inner or 4 * config.n_embd
    shape = f"L{config.n_layer}-d{config.n_embd}-h{config.n_head}-i{inner}-v{config.vocab_size}-b{batch}-t{block}"
    machine = f"{metrics.describe_device(torch.device('cpu'))}|{'+'.join(metrics.cpu_flags()) or 'no-flags'}|" \
              f"torch {torch.__version__}"
    return f"{machine}|{shape}"


def choose(timers: dict[str, Callable[[], float]], rule: stopping.Stopping = PROBE) -> dict[str, Any]:
    """Time `fp32` and `bf16` (functions returning seconds per step) interleaved and paired, under the bench's
    sequential rule (looks of 3, 6 and 12 rounds, each interval at 1 - 0.05/3, a time budget); bf16 only if its
    interval of the time ratio lies below 1. No round decides alone."""
    measured = stopping.measure(timers, rule, 1, warmup=1, pairs=[("fp32", "bf16")])
    cmp = measured.ratio("fp32", "bf16")
    typed = PairedRatio.of(cmp)
    return {"picked": "bf16" if typed.verdict == "faster" else "fp32", "stopping": measured.record,
            "samples": dict(measured),  # every step time of every round: the ratio can be recomputed
            "probe_seconds": sum(t for v in measured.values() for rnd in v for t in rnd),
            "bf16_vs_fp32_time": cmp, "fp32_step_s": stats.median_of_rounds(measured["fp32"]),
            "bf16_step_s": stats.median_of_rounds(measured["bf16"]),
            "how": f"forward + backward + AdamW of the model's shape on fixed random tokens, fp32 and bf16 autocast "
                   f"interleaved, one step each per round after a warm-up step; rounds: {rule.describe()}; bf16 is "
                   f"taken only when the ratio's interval (at {typed.level or 0.95:.1%}) lies below 1; probe_seconds: "
                   "the timed steps, warm-up excluded"}


def step_seconds(model: torch.nn.Module, batch: int, block: int, dtype: torch.dtype | None) -> Callable[[], float]:
    """Seconds of one training step of a private copy of `model` under autocast `dtype` (None: fp32)."""
    tokens_per_s = metrics.train_step_timers(model, (batch,), block, dtype)[batch]
    return lambda: batch * block / tokens_per_s()


def cpu_choice(model: torch.nn.Module, batch: int, block: int,
               measure: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The cached choice for this machine and shape, measured on `model` the first time (`measure` overrides
    the measurement, for tests)."""
    key = probe_key(model.config, batch, block)
    if measure is None:
        measure = lambda: choose({"fp32": step_seconds(model, batch, block, None),  # noqa: E731
                                  "bf16": step_seconds(model, batch, block, torch.bfloat16)})
    choice, cached = metrics.machine_cached("amp_probe", key, lambda: {**measure(), "cpu_flags": metrics.cpu_flags()})
    return {**choice, "key": key, "cached": cached,
            "measured": metrics.cache_note("amp_probe", key) if cached else "measured now"}
