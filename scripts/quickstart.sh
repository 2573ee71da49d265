#!/usr/bin/env bash
# Set everything up, then start the local cluster (a model pod on the embedded SmolLM2 and a
# gateway), answer one prompt through the gateway with the base model and with the shipped demo
# adapter (adapters/smollm2-pirate), and keep serving until Ctrl-C.
set -euo pipefail
# Spinning OpenMP waits make small CPU matmuls ~100x slower on shared cores (model_service/__init__.py).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/spindle up --lora pirate=adapters/smollm2-pirate \
  --prompt "${1:-What is the capital of France? Answer in one sentence.}"
