#!/usr/bin/env bash
# KV hand-off bandwidth between two engines on this host, by transport: a router, a
# prefill engine (--kv-transport auto: shared memory; or tcp) and a decode engine; N
# prompts of LEN random tokens sent one after another (nothing else running, so the
# transfer time is the transport's), one output token each. The router's counters give
# the bytes moved and the seconds spent sending; one thread's host copy, measured in the
# same run, is the ceiling. Transports alternate over ROUNDS rounds.
# Env: BIN, MODEL, ENGINE_ARGS, N (4), LEN (1024), ROUNDS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/troupe}
MODEL=${MODEL:-}
ENGINE_ARGS=${ENGINE_ARGS:-"--kv-cache-mib 512"}
N=${N:-4} LEN=${LEN:-1024} ROUNDS=${ROUNDS:-2}
model_args=()
if [ -n "$MODEL" ]; then model_args=(--model "$MODEL"); fi
out=$(mktemp -d)
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$out"' EXIT
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_engines() { # URL N
  for _ in $(seq 1 1200); do
    n=$(curl -s "$1/router/engines" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["engines"]))' 2>/dev/null || echo 0)
    if [ "$n" = "$2" ]; then return 0; fi
    sleep 0.25
  done
  echo "bench_kv_transport: the engines never joined" >&2
  exit 1
}

rows=()
for round in $(seq 1 "$ROUNDS"); do
  for transport in auto tcp; do
    http=$(free_port) cluster=$(free_port)
    url=http://127.0.0.1:$http
    "$BIN" router "${model_args[@]}" --port "$http" --listen "127.0.0.1:$cluster" 2>>"$out/log" &
    pids+=($!)
    for role in prefill decode; do
      # ENGINE_ARGS is split on purpose: it holds several flags.
      # shellcheck disable=SC2086
      "$BIN" serve "${model_args[@]}" --port "$(free_port)" $ENGINE_ARGS --cluster "127.0.0.1:$cluster" \
        --node-name "$role" --role "$role" --kv-transport "$transport" 2>>"$out/log" &
      pids+=($!)
    done
    wait_engines "$url" 2
    rows+=("$(python3 - "$url" "$N" "$LEN" "$round" "$transport" <<'EOF'
import json, random, sys, time, urllib.request
url, n, length, rnd, transport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
def get():
    return json.load(urllib.request.urlopen(url + "/router/engines"))
def complete(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    json.load(urllib.request.urlopen(req, timeout=600))
rng = random.Random(int(rnd))
complete([rng.randrange(100, 30000) for _ in range(64)])  # warm up
before = get()
for _ in range(n):
    complete([rng.randrange(100, 30000) for _ in range(length)])
after = get()
moved = after["kv_bytes_moved"] - before["kv_bytes_moved"]
secs = after["kv_transfer_secs"] - before["kv_transfer_secs"]
took = after["hand_offs_by_transport"]
print(f"{rnd} {transport} {moved} {secs:.4f} {json.dumps(took, separators=(',', ':'))}")
EOF
)")
    stop_all
  done
done
copy=$(python3 -c '
import time
src = bytearray(1 << 30)
best = 0
for _ in range(5):
    t = time.perf_counter(); dst = bytes(src); t = time.perf_counter() - t
    best = max(best, len(src) / t)
print(f"{best / 1e6:.0f}")')
echo "host copy, one thread: $copy MB/s copied; $N prompts of $LEN tokens a run"
echo "| round | --kv-transport | hand-offs by transport | KV moved MB | sending s | KV MB/s | of the host copy |"
echo "|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  read -r rnd transport moved secs took <<<"$r"
  python3 - "$rnd" "$transport" "$moved" "$secs" "$took" "$copy" <<'EOF'
import sys
rnd, transport, moved, secs, took, copy = sys.argv[1:]
moved, secs, copy = int(moved), float(secs), float(copy)
rate = moved / secs / 1e6
print(f"| {rnd} | {transport} | {took} | {moved / 1e6:.0f} | {secs:.3f} | {rate:.0f} | {rate / copy:.2f} |")
EOF
done
