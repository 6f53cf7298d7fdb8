#!/usr/bin/env bash
# Several engines behind `troupe router` against one engine alone, under one mixed load:
# long prompts with short answers (prefill-heavy) and short prompts with long answers
# (decode-heavy) sent at once, each a Poisson stream of `troupe bench-serve`. Modes:
#   solo      one engine, no router
#   replicas  the router and two engines (both roles)
#   pd        the router, a prefill engine and a decode engine (KV handed over; through
#             shared memory, the two on one host)
#   pd-tcp    as pd, the prefill engine told --kv-transport tcp
#   failover  as replicas, one engine killed with SIGKILL KILL_AFTER seconds into the
#             load: its requests re-run on the other (streams it had started end with an
#             error event, counted failed); the e2e latency columns show the tail it adds
#   epd       a vision-language model's E/P/D: the router, an encode engine and an engine
#             that prefills and decodes (images encoded on the first, rows sent on)
#   epd-pd    the router, an encode, a prefill and a decode engine
# With LONG_IMAGES=N the long stream is chats with N noise images of IMAGE_SIZE (WxH)
# each beside LONG_IN text tokens: a mixed text/image load (MODEL a vision-language model,
# e.g. one `scripts/make_vl_bench_model.py` writes).
# The decode-heavy stream's TPOT p99 is what disaggregation protects; the prefill-heavy
# stream's TTFT is what it costs; the router's counters give the KV moved and its rate.
# Env: BIN (troupe binary), MODEL, ENGINE_ARGS (flags every engine gets, e.g.
#   "--device cuda --kv-cache-mib 8192 --gpu-memory-utilization 0.4"), MODES, LONG_IN,
#   LONG_OUT, LONG_N, LONG_RATE, SHORT_IN, SHORT_OUT, SHORT_N, SHORT_RATE.
# Prints one row per mode and stream last.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/troupe}
MODEL=${MODEL:-}
ENGINE_ARGS=${ENGINE_ARGS:-"--kv-cache-mib 512"}
MODES=${MODES:-"solo replicas pd"}
LONG_IN=${LONG_IN:-1024} LONG_OUT=${LONG_OUT:-4} LONG_N=${LONG_N:-12} LONG_RATE=${LONG_RATE:-0.5}
SHORT_IN=${SHORT_IN:-32} SHORT_OUT=${SHORT_OUT:-64} SHORT_N=${SHORT_N:-12} SHORT_RATE=${SHORT_RATE:-1}
KILL_AFTER=${KILL_AFTER:-6}
LONG_IMAGES=${LONG_IMAGES:-0} IMAGE_SIZE=${IMAGE_SIZE:-448x448}
# A vision-language model's vocabulary may be small: prompts go as text then.
text_args=() long_args=()
if [ "$LONG_IMAGES" != 0 ]; then
  text_args=(--text-prompts)
  long_args=(--images-per-request "$LONG_IMAGES" --image-size "$IMAGE_SIZE")
fi
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

wait_health() { # URL WANT_STATUS
  for _ in $(seq 1 1200); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "$1/health" || true)
    if [ "$code" = "$2" ]; then return 0; fi
    sleep 0.25
  done
  echo "bench_cluster: $1 never answered $2" >&2
  exit 1
}

engine() { # PORT [FLAGS...]
  local port=$1
  shift
  # ENGINE_ARGS is split on purpose: it holds several flags.
  # shellcheck disable=SC2086
  "$BIN" serve "${model_args[@]}" --port "$port" $ENGINE_ARGS "$@" 2>>"$out/engines.log" &
  pids+=($!)
}

router() { # HTTP_PORT CLUSTER_PORT
  "$BIN" router "${model_args[@]}" --port "$1" --listen "127.0.0.1:$2" 2>>"$out/router.log" &
  pids+=($!)
  wait_health "http://127.0.0.1:$1" 503
}

engines_in_view() { # URL N
  for _ in $(seq 1 1200); do
    n=$(curl -s "$1/router/engines" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["engines"]))' 2>/dev/null || echo 0)
    if [ "$n" = "$2" ]; then return 0; fi
    sleep 0.25
  done
  echo "bench_cluster: $2 engines never joined" >&2
  exit 1
}

