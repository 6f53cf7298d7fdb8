#!/usr/bin/env bash
# On the device machine: the server against the offline engine on one H200
# (scripts/gpu_serve.py), then the fault-injection scenarios in the default (not
# batch-invariant) mode on CUDA rank workers. Build here and carry gpu-bin/:
#   cargo build --release --features cuda && cp target/release/troupe gpu-bin/
#   cargo test --release --features cuda --test fault_injection --no-run   (copy it to gpu-bin/fault_injection)
#   bash scripts/gpu-serve.sh [serve|faults|all] [requests per run, default 1024]
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 TROUPE_HOME=/tmp/troupe-home
part=${1:-all}
status=0
if [ "$part" != serve ]; then
  echo "== fault_injection, CUDA rank worker, default mode"
  TROUPE_TEST_DEVICE=cuda TROUPE_TEST_MODE=default gpu-bin/fault_injection --test-threads 1 || status=1
fi
if [ "$part" != faults ]; then
  python3 scripts/gpu_serve.py gpu-bin/troupe "${2:-1024}" || status=1
fi
exit $status
