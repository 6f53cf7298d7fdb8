#!/usr/bin/env bash
# On the device machine, in one call: DeepSeek-V4's GPU tests, then where its GPU time goes
# — a decode step kernel by kernel (default and --batch-invariant), a 4 096-token
# prefill, and Nsight Compute's full sections for the decode kernels slower than their
# work (attention, mHC mix). 3-layer V4-Flash shape, --dummy-weights. Carry gpu-bin/ as
# for gpu-moe.sh.
#   OUT=DIR bash scripts/gpu-dsv4-survey.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
bash scripts/gpu-moe.sh tests 2>&1 | grep -E "^==|test result|panicked" || status=1
echo "== decode step, default"
DECODE_STEPS=6 bash scripts/gpu-dsv4-profile.sh 512 2>&1 | tail -24 || status=1
echo "== decode step, --batch-invariant"
EXTRA=--batch-invariant DECODE_STEPS=6 OUT= bash scripts/gpu-dsv4-profile.sh 512 2>&1 | tail -24 || status=1
echo "== prefill, 4 096 tokens"
OUT= bash scripts/gpu-dsv4-profile.sh 4096 1 2>&1 | tail -24 || status=1
for k in dsv4_attention_kernel dsv4_mhc_mix_kernel; do
  echo "== $k, full sections"
  KERNEL=$k bash scripts/gpu-dsv4-profile.sh 512 8 2>&1 | head -60 || status=1
done
exit $status
