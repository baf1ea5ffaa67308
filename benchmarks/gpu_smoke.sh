#!/usr/bin/env bash
# Every stage of effkit on CUDA, for users with one or more GPUs. Stops at the first failure (non-zero exit).
#   bash benchmarks/gpu_smoke.sh [OUT]          (default OUT: reports/benchmarks/gpu-smoke)
# Tiny model and few steps: a check that each path runs on the GPU, not a benchmark. About 5 minutes on one GPU.
#
# What it runs:
#   train: the memory plan (--plan --fit); single process in fp32 with TF32 on and off (the report says which
#          ran, MFU against that precision's peak), bf16 with activation checkpointing, fp16 (GradScaler) and
#          its resume (the scaler's scale is checkpointed), 8-bit AdamW (bitsandbytes) and its resume;
#          with 2+ GPUs also ddp, fsdp (bf16), tp and fsdp+tp (2-D mesh needs 4 GPUs; 2 GPUs give a (1, 2) mesh),
#          fp16 with fsdp and with tp including a resume (the overflow decision all-reduced), fsdp with
#          --cpu-offload (gradient clipping over offloaded shards), fsdp and tp with 8-bit AdamW (torchao) and
#          their resumes
#   prune: row, width (taylor), depth with distillation, and weight (wanda), on the GPU
#   quantize: bnb and torchao on the GPU; dynamic on the CPU (PyTorch's dynamic int8 is CPU-only)
#   export: ONNX int8 on the CPU (ONNX Runtime's CPU provider)
#   bench, generate (GPU), report
# Each step's stage report says which device ran it (what_ran.device); the last check reads them back.
set -euo pipefail
OUT=${1:-reports/benchmarks/gpu-smoke}
RUN=gpu-smoke
DIRS=(--runs-dir "$OUT/runs" --reports-dir "$OUT/reports")
TINY=(--model gpt2-nano --vocab-size 2048 --block-size 64 --batch-size 8 --max-steps 20 --warmup-steps 2
      --eval-interval 10 --checkpoint-interval 10 --eval-blocks 16)
step() { printf '\n=== %s\n' "$*"; }
interrupted() {  # NAME FLAGS...: train until the first checkpoint is written, then Ctrl-C (exit 130), as a user would
  local name=$1 pid; shift
  set -m  # job control: a background job keeps SIGINT's default, which Python turns into KeyboardInterrupt
  effkit train "${TINY[@]}" --max-steps 2000 --run-name "$name" "$@" "${DIRS[@]}" & pid=$!
  until [ -f "$OUT/runs/$name/checkpoints/last/state.json" ] || ! kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  kill -INT "$pid" 2>/dev/null || true
  local rc=0; wait "$pid" || rc=$?
  set +m
  [ "$rc" -eq 130 ] || { echo "expected the interrupted run $name to exit 130, got $rc"; return 1; }
}

python - <<'EOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_smoke.sh needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU run the test suite")
print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
EOF
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")

step "memory plan: predicted per-rank peak, and the cheapest tricks that fit"
effkit train "${TINY[@]}" --plan --fit
step "train fp32 (TF32 matmuls, the default on Ampere and newer)"
effkit train "${TINY[@]}" --run-name "$RUN" --no-amp "${DIRS[@]}"
step "train fp32 with --no-tf32"
effkit train "${TINY[@]}" --run-name "$RUN-notf32" --no-amp --no-tf32 "${DIRS[@]}"
step "train with 8-bit AdamW (bitsandbytes), then resume it"
interrupted "$RUN-8bit" --optim adamw8bit --amp
effkit train "${TINY[@]}" --run-name "$RUN-8bit" --resume "${DIRS[@]}"
step "train bf16 with activation checkpointing"
effkit train "${TINY[@]}" --run-name "$RUN-bf16" --amp --amp-dtype bf16 --activation-checkpointing "${DIRS[@]}"
step "train fp16 with GradScaler, interrupted"
interrupted "$RUN-fp16" --amp --amp-dtype fp16
step "resume from the last checkpoint"
effkit train "${TINY[@]}" --run-name "$RUN-fp16" --resume "${DIRS[@]}"

