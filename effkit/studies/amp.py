"""`effkit study amp`: fp32 against bf16 autocast, one run each: final held-out loss, total time, training
tokens/s, peak memory and the loss curves; says whether this device runs bf16 natively."""

from __future__ import annotations

import time
from typing import Any

import torch

from effkit.measure import hardware
from effkit.studies.common import Study, StudyConfig, _mib, _train, _train_cfg


def run(s: StudyConfig) -> dict[str, Any]:
    rows, losses = [], {}
    for name, amp in (("fp32", False), ("bf16", True)):
        t = time.perf_counter()
        r = _train(_train_cfg(s, f"amp-{name}", amp=amp))
        losses[name] = r["losses"]
        rows.append({"precision": name, "final_eval_loss": r["metrics"]["eval_loss"],
                     "total_time_s": time.perf_counter() - t, "train_tokens_per_s": r["metrics"]["train_tokens_per_s"],
                     "peak_memory_mib": _mib(r["metrics"]["peak_memory_bytes_per_rank"][0])})
    native = hardware.cpu_has_native_bf16() or torch.cuda.is_available()
    return {"rows": rows, "losses": losses,
            "notes": [f"native bf16 on this device: {native}" + ("" if native else
                      " (bf16 is emulated on this CPU, expect it to be slower than fp32)")]}


def draw(ax, result: dict[str, Any]) -> None:
    for prec, losses in result["losses"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=prec)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend()


STUDY = Study("amp", "fp32 against bf16 autocast: loss, time, tokens/s and peak memory", run, draw)
