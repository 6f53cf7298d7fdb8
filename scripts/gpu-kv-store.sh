#!/usr/bin/env bash
# On the device machine: the prefix store's engine tests on the GPU, then the TTFT of a
# 4 096-token prompt by where its prefix lies (cold, device, host memory, disk) for the
# Qwen3-0.6B shape (random weights saved by transformers) and the Llama-3.1-8B shape
# (--dummy-weights).
# Usage: bash scripts/gpu-kv-store.sh BIN_DIR   (BIN_DIR: the kv_store test binary and
# the prefix_store_ttft bench binary, built with --features cuda)
set -u
BIN=$1
REPO=$(cd "$(dirname "$0")/.." && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu
export TROUPE_HOME=${TROUPE_HOME:-/tmp/th}
echo "== tests (GPU)"
TROUPE_TEST_DEVICE=cuda "$BIN"/kv_store --test-threads 1 blocks_evicted two_engines 2>&1 | tail -5
echo "== models"
MODELS=$(cd "$REPO/scripts" && python3 -c '
import gpu_bench
print(gpu_bench.make("qwen3-0.6b"), gpu_bench.llama_8b_config()[0])')
read -r QWEN LLAMA <<< "$MODELS"
echo "== ttft qwen3-0.6b shape"
TTFT_DEVICE=cuda TTFT_MODEL="$QWEN" TTFT_KV_MIB=640 "$BIN"/prefix_store_ttft
echo "== ttft llama-3.1-8b shape (dummy weights)"
TTFT_DEVICE=cuda TTFT_MODEL="$LLAMA" TTFT_DUMMY=1 TTFT_KV_MIB=680 "$BIN"/prefix_store_ttft
echo "== ttft llama-3.1-8b shape (dummy weights), fp8 KV"
TTFT_DEVICE=cuda TTFT_MODEL="$LLAMA" TTFT_DUMMY=1 TTFT_KV_MIB=340 TTFT_KV_DTYPE=fp8 "$BIN"/prefix_store_ttft
