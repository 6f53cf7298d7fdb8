#!/usr/bin/env bash
# On the device machine: checks and times the CUDA backend (scripts/gpu_check.py).
# Build here first: cargo build --release --features cuda; carry target/release/troupe.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 TROUPE_HOME=/tmp/troupe-home
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 scripts/gpu_check.py target/release/troupe
