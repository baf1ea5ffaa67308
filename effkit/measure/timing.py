"""Timing: fixed random inputs on the model's device (`random_tokens`), timers of a forward pass (`forward_timer`,
also of a `torch.compile` twin, `compile_for_inference`) and of training steps (`train_step_timers`), wall time per
phase of a training step (`PhaseClock`), the interleaved-rounds protocol (`interleaved`, `round_order`,
`INTERLEAVED_PROTOCOL`; `medians_in_turns`: steps timed in turns up to a time floor) with the idle time after a
contender whose threads spin (`settle_time`, `SETTLE_S`), and latency percentiles (`latency_stats`).
`effkit.measure.stopping` runs the rounds until comparisons are decided."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from effkit.measure.engine_model import model_attr
from effkit.measure.evaluation import lm_loss
from effkit.measure.hardware import autocast_ctx, model_device

# seconds of idle machine after timing a contender whose runtime keeps spin-waiting threads after a call (ONNX
# Runtime's sessions; CTranslate2 with more than one thread): long enough for all of them to go to sleep before the
# next contender is timed, short against a round (docs/benchmarks.md has the measurement)
SETTLE_S = 0.2
INTERLEAVED_PROTOCOL = ("paired and interleaved: after {warmup} warm-up call(s) each, rounds ({rounds}); in each round "
                        "every contender runs {repeats} timed repeat(s) (sequential rounds: more where a sample would "
                        "last under 0.2 s, `calls_per_sample` in the stopping record), in an order shuffled each "
                        "round from a seed (in the stopping record), so that drift of the machine and carry-over "
                        "from the contender before hit every contender alike; after a contender whose runtime keeps "
                        "spin-waiting threads (ONNX Runtime; CTranslate2 on more than one thread) the machine idles "
                        "0.2 s, untimed, so they do not slow the next")


def random_tokens(model, batch: int, block: int, seed: int = 0) -> torch.Tensor:
    """Fixed random token ids of shape (batch, block) on the model's device (the input of latency and
    throughput measurements; drawn on the CPU so that every device sees the same ids)."""
    x = torch.randint(0, model.config.vocab_size, (batch, block), generator=torch.Generator().manual_seed(seed))
    return x.to(model_device(model))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_timer(model, batch: int, block: int, amp_dtype: torch.dtype | None = None,
                  **kwargs: Any) -> Callable[[], float]:
    """A function timing one forward pass of (batch, block) fixed random tokens (seconds), with `kwargs` passed to
    the model (a prefill: `use_cache=True`); the model must be in eval mode."""
    device = model_device(model)
    x = random_tokens(model, batch, block)

    @torch.inference_mode()
    def once() -> float:
        synchronize(device)
        t = time.perf_counter()
        with autocast_ctx(device, amp_dtype):
            model(x, **kwargs)
        synchronize(device)
        return time.perf_counter() - t

    once.settle_s = settle_time(model)
    return once


def compile_for_inference(model, batches: tuple[int, ...], block: int, **kwargs: Any) -> tuple[Any, str]:
    """`torch.compile` of `model` (Inductor, weights frozen as constants, static shapes), compiled and warmed up at
    every batch size in `batches` with the forward's `kwargs` (a prefill's); (None, "not run: <reason>") where it
    cannot be or fails."""
    if not model_attr(model, "compilable"):
        return None, "not run: an ONNX Runtime artifact (its graph is already optimized by ONNX Runtime)"
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # recompile-limit notices (bitsandbytes' modules)
    # freezing for this compilation only (an Inductor option, not the process-wide switch: compiled decoding
    # mutates its static KV cache, which freezing would fold into constants)
    compiled = torch.compile(model, dynamic=False, options={"freezing": True})
    try:
        for b in batches:
            forward_timer(compiled, b, block, **kwargs)()
    except Exception as e:  # noqa: BLE001 - modules Inductor cannot compile: reported, not fatal
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"not run: torch.compile failed ({type(e).__name__}: {first[:120]})"
    return compiled, "torch.compile(dynamic=False), Inductor with freezing"


def settle_time(model) -> float:
    """Seconds to leave the machine idle after timing `model` (or a timer of it), before the next contender:
    engines whose idle threads spin-wait after a run (ONNX Runtime's default, which effkit keeps: its users run
    it, and it decodes markedly faster) would otherwise take the cores from whatever is timed next."""
    return float(model_attr(model, "settle_s"))


def start_round(fn: Callable[[], float], r: int) -> None:
    """Tell a timer that times other inputs in other rounds (its `at_round`: `generation.by_round`) that its next
    sample is round `r`'s: every contender of a round then times the same inputs."""
    if (at := getattr(fn, "at_round", None)) is not None:
        at(r)


