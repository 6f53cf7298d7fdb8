#!/usr/bin/env bash
# On the device machine: a prefill and a decode engine sharing one GPU (each with half
# of the KV budget) behind the router, against one colocated engine with the whole
# budget, under scripts/bench_cluster.sh's mixed load, on the Qwen3-0.6B shape (its config
# alone, `--dummy-weights`, as scripts/gpu_serve.py serves it). Build here and carry gpu-bin/:
#   cargo build --release --features cuda && cp target/release/troupe gpu-bin/
#   bash scripts/gpu-cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
MODEL=$(cd scripts && python3 -c 'import gpu_serve; print(gpu_serve.config_dir())')
export BIN=gpu-bin/troupe MODEL
export LONG_IN=${LONG_IN:-2048} LONG_OUT=${LONG_OUT:-4} LONG_N=${LONG_N:-32} LONG_RATE=${LONG_RATE:-4}
export SHORT_IN=${SHORT_IN:-64} SHORT_OUT=${SHORT_OUT:-256} SHORT_N=${SHORT_N:-64} SHORT_RATE=${SHORT_RATE:-8}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== one colocated engine, 16 GiB of KV"
MODES=solo ENGINE_ARGS="--device cuda --dummy-weights --kv-cache-mib 16384" bash scripts/bench_cluster.sh 2>&1 | grep -v '^bench-serve:' | tail -6
echo "== a prefill and a decode engine on the same GPU, 8 GiB of KV each"
MODES=pd ENGINE_ARGS="--device cuda --dummy-weights --kv-cache-mib 8192 --kv-host-cache-bytes 8G" bash scripts/bench_cluster.sh 2>&1 | grep -v '^bench-serve:' | tail -6