if [ "$NGPU" -ge 2 ]; then
  for mode in ddp fsdp tp fsdp+tp pp; do
    step "train --parallel $mode on 2 GPUs (bf16)"
    effkit train "${TINY[@]}" --run-name "$RUN-$mode" --parallel "$mode" --nproc 2 --amp "${DIRS[@]}"
  done
  for mode in fsdp tp; do
    step "train --parallel $mode on 2 GPUs in fp16 (ShardedGradScaler), then resume it"
    interrupted "$RUN-$mode-fp16" --parallel "$mode" --nproc 2 --amp --amp-dtype fp16
    effkit train "${TINY[@]}" --run-name "$RUN-$mode-fp16" --resume "${DIRS[@]}"
  done
  step "train --parallel fsdp --cpu-offload on 2 GPUs (clipping over CPU-resident gradient shards)"
  effkit train "${TINY[@]}" --run-name "$RUN-offload" --parallel fsdp --nproc 2 --cpu-offload --amp "${DIRS[@]}"
  for mode in fsdp tp; do
    step "train --parallel $mode with 8-bit AdamW (torchao, on the shards) on 2 GPUs, then resume it"
    interrupted "$RUN-$mode-8bit" --parallel "$mode" --nproc 2 --optim adamw8bit --amp
    effkit train "${TINY[@]}" --run-name "$RUN-$mode-8bit" --resume "${DIRS[@]}"
  done
  step "train --parallel pp with GPipe and --amp auto on 2 GPUs"
  effkit train "${TINY[@]}" --run-name "$RUN-gpipe" --parallel pp --pp-schedule gpipe --nproc 2 "${DIRS[@]}"
  if [ "$NGPU" -ge 4 ]; then
    step "train --parallel pp+fsdp on 4 GPUs (pp=2 x dp=2)"
    effkit train "${TINY[@]}" --run-name "$RUN-ppfsdp" --parallel pp+fsdp --pp-size 2 --nproc 4 --amp "${DIRS[@]}"
  fi
else
  step "one GPU: ddp, fsdp, tp, fsdp+tp and pp skipped (they need 2 or more)"
fi

DENSE="$OUT/runs/$RUN/train"
step "prune row (GPU)"
effkit prune --from "$DENSE" --mode row --target 0.5 --rounds 2 --finetune-steps 5 --device cuda "${DIRS[@]}"
step "prune width, taylor importance (GPU)"
effkit prune --from "$DENSE" --mode width --importance taylor --target 0.25 --width-multiple 16 --rounds 1 \
  --finetune-steps 5 --device cuda "${DIRS[@]}"
step "prune depth with distillation (GPU)"
effkit prune --from "$DENSE" --mode depth --target 0.5 --rounds 1 --finetune-steps 5 --distill --device cuda \
  "${DIRS[@]}"
step "prune weight, wanda (GPU)"
effkit prune --from "$DENSE" --mode weight --importance wanda --target 0.5 --rounds 1 --finetune-steps 5 \
  --device cuda "${DIRS[@]}"
for backend in bnb torchao; do
  step "quantize $backend (GPU)"
  effkit quantize --from "$DENSE" --backend "$backend" --device cuda --latency-repeats 5 --gen-tokens 16 "${DIRS[@]}"
done
step "quantize dynamic (CPU: PyTorch's dynamic int8 has no CUDA kernels)"
effkit quantize --from "$DENSE" --backend dynamic --device cpu --latency-repeats 5 --gen-tokens 16 "${DIRS[@]}"
step "quantize ctranslate2 (GPU: CTranslate2's PyPI wheel has CUDA kernels; int8_float16 on the GPU)"
effkit quantize --from "$DENSE" --backend ctranslate2 --compute-type int8_float16 --device cuda --latency-repeats 5 \
  --gen-tokens 16 "${DIRS[@]}"
step "export onnx int8 with past key/values (CPU: effkit runs ONNX Runtime's CPU provider; bench on the GPU leaves it out, saying why)"
effkit export --from "$DENSE" --int8 --latency-repeats 2 --gen-tokens 16 "${DIRS[@]}"
step "bench every artifact of the run with the peer engines (GPU): prefill and decode at batch 1 and 12"
effkit bench --run "$RUN" --quick --peers --device cuda "${DIRS[@]}"
step "generate (GPU)"
effkit generate --from "$DENSE" --max-new-tokens 16 --device cuda
step "report"
effkit report "$RUN" "${DIRS[@]}"

step "check: every stage report names the GPU it ran on"
python - "$OUT/reports" <<'EOF'
import json, sys
from pathlib import Path
bad = []
for p in sorted(Path(sys.argv[1]).glob("gpu-smoke*/*.json")):
    report = json.loads(p.read_text())
    device = report.get("what_ran", {}).get("device") or report.get("device")
    if device is None or "quantize-dynamic" in p.name or "onnx" in p.name:
        continue
    print(f"{p.parent.name}/{p.name}: {device}")
    if device.startswith("CPU"):
        bad.append(p.name)
if bad:
    sys.exit(f"these stages ran on the CPU: {', '.join(bad)}")
tf32 = {p.parent.name: json.loads(p.read_text())["what_ran"].get("fp32_matmuls")
        for p in Path(sys.argv[1]).glob("gpu-smoke*/train.json") if p.parent.name in ("gpu-smoke", "gpu-smoke-notf32")}
print(f"fp32 matmuls: {tf32}")
if tf32.get("gpu-smoke-notf32") != "fp32":
    sys.exit("--no-tf32 did not turn TF32 off")
print("gpu smoke: every stage ran on CUDA")
EOF
