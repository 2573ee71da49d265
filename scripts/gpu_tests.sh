#!/usr/bin/env bash
# The GPU tests, on a CUDA machine from the repo root, in two parts that each fit one 10-minute
# device call (an H100, 2026-12-07: part 1, files a-j, 280 tests in ~7 min; part 2, 230 in ~3).
# The device machine has torch and Triton but not the services' packages, so tests/conftest.py
# is not loaded (the GPU tests' fixture comes from tests/torch_fixtures.py) and only the files
# that hold GPU tests are collected. llguidance, for the structured-output rows, is taken from a
# wheel in the ignored .gpuwheels/ when one is there (the device cannot reach PyPI).
# Usage: bash scripts/gpu_tests.sh 1|2|all [pytest arguments ...]
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
case $part in
  1) mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -E '^tests/test_[a-j]') ;;
  2) mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -vE '^tests/test_[a-j]') ;;
  all) ;;
  *) echo "usage: bash scripts/gpu_tests.sh 1|2|all [pytest arguments ...]" >&2; exit 2 ;;
esac
wheels=(.gpuwheels/llguidance-*.whl)
if [ -e "${wheels[0]}" ]; then
  python3 -m zipfile -e "${wheels[0]}" /tmp/llg
  export PYTHONPATH=/tmp/llg${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m pytest -q -p no:cacheprovider --noconftest -p tests.torch_fixtures -m gpu "${files[@]}" "$@"
