"""llama.cpp's own Q6_K quantizer, for the tied embedding / LM head of a Q4_0 file (and an untied `output.weight`),
stored as llama-quantize stores it: 6-bit values in super-blocks of 256 (`QK_K`), quantized by `ggml_quantize_chunk`
in the ggml that xllamacpp's library carries, called through ctypes (gguf-py only dequantizes K-quants). Where n_embd
is not a multiple of 256, or that quantizer cannot be reached, the tensor is stored Q8_0 instead (llama-quantize's own
fallback for Q6_K), the reason said on stderr in one line and recorded in `gguf.json` (`head`, `quantizer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from effkit.errors import EffkitError

QK_K = 256  # values per Q6_K super-block (ggml's QK_K): a Q6_K row is a multiple of it
Q6_K_BYTES = 210  # bytes per Q6_K super-block: 128 low 4-bit halves, 64 high 2-bit pairs, 16 int8 scales, f16 scale


_GGML: dict[str, Any] = {}  # llama.cpp's quantizer, once found: {"lib": the CDLL} or {"why": why not}


def ggml_quantizer() -> tuple[Any, str | None]:
    """llama.cpp's own quantizer: the ggml inside xllamacpp's library (`xllamacpp.abi3.so`), its
    `ggml_quantize_chunk` and type-size functions given their C signatures through ctypes, and checked to describe
    Q6_K as gguf-py does (enum value 14, 256 values in 210 bytes per block) before anything is quantized (a wrong
    call aborts in ggml's asserts). (library, None), or (None, the reason in one line)."""
    if not _GGML:
        import ctypes

        try:
            import gguf
            import xllamacpp

            where = Path(xllamacpp.__file__).parent / "xllamacpp.abi3.so"
            lib = ctypes.CDLL(str(where))
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_blck_size.argtypes = lib.ggml_type_size.argtypes = [ctypes.c_int]
            lib.ggml_blck_size.restype = ctypes.c_int64
            lib.ggml_type_size.restype = ctypes.c_size_t
            q6_k = int(gguf.GGMLQuantizationType.Q6_K)
            theirs = (int(lib.ggml_blck_size(q6_k)), int(lib.ggml_type_size(q6_k)))
            if theirs != (QK_K, Q6_K_BYTES) or tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K]) != theirs:
                _GGML["why"] = (f"llama.cpp's ggml type {q6_k} holds {theirs[0]} values in {theirs[1]} bytes, not "
                                f"Q6_K's {QK_K} in {Q6_K_BYTES}")
            else:
                _GGML["lib"] = lib
        except Exception as e:  # noqa: BLE001 - a missing wheel, library or symbol: Q8_0 then, said why
            _GGML["why"] = (f"llama.cpp's quantizer (ggml_quantize_chunk in xllamacpp's library) cannot be reached "
                            f"({type(e).__name__}: {str(e)[:100]})")
    return _GGML.get("lib"), _GGML.get("why")


def q6_k_unavailable(width: int) -> str | None:
    """None if rows of `width` values can be stored Q6_K here, else why not in one line."""
    if width % QK_K:
        return f"n_embd {width} is not a multiple of {QK_K} (Q6_K's super-block)"
    return ggml_quantizer()[1]


def quantize_q6_k(array: Any) -> Any:
    """A float32 (rows, width) matrix as Q6_K by llama.cpp's own quantizer (`ggml_quantize_chunk`, no importance
    matrix: what llama-quantize does without one), row blocks on torch's threads (ctypes lets go of the GIL): uint8
    (rows, width / 256 x 210), the bytes GGUF stores, as gguf-py's quantizers return them. EffkitError where
    `q6_k_unavailable` says why."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf

    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim != 2:
        raise EffkitError(f"Q6_K quantizes a matrix; this array has shape {x.shape}")
    rows, width = x.shape
    if reason := q6_k_unavailable(width):
        raise EffkitError(f"cannot store Q6_K: {reason}")
    lib, _ = ggml_quantizer()
    row_bytes = width // QK_K * Q6_K_BYTES
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    q6_k = int(gguf.GGMLQuantizationType.Q6_K)
    step = max(1, -(-rows // max(1, torch.get_num_threads())))

    def chunk(first: int) -> int:  # ggml writes rows [first, first + n) at their own offset in `out`
        n = min(step, rows - first)
        return int(lib.ggml_quantize_chunk(q6_k, x.ctypes.data, out.ctypes.data, first * width, n, width, None))

    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        written = sum(pool.map(chunk, range(0, rows, step)))
    if written != out.nbytes:
        raise EffkitError(f"llama.cpp's Q6_K quantizer wrote {written} bytes for a ({rows}, {width}) matrix, not "
                          f"{out.nbytes}")
    return out


def head_storage(width: int, wtype: str) -> tuple[str | None, str]:
    """How a `wtype` file stores the tied embedding / LM head of a model `width` wide: (the GGUF type name where it
    differs from the other matrices', else None; one line saying how, and why where Q6_K could not be used)."""
    if wtype != "q4_0":
        return None, ""
    if reason := q6_k_unavailable(width):
        return "Q8_0", (f"the tied embedding / LM head in Q8_0, not llama-quantize's Q6_K: {reason} "
                        "(llama-quantize's own fallback)")
    return "Q6_K", ("the tied embedding / LM head in Q6_K (super-blocks of 256) by llama.cpp's own quantizer "
                    "(ggml_quantize_chunk, no importance matrix), as llama-quantize stores it")

