#!/usr/bin/env bash
# Set everything up, then run the linter and the test suite.
set -euo pipefail
# Spinning OpenMP waits make small CPU matmuls ~100x slower on shared cores (model_service/startup.py).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# The suite starts Python processes (pods, gateways, `spindle up`, the CLI, tensor-parallel ranks)
# dozens of times; where the environment turns bytecode caching off, each compiled the project's
# sources again (pytest on 2 cores: 376-388 -> 318 s with tests/xdist_scheduling.py's grouping).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
# Two workers (pytest-xdist), a file each at a time: 11.6 -> 8.2 min on 2 cores.
exec python -m pytest -q -n 2 --dist loadfile --durations=20 "$@"
