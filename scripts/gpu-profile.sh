#!/usr/bin/env bash
# On the device machine: where a decode step spends its time.
#   bash scripts/gpu-profile.sh          # batch-1 decode, Llama-3.1-8B shape
#   bash scripts/gpu-profile.sh offline  # the offline workload (Qwen3-0.6B shape, 256
#                                        # requests): ~1 500 launches from its middle
#   bash scripts/gpu-profile.sh attention  # the decode-attention kernel of the kernel
#                                        # benchmark (gpu-bin/cuda_kernels) under Nsight
#                                        # Compute's memory and stall sections
# Decode mode: Runs the --dummy-weights decode with graphs, with and without programmatic edges
# (TROUPE_PDL=0), and eagerly (the same tokens each time), then the same eagerly
# under Nsight Compute, timing ~1 000 decode-phase launches one by one (kernel time without
# the gaps between kernels). Prints per-kernel microseconds a step, last.
#   PROFILE_ARGS="--quantization fp8" bash scripts/gpu-profile.sh   # with FP8 weights
#   BATCH=64 bash scripts/gpu-profile.sh batch  # a batch-64 decode step (16-token prompts),
#                                        # PROFILE_MODEL=0.6b for the Qwen3-0.6B shape
# Build here first: cargo build --release --features cuda; carry target/release/troupe.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
FINAL=${OUT:-/tmp/out}
OUT=$FINAL/raw  # tarred at the end: a call brings back only a few files
mkdir -p "$OUT"
export PROF=$(mktemp -d)  # configs and prompt files
MODE=${1:-decode}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
if [ "$MODE" = attention ]; then
  # Launch 1 of each shape is the warm-up; the benchmark's first two shapes are Qwen3's
  # heads over 8 interleaved KV heads and over one (contiguous keys).
  timeout 300 "$NCU" --clock-control none -k regex:"attention_(gqa|decode_mma)" --launch-count 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats gpu-bin/cuda_kernels --quick \
    > "$OUT/attention.txt" 2> "$OUT/attention.err" || echo "ncu failed: $?"
  grep -E "attention_(gqa|decode_mma).*CC|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Stall|L2 Hit|Registers|Block Limit" \
    "$OUT/attention.txt" | head -80
  tar -C "$FINAL" -czf "$FINAL/profile.tgz" raw && rm -rf "$OUT"
  exit 0
fi
python3 - <<'PY'
import json, os, sys, torch
from transformers import LlamaConfig, Qwen3Config
sys.path.insert(0, "scripts")
prof = os.environ["PROF"]
from gpu_bench import offline_requests
Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True).save_pretrained(f"{prof}/offline")
with open(f"{prof}/offline.jsonl", "w") as f:
    for r in offline_requests():
        f.write(json.dumps(r) + "\n")
LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False).save_pretrained(f"{prof}/8b")
prompt = torch.randint(100, 128000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
open(f"{prof}/p256.jsonl", "w").write(json.dumps({"prompt_ids": prompt, "max_tokens": 256}) + "\n")
open(f"{prof}/p12.jsonl", "w").write(json.dumps({"prompt_ids": prompt, "max_tokens": 12}) + "\n")
batch = int(os.environ.get("BATCH", "64"))
for name, new in (("batch-long", 128), ("batch-short", 6)):
    with open(f"{prof}/{name}.jsonl", "w") as f:
        for i in range(batch):
            ids = torch.randint(100, 128000, (16,), generator=torch.Generator().manual_seed(i + 1))
            f.write(json.dumps({"prompt_ids": ids.tolist(), "max_tokens": new}) + "\n")
PY
MODEL=$PROF/8b; LAYERS=32; SHORT=$PROF/p12.jsonl; SKIP=1500; RUNS="graphs nopdl eager"
KV=(--kv-cache-mib 4096)
if [ "$MODE" = offline ]; then
  # The first ~1 500 launches: the prefill-heavy steps at the start (PROFILE_SKIP moves
  # the window); the KV cache as the benchmark sizes it.
  MODEL=$PROF/offline; LAYERS=28; SHORT=$PROF/offline.jsonl; SKIP=${PROFILE_SKIP:-0}
  RUNS=graphs; KV=()
fi
if [ "$MODE" = batch ]; then
  # Past the batch's prefill step (600 launches still reached into it at batch 64):
  # ~3 decode steps of launches timed.
  SHORT=$PROF/batch-short.jsonl; RUNS=graphs; SKIP=${PROFILE_SKIP:-1500}
  [ "${PROFILE_MODEL:-8b}" = 0.6b ] && { MODEL=$PROF/offline; LAYERS=28; }
fi
# PROFILE_ARGS: more flags for every run (e.g. "--quantization fp8").
read -ra MORE <<< "${PROFILE_ARGS:-}"
run() { target/release/troupe generate --model $MODEL --device cuda --dummy-weights "${MORE[@]}" \
    "${KV[@]}" --ignore-eos --temperature 0 --json --stats "$@"; }
for mode in $RUNS; do
  extra=(); [ $mode = eager ] && extra=(--enforce-eager)
  pdl=1; [ $mode = nopdl ] && pdl=0
  long=$PROF/p256.jsonl; [ "$MODE" = offline ] && long=$PROF/offline.jsonl
  [ "$MODE" = batch ] && long=$PROF/batch-long.jsonl
  TROUPE_PDL=$pdl run --prompts-file $long "${extra[@]}" > "$OUT/tokens-$mode.jsonl" \
    2> "$OUT/decode-$mode.log" || { tail -3 "$OUT/decode-$mode.log"; }
  grep '^{' "$OUT/decode-$mode.log" | tail -1 > "$OUT/stats-$mode.json"
done
if [ -n "$NCU" ]; then
  timeout 400 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --launch-skip $SKIP --launch-count 1500 \
    target/release/troupe generate --model $MODEL --device cuda --dummy-weights "${MORE[@]}" \
    "${KV[@]}" --ignore-eos --temperature 0 --json --enforce-eager \
    --prompts-file $SHORT > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || echo "ncu failed: $?"
fi
python3 - "$OUT" "$RUNS" "$LAYERS" <<'PY' | tee "$OUT/summary.txt" || true
import csv, json, sys, collections, io
out, runs, layers = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
def tokens(mode):
    return [json.loads(l)["token_ids"] for l in open(f"{out}/tokens-{mode}.jsonl") if l.strip()]
names = {"graphs": "graphs, programmatic edges", "nopdl": "graphs, full dependencies", "eager": "eager"}
for mode in runs:
    s = json.load(open(f"{out}/stats-{mode}.json"))
    line = (f"{names[mode]:28s} decode {s['decode_tokens_per_s']:7.1f} tok/s, "
            f"generation {s['output_tokens'] / s['generate_s']:7.1f} out tok/s; prefill "
            f"{s['prefill_tokens']} tokens in {s['prefill_tokens'] / max(s['prefill_tokens_per_s'], 1e-9):.2f} s, "
            f"{s['steps']} steps")
    if "nopdl" in runs:
        t, full = tokens(mode), tokens("nopdl")
        same = sum(a == b for x, y in zip(t, full) for a, b in zip(x, y)) / sum(map(len, full))
        line += f"  tokens = full-dependency graphs: {same:.3f}"
    print(line)
try:
    text = open(f"{out}/ncu.csv").read()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
except Exception as e:
    print("no ncu table:", e); sys.exit(0)
per = collections.defaultdict(list)
for r in rows:
    if r.get("Metric Name") == "gpu__time_duration.sum":
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        per[r["Kernel Name"].split("(")[0]].append(v / 1000 if unit in ("nsecond", "ns") else v)
# One embedding launch a forward pass.
n_layers_steps = len(per.get("embedding_kernel", [])) or 1
print(f"kernels timed: {sum(len(v) for v in per.values())}, steps ≈ {n_layers_steps}")
print(f"{'kernel':40s} {'calls':>6s} {'mean us':>9s} {'us/step':>9s}")
tot = 0
for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    step = sum(v) / max(n_layers_steps, 1e-9)
    tot += step
    print(f"{k[:40]:40s} {len(v):6d} {sum(v)/len(v):9.2f} {step:9.1f}")
print(f"kernel time a step: {tot:.0f} us")
PY
tar -C "$FINAL" -czf "$FINAL/profile.tgz" raw && rm -rf "$OUT"
