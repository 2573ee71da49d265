#!/usr/bin/env bash
# Regenerate the committed Python code for protos/spindle/v1/*.proto into spindle/v1/
# (tests/test_protos.py fails when the two disagree). Usage: scripts/gen_protos.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
"$PY" -m grpc_tools.protoc -I protos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/spindle/v1/*.proto
