#!/usr/bin/env bash
# On the device machine, in one call: DeepSeek-V4's GPU tests, then where its GPU time goes
# — a 4 096-token prefill and a decode step kernel by kernel (default and
# --batch-invariant), and Nsight Compute's full sections for the decode kernels slower
# than their work. 3-layer V4-Flash shape, --dummy-weights. Carry gpu-bin/ as for
# gpu-moe.sh. PARTS picks and orders the parts (default: every one), each under its own
# time bound so that one slow part does not take the call's output with it.
#   OUT=DIR [PARTS="tests prefill decode invariant kernels"] [KERNELS="name[:skip] ..."] \
#     bash scripts/gpu-dsv4-survey.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for part in ${PARTS:-tests prefill decode invariant kernels}; do
  case $part in
    tests)
      timeout 300 bash scripts/gpu-moe.sh tests 2>&1 | grep -E "^==|test result|panicked" || status=1 ;;
    prefill)
      echo "== prefill, 4 096 tokens"
      OUT= timeout 150 bash scripts/gpu-dsv4-profile.sh 4096 1 2>&1 | tail -34 || status=1 ;;
    decode)
      echo "== decode step, default"
      DECODE_STEPS=6 timeout 200 bash scripts/gpu-dsv4-profile.sh 512 2>&1 | tail -34 || status=1 ;;
    invariant)
      echo "== decode step, --batch-invariant"
      EXTRA=--batch-invariant DECODE_STEPS=6 OUT= timeout 200 bash scripts/gpu-dsv4-profile.sh 512 2>&1 \
        | tail -34 || status=1 ;;
    kernels)
      # KERNELS: names, each with an optional :SKIP (launches to pass first; default 12).
      for ks in ${KERNELS:-dsv4_attention_mma_kernel dsv4_mhc_mix_kernel}; do
        k=${ks%%:*}; skip=12; [ "$k" != "$ks" ] && skip=${ks#*:}
        echo "== $k, full sections"
        KERNEL=$k SKIP=$skip timeout 150 bash scripts/gpu-dsv4-profile.sh 512 8 2>&1 | head -60 || status=1
      done ;;
    *) echo "unknown part $part (tests, prefill, decode, invariant, kernels)"; status=2 ;;
  esac
done
exit $status
