#!/usr/bin/env bash
# On the device machine: the engine scenarios and the fault-injection tests with CUDA rank
# workers. Build here and carry gpu-bin/:
#   cargo test --release --features cuda --test engine --test fault_injection --no-run
#   (copy the two executables it names to gpu-bin/engine and gpu-bin/fault_injection)
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_TEST_DEVICE=cuda TROUPE_HOME=/tmp/troupe-home
status=0
for t in fault_injection engine; do
  echo "== $t (CUDA rank worker)"
  # The CLI scenario runs the default model on the CPU and needs the network: not here.
  gpu-bin/$t --test-threads 1 --skip cli_runs_64_prompts || status=1
done
exit $status
