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
  # Its JSON and the runs' logs go to $OUT (the device call's folder) where it is set.
  timeout 400 python3 scripts/gpu_bench.py gpu-bin/troupe quant | tail -60
fi
exit $status
