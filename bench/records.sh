#!/usr/bin/env bash
# The open issues' figures of record, rerun on one GPU (commands and figures: docs/performance.md).
# Usage, on a CUDA machine from the repo root: bash bench/records.sh [GROUP ...]; groups: dense fp8
# fp8-serving lora-fp8 moe hybrid hybrid-moe rotation (default: all, ~25 min on an H200; one
# device call runs at most 10 minutes, so name a few). Each command prints its JSON lines, as its
# bench does, after a line naming it; a timeout or failure is reported and the next one runs.
# hybrid-moe holds 24 layers (~77 GB) where the card has more than 100 GB, else 16.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=$([ "${memory:-0}" -gt 100000 ] && echo 24 || echo 16)
declare -A commands=(
  [dense]="bench/gpu.py --batches 1 64 256"
  [fp8]="bench/gpu.py --quantization fp8 --compare --batches 1 256"
  [fp8-serving]="bench/serving.py --quantization fp8 --compare --concurrency 256 --prompt-range 128 128 --output-range 128 128"
  [lora-fp8]="bench/serving.py --quantization fp8 --concurrency 64 --hf-concurrency --lora-adapters 64 --rounds 1"
  [moe]="bench/moe.py --engine --batches 1 16 64"
  [hybrid]="bench/hybrid.py --batches 1 16 64 --prompt-len 256"
  [hybrid-moe]="bench/hybrid.py --moe --layers $layers --batches 1 16 64 --prompt-len 256"
  [rotation]="bench/rotation.py --duration 20 --max-loras 64 --engine-arg lora_memory_bytes=16e9"
)
order=(dense fp8 fp8-serving lora-fp8 moe hybrid hybrid-moe rotation)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
[ $# -gt 0 ] && order=("$@")
for group in "${order[@]}"; do
  command=${commands[$group]:-}
  if [ -z "$command" ]; then echo "unknown group $group (groups: ${!commands[*]})" >&2; exit 2; fi
  echo "## $group: python3 $command"
  timeout "${RECORD_TIMEOUT_S:-590}" python3 $command 2>&1 | grep -E '^\{|Error|error:'
  status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then echo "## $group: exit status $status"; fi
done
