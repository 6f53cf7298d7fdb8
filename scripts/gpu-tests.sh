#!/usr/bin/env bash
# On the device machine: the attention and sampling kernels against the CPU backend, then
# the engine scenarios and the fault-injection tests with CUDA rank workers. Build here and
# carry gpu-bin/:
#   cargo test --release --features cuda --test cuda_attention --test cuda_layers --test cuda_packed --test cuda_sampling --test cuda_tile_gemm \
#     --test cuda_deepseek_v4 --test engine --test fault_injection --test fault_modes --test spec_decoding \
#     --test spec_draft_model --test prompt_logprobs --test deepseek_v4_engine --test deepseek_v4_differential --no-run
#   (copy each executable it names to gpu-bin/<test name>)
# `gpu-tests.sh dsv4` runs only DeepSeek-V4's share (cuda_deepseek_v4, deepseek_v4_engine,
# deepseek_v4_differential).
set -euo pipefail
only=${1:-all}
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_TEST_DEVICE=cuda TROUPE_HOME=/tmp/troupe-home
status=0
kernels="cuda_attention cuda_layers cuda_packed cuda_sampling cuda_tile_gemm cuda_deepseek_v4"
workers="fault_injection fault_modes engine spec_decoding spec_draft_model prompt_logprobs"
if [ "$only" = dsv4 ]; then kernels="cuda_tile_gemm cuda_deepseek_v4" workers=; fi
for t in $kernels; do
  echo "== $t (kernels vs the CPU reference)"
  gpu-bin/$t --test-threads 1 || status=1
done
for t in $workers; do
  echo "== $t (CUDA rank worker)"
  # The CLI scenario runs the default model on the CPU and needs the network: not here.
  gpu-bin/$t --test-threads 1 --skip cli_runs_64_prompts || status=1
done
echo "== deepseek_v4_engine (CUDA rank worker)"
# Expert-parallel groups of DeepSeek-V4 run on CPU ranks only.
gpu-bin/deepseek_v4_engine --test-threads 1 --skip expert_parallel --skip a_lost_rank || status=1
echo "== deepseek_v4_differential (CUDA rank worker, random checkpoints)"
gpu-bin/deepseek_v4_differential --test-threads 1 engine || status=1
exit $status
