"""The machine's ceilings: peak FLOP/s for MFU (NVIDIA's data-sheet figures per GPU and precision, `GPU_PEAKS`,
`gpu_peak_flops`, in the precision the matmuls run in, `matmul_precision`; on a CPU the best measured GEMM peak over
the dtypes it runs natively, `cpu_peak_flops`, cached per machine; `peak_flops` picks) and the memory bandwidth a
matrix-vector product streams at (`memory_bandwidth`: the bound of batch-1 decoding)."""

from __future__ import annotations

import math
import time

import torch

from effkit.measure.hardware import describe_device, no_native_bf16
from effkit.measure.machine_cache import cache_note, machine_cached

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


GEMM_BUDGET_S = 2.0  # seconds after which the peak's warm-ups and repeats stop (at least one GEMM is timed)


def cpu_peak_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> tuple[float, str]:
    """Measured square-GEMM FLOP/s on this CPU with the current thread count, cached per machine: the fastest of
    `repeats` GEMMs after three warm-ups, or of those that fit in `GEMM_BUDGET_S` (a dtype this CPU emulates, whose
    every GEMM takes seconds: its peak is only shown, never an MFU's denominator, and more of the same slow calls
    would not move its best)."""

    def measure() -> float:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        start = time.perf_counter()
        for _ in range(3):
            a @ b
            if time.perf_counter() - start > GEMM_BUDGET_S:
                break
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
            if t - start > GEMM_BUDGET_S:
                break
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
