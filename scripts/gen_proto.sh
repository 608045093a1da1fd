#!/usr/bin/env bash
# Regenerate proto/serving_pb2*.py from proto/serving.proto (run after editing the .proto; the output is committed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iproto --python_out=proto --grpc_python_out=proto --pyi_out=proto proto/serving.proto
# grpc_tools writes a top-level import; our stubs live in the `proto` package.
sed -i 's/^import serving_pb2 as serving__pb2/from proto import serving_pb2 as serving__pb2/' proto/serving_pb2_grpc.py
