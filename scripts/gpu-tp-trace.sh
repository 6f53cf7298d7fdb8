#!/usr/bin/env bash
# On a two-GPU device machine: bounded two-rank runs of the tiny checkpoint with decode
# graphs (TROUPE_GROUP_GRAPHS=1) and troupe's debug log (RUST_LOG), with and without ZOS:
# each rank's steps, graph phases, waits for sampled tokens, read-backs, to see where a
# hung group stops (so far: after the last step is read back, in the shutdown).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-tp}
mkdir -p "$OUT"
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${nccl_lib}:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home NCCL_NVLS_ENABLE=0 TROUPE_GROUP_GRAPHS=1 RUST_LOG=troupe=debug
for zos in zos no-zos; do
  extra=(); [ $zos = no-zos ] && extra=(--no-zos)
  timeout 20 target/release/troupe generate --model tests/goldens/tiny-llama --device cuda --tp 2 \
    --prompt-ids 1,2,3,4,5 --max-tokens 8 --ignore-eos --temperature 0 --json --kv-cache-mib 64 \
    "${extra[@]}" >"$OUT/trace-$zos.out" 2>"$OUT/trace-$zos.err"
  echo "== $zos: rc=$? $(head -c 200 "$OUT/trace-$zos.out")"
  grep -v "^$" "$OUT/trace-$zos.err" | sed 's/^[0-9T:.-]*Z //' | tail -45
done
