#!/usr/bin/env bash
# On the device machine: DeepSeek-V4 on a CUDA rank (batch-invariant) against transformers on
# random checkpoints (scripts/dsv4_differential.py): the committed cases, then the cases in
# $CASES when given; before them the GPU's own DeepSeek-V4 tests. Build here and carry gpu-bin/
# (and the cases, e.g. under target/):
#   cargo test --release --features cuda --test cuda_deepseek_v4 --test deepseek_v4_engine \
#     --test deepseek_v4_differential --no-run   (copy each executable to gpu-bin/<test name>)
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_TEST_DEVICE=cuda TROUPE_HOME=/tmp/troupe-home
status=0
echo "== cuda_deepseek_v4 (kernels vs the CPU reference)"
gpu-bin/cuda_deepseek_v4 --test-threads 1 || status=1
echo "== deepseek_v4_engine (CUDA rank worker)"
gpu-bin/deepseek_v4_engine --test-threads 1 --skip speculative --skip mtp_speculation \
  --skip expert_parallel --skip a_lost_rank || status=1
echo "== differential cases, committed (CUDA rank worker)"
gpu-bin/deepseek_v4_differential --nocapture engine || status=1
if [ -n "${CASES:-}" ]; then
  echo "== differential cases, $CASES (CUDA rank worker)"
  TROUPE_DSV4_CASES="$CASES" gpu-bin/deepseek_v4_differential --nocapture engine || status=1
  echo "== differential cases, $CASES (the GPU pass against transformers' logits)"
  TROUPE_DSV4_CASES="$CASES" gpu-bin/cuda_deepseek_v4 --nocapture random_checkpoints || status=1
fi
exit $status
