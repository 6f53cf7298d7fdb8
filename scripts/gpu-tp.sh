#!/usr/bin/env bash
# On a device machine with two GPUs: the tensor-parallel tests with CUDA ranks over NCCL
# (the same scenarios the CPU runs over channels: reference tokens, a rank dying, a GPU
# lost and the group shrinking to one), then scripts/gpu_tp.py (two ranks vs transformers
# and vs one GPU, decode throughput). Build here and carry target/release/troupe and
# gpu-bin/ (gpu-bin/tensor_parallel from
#   cargo test --release --features cuda --test tensor_parallel --no-run).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-tp}
mkdir -p "$OUT"
# NCCL comes with PyTorch's wheels on the device machine.
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${nccl_lib}:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "nccl: ${nccl_lib:-not found} $(ls "$nccl_lib" 2>/dev/null | tr '\n' ' ')"
TROUPE_TEST_DEVICE=cuda timeout 240 gpu-bin/tensor_parallel --test-threads 1 >"$OUT/tp-tests.txt" 2>&1
echo "tensor_parallel tests rc=$?"
grep -E "^test |test result|panicked" "$OUT/tp-tests.txt" | head -20
python3 scripts/gpu_tp.py target/release/troupe >"$OUT/tp-bench.txt" 2>&1
cat "$OUT/gpu_tp.json" 2>/dev/null || tail -20 "$OUT/tp-bench.txt"
