"""Measurement: peak memory, peak FLOP/s (for MFU), evaluation protocol, device description."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from effkit.data.tokenizer import cache_dir
from effkit.errors import EffkitError
from effkit.measure import stats

EVAL_PROTOCOL = ("token-level mean cross-entropy over the fixed held-out blocks (documents held out by a hash "
                 "of their id; eval_blocks non-overlapping blocks of block_size spread evenly over the whole "
                 "held-out text, so every held-out document contributes in proportion to its length); "
                 "perplexity = exp(loss); bits per byte = loss x predicted tokens / ln 2 / UTF-8 bytes of the "
                 "predicted text")

# Peak FLOP/s per GPU and precision, from NVIDIA's data sheets, dense (without sparsity): "bf16" (fp16 where the
# GPU has no bf16) and "tf32" are tensor-core figures, "fp32" the plain FMA units. Matched by the exact name
# `torch.cuda.get_device_name` returns (an H100 PCIe is not an H100 SXM; "NVIDIA L40" is not "NVIDIA L4"); a GPU
# not listed gets no MFU, and the report says so.
_H100_SXM = {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}
_H100_NVL = {"bf16": 836e12, "tf32": 418e12, "fp32": 60e12}
_A100 = {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_V100_SXM2 = {"bf16": 125e12, "fp32": 15.7e12}  # fp16 tensor cores; no bf16, no TF32
GPU_PEAKS: dict[str, dict[str, float]] = {
    "NVIDIA H200": _H100_SXM, "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA H100 80GB HBM3": _H100_SXM,  # SXM5
    "NVIDIA H100 PCIe": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA A100-SXM4-80GB": _A100, "NVIDIA A100-SXM4-40GB": _A100, "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "NVIDIA L40": {"bf16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "NVIDIA L4": {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "NVIDIA A10": {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "NVIDIA GeForce RTX 4090": {"bf16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "NVIDIA GeForce RTX 3090": {"bf16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "Tesla V100-SXM2-16GB": _V100_SXM2, "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": {"bf16": 112e12, "fp32": 14e12},
    "Tesla T4": {"bf16": 65e12, "fp32": 8.1e12},
}


def matmul_precision(amp_dtype: torch.dtype | None, tf32: bool) -> str:
    """The precision the training matmuls run in: "bf16" (or fp16) under autocast, "tf32" for fp32 matmuls with
    TF32 on, else "fp32"."""
    if amp_dtype is not None:
        return "bf16"
    return "tf32" if tf32 else "fp32"


def gpu_peak_flops(name: str, precision: str) -> tuple[float | None, str]:
    """The data-sheet peak of GPU `name` (exact match) in `precision`, and where the figure comes from."""
    peaks = GPU_PEAKS.get(name)
    if peaks is None:
        return None, f"unknown GPU {name!r}: MFU not computed (its peaks are not in effkit's table)"
    if precision not in peaks:
        return None, f"{name} has no {precision} tensor cores: MFU not computed"
    label = {"bf16": "bf16/fp16 tensor-core", "tf32": "TF32 tensor-core", "fp32": "fp32 (no tensor cores)"}[precision]
    return peaks[precision], f"NVIDIA data sheet, {name}, dense {label} peak"


def tf32_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def set_tf32(device: torch.device, enabled: bool) -> bool:
    """Let fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer) or not; returns whether TF32 is
    in use. No-op on CPUs and older GPUs."""
    on = bool(enabled and tf32_supported(device))
    if device.type == "cuda":
        mode = "tf32" if on else "ieee"
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            torch.backends.cuda.matmul.fp32_precision = mode
            torch.backends.cudnn.conv.fp32_precision = mode
        else:  # older PyTorch
            torch.backends.cuda.matmul.allow_tf32 = on
            torch.backends.cudnn.allow_tf32 = on
    return on


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({torch.get_num_threads()} threads)"


CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx512f", "avx2")


def cpu_flags() -> list[str]:
    """The CPU features that decide bf16 and int8 speed, read from /proc/cpuinfo."""
    try:
        line = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split())
    return [f for f in CPU_FLAGS if f in have]


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def no_native_bf16(device: torch.device | None = None) -> str | None:
    """Why bf16 is not worth running on `device` (default: this CPU), read from the CPU's flags alone (nothing
    timed): "this CPU has no native bf16 (flags: avx2 ...)"; None on a GPU or a CPU with AVX512-BF16 / AMX. Reports
    write it as "bf16 not run: <this>": PyTorch emulates bf16 there, many times slower than fp32."""
    if device is not None and device.type != "cpu":
        return None
    if cpu_has_native_bf16():
        return None
    return (f"this CPU has no native bf16 (flags: {' '.join(cpu_flags()) or 'none of ' + ' '.join(CPU_FLAGS)}; "
            "bf16 needs avx512_bf16 or amx_bf16)")


MAX_AGE_DAYS = 30  # a cached measurement older than this is measured again (machines and their loads change)
REMEASURE_ENV = "EFFKIT_REMEASURE"  # set (`effkit --remeasure ...`): every cached measurement is taken again


def machine_id() -> str:
    """This machine, as the caches key it: its systemd machine id (or host name) and the CPU's flags, hashed, so
    that a cache shared between hosts (a common $EFFKIT_CACHE) never hands one host's figure to another, nor to
    the same host after its CPU changed."""
    import hashlib
    import socket

    ident = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            ident = Path(path).read_text().strip()
            break
        except OSError:
            continue
    ident = ident or socket.gethostname()
    flags = " ".join(sorted(cpu_flags()))
    return hashlib.sha256(f"{ident}|{flags}".encode()).hexdigest()[:12]


def _cache_key(key: str) -> str:
    return f"machine {machine_id()}|{key}"


def machine_cached(name: str, key: str, measure: Callable[[], Any] | None) -> tuple[Any, bool]:
    """`measure()`'s result, measured once per machine (`machine_id`: host and CPU flags) and `key` (versions,
    shape) and kept in `<cache>/<name>.json` with the time it was measured (written atomically; a corrupt file is
    measured again); (result, whether it came from the cache). An entry older than MAX_AGE_DAYS, or any entry
    while $EFFKIT_REMEASURE is set (`effkit --remeasure`), is measured again. With no `measure`, only a look-up:
    (None, False) when the key is not there. `cache_note` says where and when a cached value was measured."""
    path = cache_dir() / f"{name}.json"
    full = _cache_key(key)

    def read() -> dict[str, Any]:
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            return {}

    entry = read().get(full)
    if isinstance(entry, dict) and "value" in entry and not _stale(entry, (name, full)):
        return entry["value"], True
    if measure is None:
        return None, False
    value = measure()
    stamp = {"value": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_id(),
             "host": platform.node()}
    cache = {**read(), full: stamp}  # what others measured meanwhile stays
    path.parent.mkdir(parents=True, exist_ok=True)
    # two processes (or threads) measuring at once never share a temporary
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(path)
    _REMEASURED.add((name, full))
    return value, False


_REMEASURED: set[tuple[str, str]] = set()  # what this process measured again under $EFFKIT_REMEASURE


def _stale(entry: dict[str, Any], which: tuple[str, str]) -> bool:
    if os.environ.get(REMEASURE_ENV) and which not in _REMEASURED:  # once per process, then the new value
        return True
    try:
        measured = time.mktime(time.strptime(entry["measured_at"][:19], "%Y-%m-%dT%H:%M:%S"))
    except (KeyError, ValueError, TypeError):
        return True
    return time.time() - measured > MAX_AGE_DAYS * 86400


def cache_note(name: str, key: str) -> str:
    """`measured 2026-11-25T13:40:02+0000 on host h (machine 3f2a...; cached, kept 30 days)`: where and when the
    cached value of `key` was measured, for the report beside it."""
    path = cache_dir() / f"{name}.json"
    try:
        entry = json.loads(path.read_text()).get(_cache_key(key), {})
    except (json.JSONDecodeError, OSError, UnicodeDecodeError, AttributeError):
        entry = {}
    if not isinstance(entry, dict) or "measured_at" not in entry:
        return "not cached"
    return (f"measured {entry['measured_at']} on host {entry.get('host', '?')} (machine {entry.get('machine', '?')}; "
            f"cached, kept {MAX_AGE_DAYS} days; `effkit --remeasure` measures again)")


def cpu_peak_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> tuple[float, str]:
    """Measured square-GEMM FLOP/s on this CPU with the current thread count, cached per machine."""

    def measure() -> float:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best

    key = f"{describe_device(torch.device('cpu'))}|{dtype}|{n}|torch {torch.__version__}"
    peak, _ = machine_cached("cpu_peak", key, measure)
    return peak, (f"measured {n}x{n} {str(dtype).removeprefix('torch.')} GEMM peak on this CPU "
                  f"({cache_note('cpu_peak', key)})")


def peak_flops(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU. CUDA: the data-sheet peak in the precision the matmuls actually run in (`dtype`; fp32
    with `tf32` on counts TF32's tensor-core peak). CPU: the best measured GEMM peak over the dtypes this CPU runs
    natively (fp32 always, bf16 only with AVX512-BF16 / AMX), whatever `dtype` the run used: an emulated bf16 GEMM
    is far below what the machine can do, and an MFU over it can pass 100%."""
    if device.type == "cuda":
        amp = None if dtype == torch.float32 else dtype
        return gpu_peak_flops(torch.cuda.get_device_name(device), matmul_precision(amp, tf32))
    skipped = no_native_bf16()
    native = {"fp32": torch.float32, **({} if skipped else {"bf16": torch.bfloat16})}
    peak, how = max((cpu_peak_flops(d) for d in native.values()), key=lambda p: p[0])
    return peak, (f"the best GEMM peak over the dtypes this CPU runs natively ({' and '.join(native)}): {how}"
                  + (f"; bf16 not counted: {skipped}" if skipped else ""))


