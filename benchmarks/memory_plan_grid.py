"""The memory plan against measurement on the test suite's scale (issue #26): gpt2-nano and gpt2-mini x AdamW and
8-bit AdamW x activation checkpointing off and on, batch 2 x 32 tokens, 3 steps, on the first 24 State of the
Union speeches, each configuration's run and its runtime probe in fresh processes (the suite runs one of these
eight), each with glibc's default allocator (as users run) and with the tuned one (MALLOC_MMAP_THRESHOLD_=131072,
which returns freed tensors to the system). Prints each configuration's predicted and measured peak and the error,
and the accuracy per allocator; about 3 minutes on 2 cores (each probe runs beside its configuration's run).

    python benchmarks/memory_plan_grid.py
"""

import shutil
import tempfile
import time
from pathlib import Path

from effkit.data.corpus import _sotu_dir
from effkit.studies import StudyConfig, run_study


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="effkit-memory-grid-"))
    corpus = work / "corpus"
    corpus.mkdir()
    for f in sorted(_sotu_dir().glob("*.txt"))[:24]:
        shutil.copy(f, corpus / f.name)
    s = StudyConfig(model="gpt2-nano", data=str(corpus), vocab_size=512, block_size=32, batch_size=2, steps=3,
                    nproc=1, out=str(work / "studies"), runs_dir=str(work / "runs"), memory_models=("gpt2-mini",),
                    memory_optims=("adamw", "adamw8bit"), memory_checkpointing=(False, True),
                    memory_default_allocator_all=True)  # every configuration with glibc's default too, as users run
    t = time.perf_counter()
    result = run_study("memory", s)
    rows = result["rows"]
    print(f"{time.perf_counter() - t:.0f} s; reports under {work / 'studies'}")
    for r in rows:
        print(f"{r['model']:10s} {r['optim']:10s} checkpointing {'on ' if r['checkpointing'] else 'off'} "
              f"{r['allocator']:15s}: predicted "
              f"{r['predicted_mib']:7.1f} MiB (runtime {r['runtime_mib']:5.1f}), measured {r['measured_mib']:7.1f}, "
              f"error {r['error_pct']:+5.1f}%")
    for note in result["notes"][:2]:
        print(note)


if __name__ == "__main__":
    main()
