"""What the machine is and where a model runs: the device's name (`describe_device`), the CPU's flags and whether
they include native bf16 (`cpu_flags`, `cpu_has_native_bf16`, `no_native_bf16`), TF32 on CUDA (`tf32_supported`,
`set_tf32`), the device a model's weights live on (`model_device`) and autocast there (`autocast_ctx`). Nothing
here is timed: the measured ceilings are in `roofline`, the per-machine cache in `machine_cache`."""

from __future__ import annotations

import platform
from contextlib import nullcontext

import torch


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


def cpu_identity() -> str:
    """The CPU's model name, family and model numbers and `cpu_flags`: one string that tells apart CPUs a virtual
    machine names alike ("AMD EPYC" for a Zen 3 and a Zen 4)."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip():
                break
    except OSError:
        pass
    name = fields.get("model name", platform.processor() or platform.machine())
    return f"{name}|family {fields.get('cpu family', '?')} model {fields.get('model', '?')}|{','.join(cpu_flags())}"


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


def model_device(model) -> torch.device:
    """The device a model's weights live on: measurement code takes its device from the model, never names one."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def autocast_ctx(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
