#!/usr/bin/env bash
# Set everything up, then start the local cluster (a model pod on the embedded SmolLM2, the
# adapter service on a local directory, and a gateway), register the shipped demo adapter
# (adapters/smollm2-pirate) through the admin API, answer one prompt with the base model and with
# the adapter, and keep serving until Ctrl-C. Neither Redis nor S3 is needed.
set -euo pipefail
# Spinning OpenMP waits make small CPU matmuls ~100x slower on shared cores (model_service/startup.py).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/spindle up --lora pirate=adapters/smollm2-pirate \
  --prompt "${1:-What is the capital of France? Answer in one sentence.}"
