#!/usr/bin/env bash
# Set everything up, then run the linter and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
exec python -m pytest -q "$@"
