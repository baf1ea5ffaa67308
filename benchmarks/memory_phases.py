"""Resident memory per phase of three gpt2-mini training steps (batch 4 x 128), with or without activation
checkpointing: where the memory plan's gap with checkpointing lives (issue #26). Samples /proc/self/statm every
0.5 ms, prints the peak increase over the start per phase and, after step 0, how much of the resident set the
optimizer state explains and whether malloc_trim returns anything.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory_phases.py ckpt adamw      (or nockpt; or adamw8bit)
    MKL_DISABLE_FAST_MM=1 MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory_phases.py ckpt adamw

Environment THREADS sets torch's threads (default 2). Linux only (/proc, glibc's malloc_trim).
"""

import ctypes
import gc
import os
import sys
import threading
import time

import torch

from effkit import optim
from effkit.measure.evaluation import lm_loss
from effkit.model.gpt2 import build_model, enable_activation_checkpointing

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def main(checkpointing: bool, optim_name: str) -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    model = build_model("gpt2-mini", 8192)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    opt, how = optim.build_optimizer(model, optim_name, 1e-3, 0.1)
    x = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    phase, phase_peak, running = ["init"], {}, [True]

    def sample() -> None:
        while running[0]:
            r, k = rss(), phase[0]
            phase_peak[k] = max(r, phase_peak.get(k, 0))
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    base = rss()
    for step in range(3):
        phase[0] = f"s{step}-fwd"
        loss = lm_loss(model(x).logits, x)
        phase[0] = f"s{step}-bwd"
        loss.backward()
        phase[0] = f"s{step}-opt"
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase[0] = f"s{step}-end"
        time.sleep(0.01)
        if step == 0:
            state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                        if torch.is_tensor(t))
            before = rss()
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            time.sleep(0.01)
            print(f"after step 0: resident increase {(before - base) / MiB:.1f} MiB, optimizer state "
                  f"{state / MiB:.1f} MiB, after malloc_trim {(rss() - base) / MiB:.1f} MiB")
    running[0] = False
    sampler.join()
    print(f"{'checkpointing' if checkpointing else 'no checkpointing'}, {how}, {torch.get_num_threads()} threads: "
          f"peak increase {(max(phase_peak.values()) - base) / MiB:.1f} MiB over {base / MiB:.1f}")
    print("per phase (MiB over the start): " + ", ".join(f"{k} {(v - base) / MiB:.0f}" for k, v in phase_peak.items()))


if __name__ == "__main__":
    main(sys.argv[1] == "ckpt", sys.argv[2] if len(sys.argv) > 2 else "adamw")
