#!/usr/bin/env bash
# Speculation on the H200 with real weights, binary A against binary B in one call: sampled
# and greedy copy prompts past EOS, greedy ones with EOS, and JSON-schema requests with
# and without speculation. Run after scripts/gpu-spec-real.sh's pieces have been joined into
# one GGUF.
#   bash scripts/gpu-spec-ab.sh BIN_A BIN_B MODEL.gguf OUT
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1 b=$2 model=$3 out=$4
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# Both binaries share one decode curve: measured by the first, loaded by the second.
export TROUPE_HOME=${TROUPE_HOME:-$out/troupe-home}
for side in a b; do
  bin=${!side}
  echo "== $side: $bin"
  GPU_SPEC_TEMPERATURE=0.7 GPU_SPEC_IGNORE_EOS=1 GPU_SPEC_CONCURRENCY=32,128 \
    GPU_SPEC_MODES=off,confidence OUT=$out/$side-t07-past python3 scripts/gpu_spec.py "$bin" "$model" | tail -5
  GPU_SPEC_IGNORE_EOS=1 GPU_SPEC_CONCURRENCY=32,128 GPU_SPEC_MODES=off,confidence \
    OUT=$out/$side-greedy-past python3 scripts/gpu_spec.py "$bin" "$model" | tail -5
  GPU_SPEC_CONCURRENCY=1x32,128 GPU_SPEC_MODES=off,confidence \
    OUT=$out/$side-greedy-eos python3 scripts/gpu_spec.py "$bin" "$model" | tail -5
  GPU_GRAMMAR_CONCURRENCY=32,128 GPU_GRAMMAR_MODES=device,device-spec \
    OUT=$out/$side-grammar python3 scripts/gpu_grammar.py "$bin" "$model" | tail -5
done
