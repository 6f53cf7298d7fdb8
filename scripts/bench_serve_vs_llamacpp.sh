#!/usr/bin/env bash
# Serving side by side on one machine: `troupe serve` and llama.cpp's OpenAI server
# (llama-cpp-python) on the same GGUF file, driven by the same `troupe bench-serve` with
# the same prompts, arrivals and lengths. EOS ids are banned by logit bias on both sides
# (llama.cpp has no `ignore_eos`), so every request generates exactly --output-len tokens.
#
#   LLAMA_PYTHON=/path/to/venv/bin/python bash scripts/bench_serve_vs_llamacpp.sh [bench-serve flags]
#
# LLAMA_PYTHON: a python with `pip install 'llama-cpp-python[server]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_PYTHON:?set LLAMA_PYTHON to a python that has llama-cpp-python[server]}"
cargo build --release --quiet
troupe=target/release/troupe
# Fetches the default model when it is missing.
"$troupe" generate --prompt-ids 1 --max-tokens 1 >/dev/null
gguf="${TROUPE_HOME:-$HOME/.cache/troupe}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=$(nproc)
flags=(--suppress-ids 0,1,2 --text-prompts --num-prompts 32 --rates 1,2,4,inf --input-len 128 --output-len 64 "$@")

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() {
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2
  return 1
}

port=$(free_port)
"$troupe" serve --port "$port" 2>/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_up "$port"
echo "== troupe serve (continuous batching, $threads threads)"
"$troupe" bench-serve --url "http://127.0.0.1:$port" --json target/bench_serve_troupe.json "${flags[@]}"
kill "$server"; wait "$server" 2>/dev/null || true

port=$(free_port)
"$LLAMA_PYTHON" -m llama_cpp.server --model "$gguf" --model_alias smollm2 --n_threads "$threads" \
  --n_threads_batch "$threads" --n_ctx 2048 --interrupt_requests False --port "$port" >/dev/null 2>&1 &
server=$!
wait_up "$port"
echo "== llama.cpp server (llama-cpp-python, one request at a time, $threads threads)"
"$troupe" bench-serve --url "http://127.0.0.1:$port" --model smollm2 --json target/bench_serve_llamacpp.json "${flags[@]}"
