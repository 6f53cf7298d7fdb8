#!/usr/bin/env bash
# On the device machine: DeepSeek-V4 with routed experts in host memory (issue 60) — the
# GPU tests (`tests/cuda_dsv4_host_experts.rs`), then the whole V4-Flash shape against the
# layers that fit the GPU whole (`scripts/gpu_dsv4_host.py`, its arguments passed on).
# Build here and carry gpu-bin/: a stripped `cargo build --release --features cuda` binary
# as gpu-bin/troupe and `cargo test --release --features cuda --test cuda_dsv4_host_experts
# --no-run`'s executable as gpu-bin/cuda_dsv4_host_experts.
#   bash scripts/gpu-dsv4-host.sh [--skip-tests] [gpu_dsv4_host.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home PYTHONUNBUFFERED=1
status=0
if [ "${1:-}" = "--skip-tests" ]; then
  shift
else
  echo "== cuda_dsv4_host_experts"
  gpu-bin/cuda_dsv4_host_experts --test-threads 1 2>&1 | tail -25 || status=1
fi
nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/gpu_dsv4_host.py gpu-bin/troupe --out "${OUT:-.}" "$@" || status=1
exit $status
