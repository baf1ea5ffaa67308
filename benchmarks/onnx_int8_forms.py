"""effkit's ONNX Runtime int8 against ONNX Runtime's own `quantize_dynamic`, alone: do the tied int8 embedding and
the quantized lookup cost decoding speed?

    python benchmarks/onnx_int8_forms.py [--from runs/quickstart/train] [--rounds 6] [--tokens 128]

The dense artifact is exported once (the with-past graph); three int8 forms are written from it: effkit's
(`quantize_int8`: MatMul, Gemm and Gather in int8, the embedding read from the int8 LM head), the same without the
tie, and ONNX Runtime's defaults as a user runs them (`quantize_standard`: MatMul and Gemm only, the bench's peer).
Greedy decoding of `--tokens` tokens at batch 1 and 12, the three interleaved in each of `--rounds` rounds (0.2 s
idle before each, for ONNX Runtime's spinning threads); prints the medians. A quick look, not effkit's protocol:
`effkit bench` gives the paired intervals.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import onnxruntime.quantization as q
from transformers import AutoTokenizer

from effkit.engines.onnxruntime import export, int8, runtime
from effkit.measure import generation
from effkit.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", default="runs/quickstart/train")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load_model(args.source).eval(), AutoTokenizer.from_pretrained(args.source)
    base = Path(tempfile.mkdtemp(prefix="effkit-int8-forms-"))
    fp32 = base / "fp32.onnx"
    export.export_fp32(copy.deepcopy(model), fp32)
    writers = {"effkit (tied)": lambda dst: int8.quantize_int8(fp32, dst),
               "effkit untied": lambda dst: q.quantize_dynamic(str(fp32), str(dst), weight_type=q.QuantType.QInt8,
                                                               op_types_to_quantize=["MatMul", "Gemm", "Gather"]),
               "quantize_dynamic (peer)": lambda dst: int8.quantize_standard(fp32, dst)}
    models = {}
    for i, (name, write) in enumerate(writers.items()):
        folder = base / str(i)
        folder.mkdir()
        model.config.save_pretrained(folder)
        tok.save_pretrained(folder)
        write(folder / "model.onnx")
        (folder / "onnx.json").write_text(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
        models[name] = runtime.OnnxCausalLM(folder)
    for batch in (1, 12):
        timers = {n: generation.generation_timer(m, tok, args.tokens, batch=batch) for n, m in models.items()}
        rates: dict[str, list[float]] = {n: [] for n in timers}
        for _ in range(args.rounds):
            for n, fn in timers.items():
                time.sleep(0.2)
                rates[n].append(fn())
        print(f"decode b{batch}, median tokens/s over {args.rounds} rounds: " +
              ", ".join(f"{n} {statistics.median(v):,.0f}" for n, v in rates.items()))


if __name__ == "__main__":
    main()