class PeakMemory:
    """Peak memory over a stage, measured alike on both devices: the high-water mark minus the value at the start
    of the stage (`peak_bytes`), with the absolute high-water mark beside it (`absolute_bytes`). CUDA:
    torch.cuda.max_memory_allocated. CPU: the process' resident set sampled every 5 ms by a thread (psutil)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ("cuda max_memory_allocated over the stage minus memory allocated at its start"
                       if device.type == "cuda"
                       else "cpu RSS high-water mark over the stage minus RSS at its start (sampled every 5 ms)")
        self.peak_bytes = 0
        self.absolute_bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            import psutil

            self._proc = psutil.Process()
            self._base = self._peak = self._proc.memory_info().rss
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def read(self) -> int:
        """The increase over the stage so far (and `absolute_bytes`: the high-water mark itself)."""
        if self.device.type == "cuda":
            self.absolute_bytes = torch.cuda.max_memory_allocated(self.device)
            return self.absolute_bytes - self._base
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.absolute_bytes = self._peak
        return self._peak - self._base

    def __exit__(self, *exc):
        if self.device.type != "cuda":
            self._stop.set()
            self._thread.join()
        self.peak_bytes = self.read()
        return False


def model_device(model) -> torch.device:
    """The device a model's weights live on: measurement code takes its device from the model, never names one."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


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


