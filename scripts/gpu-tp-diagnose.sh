#!/usr/bin/env bash
# On a two-GPU device machine: short bounded runs of a two-rank group on the tiny
# checkpoint (eager; with graphs under NCCL settings that change how captures work), NCCL's
# own log on; a run that hangs past its limit
# gets every thread's name, state and stack (gdb when present) before it is killed.
#   bash scripts/gpu-tp-diagnose.sh trace   # instead: two runs with graphs, with and
#     without ZOS, under troupe's debug log (RUST_LOG): each rank's steps, graph phases,
#     waits for sampled tokens, read-backs, communicator aborts — where a hung group stops.
# (The hang this was written for: a rank aborting its communicator before destroying the
# graphs that recorded it; BENCHMARKS.md, "Tensor parallelism on two H200s".)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-tp}
mkdir -p "$OUT"
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${nccl_lib}:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home NCCL_DEBUG=WARN
if [ "${1:-}" = trace ]; then
  for zos in zos no-zos; do
    extra=(); [ $zos = no-zos ] && extra=(--no-zos)
    RUST_LOG=troupe=debug timeout 20 target/release/troupe generate \
      --model tests/goldens/tiny-llama --device cuda --tp 2 --prompt-ids 1,2,3,4,5 \
      --max-tokens 8 --ignore-eos --temperature 0 --json --kv-cache-mib 64 "${extra[@]}" \
      >"$OUT/trace-$zos.out" 2>"$OUT/trace-$zos.err"
    echo "== $zos: rc=$? $(head -c 200 "$OUT/trace-$zos.out")"
    grep -v "^$" "$OUT/trace-$zos.err" | sed 's/^[0-9T:.-]*Z //' | tail -45
  done
  exit 0
fi
run() {
  local name=$1 limit=$2; shift 2
  "$@" >"$OUT/$name.out" 2>"$OUT/$name.err" &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $limit ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    {
      echo "HUNG after ${limit}s"
      for task in /proc/$pid/task/*; do
        echo "$(cat $task/comm) state=$(awk '{print $3}' $task/stat) wchan=$(cat $task/wchan 2>/dev/null)"
      done
      command -v gdb >/dev/null && gdb -p $pid -batch -ex "thread apply all bt 12" 2>&1 | grep -E "^Thread|^#" | head -150
    } >"$OUT/$name.hang"
    kill -9 $pid
    echo "$name: HUNG"; head -40 "$OUT/$name.hang"
  else
    wait $pid; echo "$name: rc=$? $(tail -c 300 "$OUT/$name.out")"
  fi
  grep -E "WARN|rror" "$OUT/$name.out" "$OUT/$name.err" | head -6
}
gen=(target/release/troupe generate --model tests/goldens/tiny-llama --device cuda --tp 2 --prompt-ids 1,2,3,4,5 --max-tokens 8 --ignore-eos --temperature 0 --json --stats --kv-cache-mib 64)
run eager 30 "${gen[@]}" --enforce-eager
run graphs 25 "${gen[@]}"
NCCL_GRAPH_REGISTER=0 run graphs-no-register 25 "${gen[@]}"
NCCL_GRAPH_REGISTER=0 NCCL_CUMEM_ENABLE=0 run graphs-no-register-no-cumem 25 "${gen[@]}"
NCCL_P2P_DISABLE=1 run graphs-no-p2p 25 "${gen[@]}"
NCCL_GRAPH_MIXING_SUPPORT=0 run graphs-no-mixing 25 "${gen[@]}"