def round_order(names: list[str], r: int, seed: int | None) -> list[str]:
    """The order of round `r`: each pair of rounds shuffles the contenders from (`seed`, `r // 2`) and runs the
    second round in the reverse order, so that no contender always runs right after the same one (carry-over from
    spinning threads or warm caches then hits every pair alike) while every contender is as often early as late
    in a round (drift within a round cancels, as it did under rotation); with `seed` None, the old rotation by one
    each round (which keeps the cyclic order: each contender always follows the same one)."""
    if seed is None:
        k = r % len(names)
        return names[k:] + names[:k]
    order = list(names)
    random.Random(f"{seed}:{r // 2}").shuffle(order)
    return order[::-1] if r % 2 else order


def interleaved(contenders: dict[str, Callable[[], float]], rounds: int, repeats: int | dict[str, int],
                warmup: int = 1, offset: int = 0, seed: int | None = None) -> dict[str, list[list[float]]]:
    """Measure every contender (a function returning one timing or rate) in `rounds` rounds of `repeats` calls (or
    {name: calls}), in a new order each round (`round_order`: shuffled from `seed`; `offset`: rounds already run),
    after `warmup` calls each; after a contender's calls the machine is left idle for its `settle_s` (untimed; see
    `settle_time`). Returns {name: [[round 1 repeats], ...]}. `effkit.measure.stopping.measure` runs it until
    comparisons are decided."""
    names = list(contenders)
    calls = repeats if isinstance(repeats, dict) else dict.fromkeys(names, repeats)

    def settle(name: str) -> None:
        if (pause := settle_time(contenders[name])) > 0:
            time.sleep(pause)

    for name in names:
        for _ in range(warmup):
            contenders[name]()
        settle(name)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r + offset, seed):
            start_round(contenders[name], r + offset)
            samples[name].append([contenders[name]() for _ in range(calls[name])])
            settle(name)
    return samples


def medians_in_turns(contenders: dict[Any, Callable[[], float]], rounds: int, min_s: float = 0.0,
                     warmup: int = 1, agree: Callable[[list[int]], list[int]] | None = None) -> dict[Any, float]:
    """The median of each contender's timings (functions that time one call of what they run), run in turns:
    `warmup` calls each, discarded, then `rounds` rounds (`interleaved`, rotated) in which each runs enough
    consecutive calls that its timed calls add up to at least `min_s` by its fastest warm-up call (a time floor: a
    short step is timed many times, a long one `rounds` times). `agree` maps the calls per contender to the ones
    run, the same in every process timing together (their maximum)."""
    import math
    import statistics

    pilot = {n: min(fn() for _ in range(warmup)) if warmup else 0.0 for n, fn in contenders.items()}
    calls = [max(1, math.ceil(min_s / rounds / t)) if t > 0 else 1 for t in pilot.values()]
    samples = interleaved(contenders, rounds, dict(zip(contenders, agree(calls) if agree else calls, strict=True)),
                          warmup=0)
    return {n: statistics.median(t for r in s for t in r) for n, s in samples.items()}


def latency_stats(rounds: list[list[float]]) -> dict[str, float]:
    """p50/p90/p99, min/max and the relative spread (max - min) / p50 of every timing of every round."""
    times = [t for rnd in rounds for t in rnd]
    ts = torch.tensor(times, dtype=torch.float64)
    p50 = float(ts.quantile(0.5))
    return {"p50_s": p50, "p90_s": float(ts.quantile(0.9)), "p99_s": float(ts.quantile(0.99)),
            "min_s": float(ts.min()), "max_s": float(ts.max()), "spread": float((ts.max() - ts.min()) / p50),
            "samples": len(times)}


class PhaseClock:
    """Wall time per phase of a step (`lap("forward")` charges the time since the last lap to "forward"),
    summed over steps; CUDA is synchronised at each lap when `sync` is set (exact, slower)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.device, self.sync = device, sync and device.type == "cuda"
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


def train_step_timers(model, batches: tuple[int, ...], block: int,
                      amp_dtype: torch.dtype | None = None) -> dict[int, Callable[[], float]]:
    """For each batch size, a function that runs one forward + backward + AdamW step (under autocast `amp_dtype`)
    with (batch, block) fixed random tokens and returns tokens per second; all of them train one private copy of
    `model` with one optimizer (one copy's memory, whatever the number of batch sizes)."""
    import copy

    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    device = model_device(model)

    def timer(batch: int) -> Callable[[], float]:
        x = random_tokens(model, batch, block)

        def once() -> float:
            synchronize(device)
            t = time.perf_counter()
            with autocast_ctx(device, amp_dtype):
                loss = lm_loss(model(x).logits, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            return batch * block / (time.perf_counter() - t)

        return once

    return {b: timer(b) for b in batches}