def autocast_ctx(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def lm_loss(logits: torch.Tensor, blocks: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a batch of blocks (each block predicts its own tokens 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), blocks[:, 1:].reshape(-1),
                           reduction=reduction)


def eval_batches(model, blocks: torch.Tensor, batch_size: int):
    """The held-out blocks in batches, on the model's device."""
    device = model_device(model)
    for start in range(0, len(blocks), batch_size):
        yield blocks[start:start + batch_size].to(device)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int, amp_dtype: torch.dtype | None = None,
             block_losses: Callable[[torch.Tensor], torch.Tensor] | None = None,
             eval_bytes: int = 0, docs: Sequence[int] | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy over the held-out blocks, its 95% interval (by document with `docs`, each
    block's held-out document; see `stats.mean_ci`), and the per-block losses and documents (`block_losses`,
    `block_docs`: for paired comparisons between models on the same blocks; `eval_summary` drops them). With
    `eval_bytes` (the UTF-8 bytes of the predicted text), also bits per byte: the figure that compares across
    tokenizers. `block_losses(batch)` replaces the model's own forward where it cannot give logits alone (a
    pipeline stage)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    per_block: list[float] = []
    for batch in eval_batches(model, blocks, batch_size):
        if block_losses is not None:
            per_block += block_losses(batch).tolist()
            continue
        with autocast_ctx(device, amp_dtype):
            logits = model(batch).logits
        losses = lm_loss(logits, batch, reduction="none").view(batch.shape[0], -1).mean(1)
        per_block += losses.tolist()
    model.train(was_training)
    docs = list(docs) if docs else None
    loss, lo, hi = stats.mean_ci(per_block, docs)  # every block predicts the same number of tokens
    out = {"eval_loss": loss, "perplexity": math.exp(min(loss, 50)), "eval_tokens": blocks[:, 1:].numel(),
           "eval_loss_ci95": [lo, hi], "eval_interval": stats.interval_by(docs, len(per_block)),
           "block_losses": per_block, "block_docs": docs}
    if eval_bytes:
        out.update(bits_per_byte=bits_per_byte(loss, out["eval_tokens"], eval_bytes), eval_bytes=eval_bytes)
    return out


