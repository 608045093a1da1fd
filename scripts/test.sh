#!/usr/bin/env bash
# Set up .venv with the dev and triton extras, then lint, type-check and run the whole test suite (CPU only).
set -euo pipefail
EXTRAS=dev,triton
. "$(dirname "$0")/setup_env.sh"
ruff check .
ruff format --check .
mypy scheduler_node proto kernels worker_node minivllm tests scripts
python -m pytest -q --durations=15 "$@"
