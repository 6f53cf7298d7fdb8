#!/usr/bin/env bash
# On the device machine: packed weights (FP8, GGML) on the GPU against their
# dequantization, the layers' regression tests, then the bf16-vs-FP8 decode benchmark.
# Build here: cargo test --release --features cuda --test cuda_packed --test cuda_layers
# --no-run and cargo build --release --features cuda; copy the executables to
# gpu-bin/{cuda_packed,cuda_layers,troupe}; carry gpu-bin.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home PYTHONUNBUFFERED=1
status=0
for t in ${TESTS:-cuda_packed cuda_layers}; do
  echo "== $t"
  timeout 300 gpu-bin/$t --test-threads 1 2>&1 | tail -40 || status=1
done
if [ "${BENCH:-1}" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_bench_out} timeout 400 python3 scripts/gpu_bench.py gpu-bin/troupe quant | tail -60
  cp -r /tmp/gpu_bench_out/*.log "${OUT:-/tmp}" 2>/dev/null || true
fi
exit $status
