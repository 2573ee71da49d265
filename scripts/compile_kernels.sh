#!/usr/bin/env bash
# Compile the Triton kernels for the GPU on this CPU (scripts/triton_compile.py says why). Run it
# before a GPU session: a kernel the compiler refuses otherwise costs a device call to find.
# Triton goes into .venv/triton-cpu, apart from the project's environment (the tests run without it);
# 3.6.0 is the version of the device machines' torch.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_VERSION=${TRITON_VERSION:-3.6.0}
target=.venv/triton-cpu
if [ ! -f "$target/triton-$TRITON_VERSION.dist-info/METADATA" ]; then
  rm -rf "$target"
  .venv/bin/python -m pip install -q --no-deps --target "$target" "triton==$TRITON_VERSION"
fi
files=$(grep -l "TRITON_INTERPRET" tests/test_*.py)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-.venv/triton-cpu-cache}
PYTHONPATH="$target:.:scripts" exec .venv/bin/python -m pytest -q -p no:cacheprovider -p triton_compile \
  --tb=no --no-header -rN -W ignore $files "$@"
