#!/usr/bin/env bash
# On the device machine: DeepSeek-V4 (reduced-depth V4-Flash, --dummy-weights) on the GPU
# against transformers, `scripts/gpu_dsv4.py`. Carry gpu-bin/ with a stripped
# `cargo build --release --features cuda` binary as gpu-bin/troupe.
#   bash scripts/gpu-dsv4.sh [--layers N] [--no-peer] ...
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
python3 scripts/gpu_dsv4.py gpu-bin/troupe --out "${OUT:-.}" "$@"