rows=()
for mode in $MODES; do
  http=$(free_port)
  url=http://127.0.0.1:$http
  case $mode in
    solo)
      engine "$http"
      wait_health "$url" 200
      ;;
    replicas|pd|pd-tcp|failover|epd|epd-pd)
      cluster=$(free_port)
      router "$http" "$cluster"
      case $mode in
        pd|pd-tcp) roles=(prefill decode) ;;
        epd) roles=(encode both) ;;
        epd-pd) roles=(encode prefill decode) ;;
        *) roles=(both both) ;;
      esac
      for i in "${!roles[@]}"; do
        extra=()
        if [ "$mode" = pd-tcp ] && [ "${roles[$i]}" = prefill ]; then extra=(--kv-transport tcp); fi
        engine "$(free_port)" --cluster "127.0.0.1:$cluster" --node-name "$mode-${roles[$i]}-$i" --role "${roles[$i]}" "${extra[@]}"
      done
      victim=${pids[-1]}
      engines_in_view "$url" "${#roles[@]}"
      ;;
  esac
  "$BIN" bench-serve --url "$url" --rates 4 --num-prompts 4 --input-len 64 --output-len 4 "${text_args[@]}" >/dev/null
  before=$(curl -s "$url/router/engines" || echo '{}')
  "$BIN" bench-serve --url "$url" --rates "$LONG_RATE" --num-prompts "$LONG_N" --input-len "$LONG_IN" \
    --output-len "$LONG_OUT" --seed 1 "${long_args[@]}" --json "$out/$mode-long.json" >/dev/null &
  long=$!
  if [ "$mode" = failover ]; then
    (sleep "$KILL_AFTER"; kill -9 "$victim") &
  fi
  "$BIN" bench-serve --url "$url" --rates "$SHORT_RATE" --num-prompts "$SHORT_N" --input-len "$SHORT_IN" \
    --output-len "$SHORT_OUT" --seed 2 "${text_args[@]}" --json "$out/$mode-short.json" >/dev/null
  wait "$long"
  after=$(curl -s "$url/router/engines" || echo '{}')
  rows+=("$(python3 - "$mode" "$out/$mode-long.json" "$out/$mode-short.json" "$before" "$after" <<'EOF'
import json, sys
mode, long_f, short_f, before, after = sys.argv[1:]
lr, sr = json.load(open(long_f))[0], json.load(open(short_f))[0]
try:
    b, a = json.loads(before), json.loads(after)
    moved = a.get("kv_bytes_moved", 0) - b.get("kv_bytes_moved", 0)
    secs = a.get("kv_transfer_secs", 0) - b.get("kv_transfer_secs", 0)
    encoded = a.get("encoded_images", 0) - b.get("encoded_images", 0)
except ValueError:
    moved, secs, encoded = 0, 0, 0
rate = f"{moved / secs / 1e6:.0f}" if secs > 0 else "-"
f = lambda v: "-" if v is None else f"{v:.0f}"
print(f"| {mode} | {lr['completed']}/{lr['completed'] + lr['failed']} | {f(lr['ttft_p50_ms'])} | {f(lr['ttft_p99_ms'])} "
      f"| {sr['completed']}/{sr['completed'] + sr['failed']} | {f(sr['ttft_p50_ms'])} | {f(sr['tpot_p50_ms'])} | {f(sr['tpot_p99_ms'])} "
      f"| {f(lr['e2el_p50_ms'])} | {f(lr['e2el_p99_ms'])} | {f(sr['e2el_p50_ms'])} | {f(sr['e2el_p99_ms'])} "
      f"| {lr['output_token_throughput'] + sr['output_token_throughput']:.1f} | {moved / 1e6:.0f} | {rate} | {encoded} |")
EOF
)")
  stop_all
done
# One thread's host copy (bytes copied a second; read + written is twice that), the
# ceiling of a KV move through host memory: shared memory copies a block twice (into the
# region, out of it), one copy overlapping the other; TCP about four times.
copy=$(python3 -c '
import time
src = bytearray(1 << 30)
best = 0
for _ in range(5):
    t = time.perf_counter(); dst = bytes(src); t = time.perf_counter() - t
    best = max(best, len(src) / t)
print(f"{best / 1e6:.0f}")')
echo "host copy, one thread: $copy MB/s copied ($((2 * copy)) MB/s read + written)"
echo "long: $LONG_N x ($LONG_IN in, $LONG_IMAGES images of $IMAGE_SIZE, $LONG_OUT out) at $LONG_RATE/s; short: $SHORT_N x ($SHORT_IN in, $SHORT_OUT out) at $SHORT_RATE/s"
echo "| mode | long ok | long TTFT p50 ms | long TTFT p99 ms | short ok | short TTFT p50 ms | short TPOT p50 ms | short TPOT p99 ms | long e2e p50 ms | long e2e p99 ms | short e2e p50 ms | short e2e p99 ms | out tok/s | KV moved MB | KV MB/s | images encoded apart |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
