#!/usr/bin/env bash
# Prune and quantize benchmarks on the quickstart model (issues: prune, quantize). About 30 minutes on 2 cores.
#   bash benchmarks/prune_quantize.sh [OUT]      (default OUT: reports/benchmarks/pipeline)
# Trains the quickstart, prunes it in both modes from 0.1 to 0.9 in steps of 0.1 (30 fine-tuning steps per
# round), and quantizes the dense model with every backend. Every figure lands in OUT/reports/quickstart/.
set -euo pipefail
OUT=${1:-reports/benchmarks/pipeline}
DIRS=(--runs-dir "$OUT/runs" --reports-dir "$OUT/reports")
effkit train --recipe recipes/quickstart.toml --run-name quickstart "${DIRS[@]}"
DENSE="$OUT/runs/quickstart/train"
effkit prune --from "$DENSE" --mode row --target 0.9 --rounds 9 --finetune-steps 30 "${DIRS[@]}"
effkit prune --from "$DENSE" --mode weight --target 0.9 --rounds 9 --finetune-steps 30 "${DIRS[@]}"
for backend in dynamic torchao bnb onnxruntime; do
  effkit quantize --from "$DENSE" --backend "$backend" "${DIRS[@]}"
done
effkit quantize --from "$DENSE" --backend dynamic --include-head "${DIRS[@]}"
