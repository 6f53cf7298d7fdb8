#!/usr/bin/env bash
# On the device machine: every CUDA check and benchmark in one call, most important first
# (device time is scarce), each part's log under $OUT and a summary last.
# Build here first, and carry target/release/troupe and gpu-bin/:
#   cargo build --release --features cuda
#   cargo test --release --features cuda --test cuda_attention --test cuda_layers --test cuda_sampling \
#     --test cuda_deepseek_v4 --test engine --test fault_injection --test spec_decoding \
#     --test spec_draft_model --test deepseek_v4_engine --no-run
#   cargo bench --features cuda --bench cuda_kernels --no-run
#   (copy each test executable to gpu-bin/<test name>, the bench to gpu-bin/cuda_kernels_bench)
# Arguments name the benchmarks to run (offline, decode, peer); none: all three.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-all}
mkdir -p "$OUT"
export GPU_CHECK_SKIP_BENCH=1 GPU_BENCH_ZOS_ONLY=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(offline decode peer)
bash scripts/gpu-tests.sh >"$OUT/tests.txt" 2>&1
LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu \
  gpu-bin/cuda_kernels_bench >"$OUT/kernels.txt" 2>&1
bash scripts/gpu-check.sh >"$OUT/check.txt" 2>&1
for part in "${parts[@]}"; do
  bash scripts/gpu-bench.sh "$part" >"$OUT/$part.txt" 2>&1
done
echo "== sampling kernel, engine and fault-injection tests, CUDA rank worker"
grep -E "^== |test result|FAILED|panicked|rows differ" "$OUT/tests.txt" | head -30
echo "== kernels"
cat "$OUT/kernels.txt"
echo "== checks"
sed -n '/^check /,$p' "$OUT/check.txt" | head -16
for part in "${parts[@]}"; do
  echo "== $part"
  python3 - "$part" <<'PY'
import json, os, sys
part = sys.argv[1]
try:
    d = json.load(open(os.path.join(os.environ["OUT"], f"gpu_bench_{part}.json")))[part]
except Exception as e:
    d = {"error": str(e)}
print(json.dumps(d)[:1500])
PY
done
