#!/usr/bin/env bash
# On the device machine: the tensor-core tile GEMM's tests (grouped experts, invariant dense
# GEMM), DeepSeek-V4's GPU tests, then V4-Flash decode/prefill (`gpu_dsv4.py`, no peer) and
# the invariant-vs-default decode table (`gpu_bench.py invariant`). Carry gpu-bin/ with
# cuda_dsv4_recorded, cuda_tile_gemm, cuda_deepseek_v4, cuda_packed, deepseek_v4_engine and a stripped troupe (`--features cuda`).
#   OUT=... bash scripts/gpu-moe.sh [tests|dsv4|invariant|all] [gpu_dsv4.py args]
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home TROUPE_TEST_DEVICE=cuda
what=${1:-all}
shift || true
out=${OUT:-/tmp/gpu-moe}
mkdir -p "$out"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in cuda_dsv4_recorded cuda_tile_gemm cuda_deepseek_v4 cuda_packed; do
    echo "== $t"
    timeout 300 gpu-bin/$t --test-threads 1 2>&1 | grep -E "^test |test result|panicked|assert" || status=1
  done
  echo "== deepseek_v4_engine (CUDA rank worker, --spec mtp and ngram included)"
  timeout 300 gpu-bin/deepseek_v4_engine --test-threads 1 --skip expert_parallel --skip a_lost_rank 2>&1 \
    | grep -E "^test |test result|panicked|assert" || status=1
fi
if [ "$what" = dsv4 ] || [ "$what" = all ]; then
  echo "== V4-Flash"
  OUT=$out timeout 400 python3 scripts/gpu_dsv4.py gpu-bin/troupe --out "$out" --no-peer "$@" 2>&1 | tail -14 || status=1
fi
if [ "$what" = invariant ] || [ "$what" = all ]; then
  echo "== invariant vs default"
  OUT=$out timeout 500 python3 scripts/gpu_bench.py gpu-bin/troupe invariant 2>&1 | grep -E "b(1|16|64):|error" || status=1
fi
exit $status
