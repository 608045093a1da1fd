#!/usr/bin/env bash
# Set up .venv, start vllm-serve (scheduler + one worker) on the default model at 127.0.0.1:50051,
# serve one request to show it works, then keep serving until Ctrl-C. Extra arguments go to vllm-serve.
set -euo pipefail
. "$(dirname "$0")/setup_env.sh"
PORT=50051
for ((i = 1; i <= $#; i++)); do [ "${!i}" = "--grpc-port" ] && j=$((i + 1)) && PORT=${!j}; done  # vllm-serve: --port is HTTP
vllm-serve "$@" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' INT TERM
vllm-client --port "$PORT" --wait-ready 600 --chat --temperature 0 --max-tokens 48 \
  "In one sentence, what is a large language model?" || { kill -TERM $SERVER; wait $SERVER; exit 1; }
cat <<MSG

minivllm is serving on 127.0.0.1:$PORT (gRPC, package minivllm.v1). Query it with:
  .venv/bin/vllm-client --port $PORT "Tell me a joke"
  .venv/bin/vllm-client --port $PORT --no-chat --temperature 0 --max-tokens 64 "The capital of France is"
  grpcurl -plaintext -d '{"prompt": "Hello", "sampling": {"max_tokens": 16}}' 127.0.0.1:$PORT minivllm.v1.Generation/Generate
Ctrl-C stops the scheduler and its workers.
MSG
wait $SERVER
