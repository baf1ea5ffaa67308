"""Peak memory over a stage (`PeakMemory`), measured alike on CUDA (the allocator's high-water mark) and on a CPU
(the process' resident set, sampled by a thread)."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch


class PeakMemory:
    """Peak memory over a stage, measured alike on both devices: the high-water mark minus the value at the start
    of the stage (`peak_bytes`), with the absolute high-water mark beside it (`absolute_bytes`). CUDA:
    torch.cuda.max_memory_allocated. CPU: the process' resident set sampled every 5 ms by a thread (psutil), and
    beside it the high-water mark of its anonymous part (`anonymous_bytes`: the resident set less its file-backed
    pages, which the kernel drops when memory runs short; what a memory plan's "must fit" predicts)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ("cuda max_memory_allocated over the stage minus memory allocated at its start"
                       if device.type == "cuda"
                       else "cpu RSS high-water mark over the stage minus RSS at its start (sampled every 5 ms)")
        self.peak_bytes = 0
        self.absolute_bytes = 0
        self.anonymous_bytes: int | None = None  # CPU only

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            import psutil

            self._proc = psutil.Process()
            info = self._proc.memory_info()
            self._base = self._peak = info.rss
            self._anon = info.rss - getattr(info, "shared", 0)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._take()

    def _take(self) -> None:
        info = self._proc.memory_info()
        self._peak = max(self._peak, info.rss)
        self._anon = max(self._anon, info.rss - getattr(info, "shared", 0))  # Linux: shared = file-backed pages

    def read(self) -> int:
        """The increase over the stage so far (and `absolute_bytes`: the high-water mark itself)."""
        if self.device.type == "cuda":
            self.absolute_bytes = torch.cuda.max_memory_allocated(self.device)
            return self.absolute_bytes - self._base
        self._take()
        self.absolute_bytes, self.anonymous_bytes = self._peak, self._anon
        return self._peak - self._base

    def record(self) -> dict:
        """What a stage's report keeps of it (`memory`, beside the plan): the increase, the high-water mark and its
        anonymous part (CPU), and how they were measured."""
        increase = self.read()
        return {"measured_peak_bytes": increase, "measured_absolute_bytes": self.absolute_bytes,
                **({"measured_anonymous_bytes": self.anonymous_bytes} if self.anonymous_bytes is not None else {}),
                "measured_how": self.method + ("; measured_anonymous_bytes: the high-water mark of the resident set "
                                               "less its file-backed pages" if self.anonymous_bytes is not None
                                               else "")}

    def __exit__(self, *exc):
        if self.device.type != "cuda":
            self._stop.set()
            self._thread.join()
        self.peak_bytes = self.read()
        return False


def give_back_freed() -> bool:
    """Hand the heap pages freed so far back to the operating system (glibc's `malloc_trim(0)`); False where the C
    library has no such call. glibc keeps freed blocks below its mmap threshold in its arenas, and the threshold grows
    to 32 MiB as large blocks are freed: after the ONNX Runtime session that checks a gpt2-large export (2.7 GiB of
    fp32 weights) was closed, the resident set stayed 2.7 GiB higher until trimmed, and the quantizer's copies came on
    top of it (docs/benchmarks.md, session 22). Called where a stage has just dropped a copy of the weights."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no C library found, or one without malloc_trim (musl, macOS)
        return False
    return True
