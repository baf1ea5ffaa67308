"""`--amp auto`: the training precision chosen by measurement, not by a rule about CPUs.

On CUDA, auto is bf16 autocast (fp16 with GradScaler where the GPU has no bf16). On a CPU, whether bf16 autocast
beats fp32 depends on the instructions the CPU has (AVX512-BF16, AMX) and on the model's shape, so effkit
times a few training steps of both on the actual shape, interleaved and paired, and takes bf16 only when it is
measurably faster (the 95% interval of the time ratio below 1). The result is cached per machine, thread count,
torch version and shape, like the GEMM peak, and every report says what was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from effkit.measure import metrics, stats
from effkit.measure.results import PairedRatio

PROBE_ROUNDS = 7  # at most; it stops after 2 once the interval excludes 1
MIN_ROUNDS = 2
DECISIVE = 2.0  # a first paired round in which one side is this many times slower decides alone



def probe_key(config, batch: int, block: int) -> str:
    """Machine (CPU model, features, threads, torch) and shape (layers, width, heads, vocabulary, batch, block)."""
    inner = config.n_inner or 4 * config.n_embd
    shape = f"L{config.n_layer}-d{config.n_embd}-h{config.n_head}-i{inner}-v{config.vocab_size}-b{batch}-t{block}"
    machine = f"{metrics.describe_device(torch.device('cpu'))}|{'+'.join(metrics.cpu_flags()) or 'no-flags'}|" \
              f"torch {torch.__version__}"
    return f"{machine}|{shape}"


def choose(timers: dict[str, Callable[[], float]], rounds: int = PROBE_ROUNDS) -> dict[str, Any]:
    """Time `fp32` and `bf16` (functions returning seconds per step) interleaved, round by round, stopping once
    (after at least 2 rounds) the interval of their ratio excludes 1; bf16 only if measurably faster."""
    samples: dict[str, list[list[float]]] = {"fp32": [], "bf16": []}
    decisive = False
    for r in range(rounds):
        one = metrics.interleaved(timers, 1, 1, warmup=1 if r == 0 else 0)
        for name in samples:  # alternate which goes first, as interleaved() rotates
            samples[name] += one[name]
        timers = dict(reversed(list(timers.items())))
        first = samples["bf16"][0][0] / samples["fp32"][0][0]
        if r == 0 and not 1 / DECISIVE < first < DECISIVE:  # e.g. bf16 emulated 22x slower: more rounds buy nothing
            decisive = True
            break
        if r + 1 >= MIN_ROUNDS and PairedRatio.of(stats.paired_ratio(samples["fp32"],
                                                                      samples["bf16"])).verdict != "same":
            break
    cmp = stats.paired_ratio(samples["fp32"], samples["bf16"])
    typed = PairedRatio.of(cmp)
    rounds = typed.rounds
    faster = first < 1 if decisive else typed.verdict == "faster"
    return {"picked": "bf16" if faster else "fp32", "decided_by_first_round": decisive,
            "probe_seconds": sum(t for v in samples.values() for rnd in v for t in rnd),
            "bf16_vs_fp32_time": cmp, "fp32_step_s": stats.median_of_rounds(samples["fp32"]),
            "bf16_step_s": stats.median_of_rounds(samples["bf16"]),
            "how": f"forward + backward + AdamW of the model's shape on fixed random tokens, fp32 and bf16 autocast "
                   f"interleaved ({rounds} rounds after a warm-up step each, stopping after the first if one side "
                   f"is more than {DECISIVE:g}x slower, else after {MIN_ROUNDS} or more once the 95% interval "
                   f"excludes 1); bf16 is taken only when that interval lies below 1 (or the first round has it "
                   f"{DECISIVE:g}x faster); probe_seconds: the timed steps, warm-up excluded"}


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
    return {**choice, "key": key, "cached": cached}
