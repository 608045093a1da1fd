#!/usr/bin/env bash
# Set up .venv with the dev and triton extras, then lint, type-check and run the whole test suite (CPU only).
set -euo pipefail
EXTRAS=dev,triton
. "$(dirname "$0")/setup_env.sh"
ruff check .
ruff format --check .
mypy settings scheduler_node router_node clients proto kernels worker_node minivllm tests scripts
# Two test processes (TEST_WORKERS; 0: one, in this process), each taking whole modules (their shared clusters and
# fixtures stay in one process): much of an end-to-end test is waiting on processes, timeouts and cut links. The
# modules go out in the order tests/conftest.py sorts them (the slow ones first), not by their count of tests.
python -m pytest -q --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
