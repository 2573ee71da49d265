#!/usr/bin/env bash
# Set everything up, then answer a prompt with the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/spindle generate --chat --prompt "${1:-What is the capital of France? Answer in one sentence.}"
