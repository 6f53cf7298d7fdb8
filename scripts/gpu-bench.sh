#!/usr/bin/env bash
# On the device machine: the CUDA benchmarks beside transformers (scripts/gpu_bench.py).
#   bash scripts/gpu-bench.sh decode    # batch-1 decode, Llama-3.1-8B shape, vs roofline
#   bash scripts/gpu-bench.sh offline   # 256-request offline throughput, Qwen3-0.6B shape
#   bash scripts/gpu-bench.sh peer      # the same workload (64 requests) through transformers
#   bash scripts/gpu-bench.sh dummy     # batch-1 decode, 8B shape, --dummy-weights (no checkpoint)
#   bash scripts/gpu-bench.sh quant     # the same, bf16 against --quantization fp8, vs roofline
# Build here first: cargo build --release --features cuda; carry target/release/troupe.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 TROUPE_HOME=/tmp/troupe-home
python3 scripts/gpu_bench.py target/release/troupe "$1"
