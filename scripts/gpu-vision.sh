#!/usr/bin/env bash
# On the device machine: the vision encoder on the GPU (issue 64) — its tests
# (`tests/cuda_vision.rs`), then `scripts/gpu_vision.py` (its arguments passed on).
# Build here and carry gpu-bin/ (xz'd): a stripped `cargo build --release --features cuda`
# binary as gpu-bin/troupe, `cargo test --release --features cuda --test cuda_vision
# --no-run`'s executable as gpu-bin/cuda_vision and `cargo bench --features cuda --bench
# vision_encoder --no-run`'s as gpu-bin/vision_encoder.
#   [BIN_DIR=gpu-bin] bash scripts/gpu-vision.sh [--skip-tests] [gpu_vision.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home PYTHONUNBUFFERED=1
BIN_DIR=${BIN_DIR:-gpu-bin}
for f in "$BIN_DIR"/troupe "$BIN_DIR"/cuda_vision "$BIN_DIR"/vision_encoder; do
  [ -e "$f.xz" ] && xz -dkf "$f.xz"
  chmod +x "$f"
done
status=0
if [ "${1:-}" = "--skip-tests" ]; then
  shift
else
  echo "== cuda_vision"
  "$BIN_DIR"/cuda_vision --test-threads 1 2>&1 | tail -15 || status=1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/gpu_vision.py --troupe "$BIN_DIR"/troupe --bench "$BIN_DIR"/vision_encoder --out "${OUT:-.}" "$@" || status=1
exit $status
