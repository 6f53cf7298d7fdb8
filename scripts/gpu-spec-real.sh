#!/usr/bin/env bash
# Speculative decoding on the H200 with real weights (the default model's GGUF), which is
# larger than what one device call carries: the file travels in pieces, one call each,
# while the machine stays warm, and the last call joins them and runs the benchmark.
#   split -b 33M SmolLM2-135M-Instruct.Q4_1.gguf gpu-bin/part-   (here; one piece a call:
#   a call carries the working tree too, ~13 MB, within its 64 MiB)
#   bash scripts/gpu-spec-real.sh piece gpu-bin/part-aa           (device, every piece)
#   bash scripts/gpu-spec-real.sh run SHA256                      (device, the last call)
set -euo pipefail
cd "$(dirname "$0")/.."
store=/tmp/troupe-model
mkdir -p "$store"
case "$1" in
  piece)
    mv "$2" "$store/"
    ls -la "$store"
    ;;
  run)
    cat "$store"/part-* > "$store/model.gguf"
    echo "$2  $store/model.gguf" | sha256sum -c
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
    export TROUPE_HOME=/tmp/troupe-home
    python3 scripts/gpu_spec.py target/release/troupe "$store/model.gguf"
    ;;
esac
