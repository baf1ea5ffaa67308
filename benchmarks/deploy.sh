#!/usr/bin/env bash
# Deployable int8 on the quickstart model (issue: int8 that ships). About 40 minutes on 2 cores.
#   bash benchmarks/deploy.sh [OUT]      (default OUT: reports/benchmarks/deploy)
# Trains the quickstart and prunes half of its MLP width in two rounds (the recipe's prune settings), quantizes
# the dense model with every backend, exports it to ONNX (fp32), lets `--backend auto` choose for the pruned
# model (the composed artifact `effkit run` delivers), then measures every artifact side by side, each PyTorch
# one also under torch.compile: OUT/reports/deploy/bench.md.
set -euo pipefail
OUT=${1:-reports/benchmarks/deploy}
DIRS=(--runs-dir "$OUT/runs" --reports-dir "$OUT/reports")
effkit train --recipe recipes/quickstart.toml --run-name deploy "${DIRS[@]}"
DENSE="$OUT/runs/deploy/train"
effkit prune --recipe recipes/quickstart.toml --from "$DENSE" --mode row "${DIRS[@]}"
for backend in dynamic torchao bnb onnxruntime; do
  effkit quantize --from "$DENSE" --backend "$backend" "${DIRS[@]}"
done
effkit export --from "$DENSE" "${DIRS[@]}"
effkit quantize --from "$OUT/runs/deploy/prune-row-r2" --backend auto "${DIRS[@]}"
effkit bench --run deploy --compile "${DIRS[@]}"