def bits_per_byte(loss_nats_per_token: float, tokens: int, n_bytes: int) -> float:
    """Held-out loss in bits per UTF-8 byte of the predicted text: nats/token x tokens / ln 2 / bytes."""
    return loss_nats_per_token * tokens / math.log(2) / n_bytes


def eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    """An `evaluate` result without its per-block losses and documents (what reports keep)."""
    return {k: v for k, v in result.items() if k not in ("block_losses", "block_docs")}


# seconds of idle machine after timing a contender whose runtime keeps spin-waiting threads after a call (ONNX
# Runtime's sessions; CTranslate2 with more than one thread): measured, 50 ms lets them nearly all sleep, 200 ms all
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
    if not getattr(model, "compilable", True):
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
    """Seconds to leave the machine idle after timing `model`, before the next contender: engines whose idle
    threads spin-wait after a run (ONNX Runtime's default, which effkit keeps: without it ONNX Runtime decodes
    1.75x slower) would otherwise take the cores from whatever is timed next."""
    return float(getattr(model, "settle_s", 0.0))


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
        if (pause := getattr(contenders[name], "settle_s", 0.0)) > 0:
            time.sleep(pause)

    for name in names:
        for _ in range(warmup):
            contenders[name]()
        settle(name)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r + offset, seed):
            samples[name].append([contenders[name]() for _ in range(calls[name])])
            settle(name)
    return samples


def latency_stats(rounds: list[list[float]]) -> dict[str, float]:
    """p50/p90/p99, min/max and the relative spread (max - min) / p50 of every timing of every round."""
    times = [t for rnd in rounds for t in rnd]
    ts = torch.tensor(times, dtype=torch.float64)
    p50 = float(ts.quantile(0.5))
    return {"p50_s": p50, "p90_s": float(ts.quantile(0.9)), "p99_s": float(ts.quantile(0.99)),
            "min_s": float(ts.min()), "max_s": float(ts.max()), "spread": float((ts.max() - ts.min()) / p50),
            "samples": len(times)}


