#!/usr/bin/env bash
# Online serving benchmark: starts `troupe serve` on the default model (CPU backend) on a
# free port, runs `troupe bench-serve` against it, stops the server. Arguments go to
# bench-serve and override its defaults, e.g.
#   bash scripts/bench_serve.sh --num-prompts 32 --rates 1,2,4,inf --output-len 32
# Server flags go in SERVE_ARGS: SERVE_ARGS="--no-zos" bash scripts/bench_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
troupe=target/release/troupe

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
# SERVE_ARGS is split on purpose: it holds several flags.
# shellcheck disable=SC2086
"$troupe" serve --port "$port" ${SERVE_ARGS:-} 2>"$log" &
server=$!
stop() {
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  rm -f "$log"
}
trap stop EXIT

# The first run fetches the default model, so allow minutes before giving up.
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    break
  fi
  if ! kill -0 "$server" 2>/dev/null; then
    echo "scripts/bench_serve.sh: troupe serve exited before it was healthy:" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.5
done
if ! curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
  echo "scripts/bench_serve.sh: troupe serve not healthy after 300 s" >&2
  exit 1
fi

"$troupe" bench-serve --url "http://127.0.0.1:$port" "$@"
