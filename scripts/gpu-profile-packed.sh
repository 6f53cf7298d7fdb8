#!/usr/bin/env bash
# On the device machine: the packed GEMVs of a batch-1 decode (Llama-3.1-8B shape,
# --dummy-weights, --quantization fp8; `bf16` for the bf16 GEMV beside it) under Nsight
# Compute: throughput, occupancy and stall reasons of a few launches.
# Build here: cargo build --release --features cuda; copy target/release/troupe to gpu-bin/.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
PROF=$(mktemp -d)
python3 - "$PROF" <<'PY'
import json, sys
from transformers import LlamaConfig
prof = sys.argv[1]
LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False).save_pretrained(f"{prof}/8b")
PY
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
for mode in ${MODES:-fp8 bf16}; do
  if [ "$mode" = fp8 ]; then k="gemv_fp8"; extra="--quantization fp8"; else k="gemv_(1|silu_1)_kernel"; extra=""; fi
  echo "== $mode"
  timeout 300 "$NCU" --clock-control none -k regex:"$k" --launch-skip 300 --launch-count 6 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis \
    gpu-bin/troupe generate --model "$PROF/8b" --device cuda --dummy-weights --enforce-eager \
    --prompt-ids 1 --max-tokens 8 --kv-cache-mib 1024 $extra > "$PROF/$mode.txt" 2>&1 || echo "ncu: $?"
  grep -E "gemv.*\(|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Compute \(SM\) Throughput|Issue Slots|L1/TEX Hit|L2 Hit|Grid Size|Warp Cycles Per Issued" "$PROF/$mode.txt" | head -70
done