def memory_bandwidth(mbytes: int = 128, repeats: int = 7) -> tuple[float, str]:
    """Bytes per second this machine streams through a fp32 matrix-vector product whose matrix (`mbytes` MB) is far
    larger than the caches: the ceiling of batch-1 decoding, which reads every weight once per token. The median of
    `repeats` timed products after one warm-up; (bytes/s, how)."""
    cols = 4096
    w = torch.randn(mbytes * 2**20 // (4 * cols), cols)
    x = torch.randn(cols)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t)
    seconds = sorted(times[1:])[repeats // 2]
    return w.numel() * 4 / seconds, (f"median of {repeats} fp32 matrix-vector products over a {mbytes} MB matrix "
                                     f"(torch.mv, {torch.get_num_threads()} threads), after a warm-up")


GENERATION_PROMPT = "The state of the Union"


def generation_budget(model, tokenizer, wanted: int, prompt: str = GENERATION_PROMPT) -> tuple[int, str | None]:
    """New tokens that fit in the model's context after the prompt, and a note when `wanted` was capped."""
    room = model.config.n_positions - len(tokenizer(prompt).input_ids)
    if room < 1:
        raise EffkitError(f"the prompt {prompt!r} fills the model's context ({model.config.n_positions} tokens)")
    if wanted <= room:
        return wanted, None
    return room, f"generation capped at {room} new tokens (asked {wanted}): the model's context is " \
                 f"{model.config.n_positions} tokens"


def compiled_generation(model) -> tuple[dict[str, Any] | None, str]:
    """`generate` keyword arguments that decode with a static KV cache and a `torch.compile`d forward (Inductor,
    static shapes: the cache no longer grows, so one graph serves every step; transformers compiles it on the
    first call, on any device), or (None, "not run: <reason>")."""
    if not getattr(model, "compilable", True):
        return None, "not run: an ONNX Runtime artifact (its graph is already optimized by ONNX Runtime)"
    if getattr(model, "hf_quantizer", None) is not None and not model.hf_quantizer.is_compileable:
        return None, "not run: transformers does not compile this quantization method"
    from transformers import CompileConfig

    config = CompileConfig(mode="default", dynamic=False, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles automatically on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}, \
        "torch.compile of the decoding step (Inductor, static KV cache, fullgraph), compiled on the first call"


@torch.inference_mode()
def greedy_generate(model, tokenizer, new_tokens: int, prompt: str = GENERATION_PROMPT,
                    generate_kwargs: dict[str, Any] | None = None, batch: int = 1) -> tuple[torch.Tensor, float]:
    """Greedy decoding of exactly `new_tokens` with the KV cache, from `batch` copies of the prompt: (the first
    row's new token ids, seconds). `generate_kwargs`: e.g. `compiled_generation`'s."""
    device = model_device(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device).expand(batch, -1).contiguous()
    kwargs = generate_kwargs or {}
    synchronize(device)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                         pad_token_id=tokenizer.eos_token_id, **kwargs)
    synchronize(device)
    return out[0, ids.shape[1]:], time.perf_counter() - t


SAMPLING = {"top_k": 40, "temperature": 0.8, "seed": 0}


def sampled_generate(model, tokenizer, new_tokens: int, prompt: str = GENERATION_PROMPT,
                     top_k: int = SAMPLING["top_k"], temperature: float = SAMPLING["temperature"],
                     seed: int = SAMPLING["seed"]) -> torch.Tensor:
    """Seeded top-k / temperature sampling of exactly `new_tokens` (the global RNG is left as it was)."""
    device = model_device(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True,
                             top_k=top_k, temperature=temperature, use_cache=True,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:]


def repeated_fraction(ids: list[int], n: int = 8) -> float:
    """The fraction of n-token windows that already occurred earlier in `ids` (greedy decoding loops: high)."""
    windows = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(windows)) / len(windows) if windows else 0.0


def generation_timer(model, tokenizer, new_tokens: int, generate_kwargs: dict[str, Any] | None = None,
                     batch: int = 1) -> Callable[[], float]:
    """A function returning the new tokens per second (all rows) of one greedy decoding of `new_tokens` from a
    batch of `batch` prompts (the caller caps `new_tokens` with `generation_budget`)."""

    def once() -> float:
        new, seconds = greedy_generate(model, tokenizer, new_tokens, generate_kwargs=generate_kwargs, batch=batch)
        return batch * len(new) / seconds

    once.settle_s = settle_time(model)
    return once


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
