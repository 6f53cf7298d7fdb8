#!/usr/bin/env bash
# On the device machine: where a batch-1 decode step of the Llama-3.1-8B shape spends its
# time. Runs the --dummy-weights decode with graphs, with and without programmatic edges
# (TROUPE_PDL=0), and eagerly (the same tokens each time), then the same eagerly
# under Nsight Compute, timing ~1 000 decode-phase launches one by one (kernel time without
# the gaps between kernels). Prints per-kernel microseconds a step, last.
# Build here first: cargo build --release --features cuda; carry target/release/troupe.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
FINAL=${OUT:-/tmp/out}
OUT=$FINAL/raw  # tarred at the end: a call brings back only a few files
mkdir -p "$OUT" /tmp/prof
python3 - <<'PY'
import json, torch
from transformers import LlamaConfig
LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False).save_pretrained("/tmp/prof/8b")
prompt = torch.randint(100, 128000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
open("/tmp/prof/p256.jsonl", "w").write(json.dumps({"prompt_ids": prompt, "max_tokens": 256}) + "\n")
open("/tmp/prof/p12.jsonl", "w").write(json.dumps({"prompt_ids": prompt, "max_tokens": 12}) + "\n")
PY
run() { target/release/troupe generate --model /tmp/prof/8b --device cuda --dummy-weights \
    --kv-cache-mib 4096 --ignore-eos --temperature 0 --json --stats "$@"; }
for mode in graphs nopdl eager; do
  extra=(); [ $mode = eager ] && extra=(--enforce-eager)
  pdl=1; [ $mode = nopdl ] && pdl=0
  TROUPE_PDL=$pdl run --prompts-file /tmp/prof/p256.jsonl "${extra[@]}" > "$OUT/tokens-$mode.jsonl" \
    2> "$OUT/decode-$mode.log" || { tail -3 "$OUT/decode-$mode.log"; }
  grep '^{' "$OUT/decode-$mode.log" | tail -1 > "$OUT/stats-$mode.json"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
if [ -n "$NCU" ]; then
  timeout 400 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --launch-skip 1500 --launch-count 1000 \
    target/release/troupe generate --model /tmp/prof/8b --device cuda --dummy-weights \
    --kv-cache-mib 4096 --ignore-eos --temperature 0 --json --enforce-eager \
    --prompts-file /tmp/prof/p12.jsonl > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || echo "ncu failed: $?"
fi
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt" || true
import csv, json, sys, collections, io
out = sys.argv[1]
def tokens(mode):
    return [json.loads(l)["token_ids"] for l in open(f"{out}/tokens-{mode}.jsonl") if l.strip()][0]
full = tokens("nopdl")
for mode, what in (("graphs", "graphs, programmatic edges"), ("nopdl", "graphs, full dependencies"),
                   ("eager", "eager")):
    s = json.load(open(f"{out}/stats-{mode}.json"))
    t = tokens(mode)
    same = sum(a == b for a, b in zip(t, full)) / len(full)
    print(f"{what:28s} decode {s['decode_tokens_per_s']:7.1f} tok/s  tokens = full-dependency graphs: {same:.3f}")
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
# One decode attention launch a layer, 32 layers a step.
n_layers_steps = sum(len(v) for k, v in per.items() if k.startswith("attention_gqa")) / 32
print(f"kernels timed: {sum(len(v) for v in per.values())}, decode steps ≈ {n_layers_steps:.2f}")
print(f"{'kernel':40s} {'calls':>6s} {'mean us':>9s} {'us/step':>9s}")
tot = 0
for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    step = sum(v) / max(n_layers_steps, 1e-9)
    tot += step
    print(f"{k[:40]:40s} {len(v):6d} {sum(v)/len(v):9.2f} {step:9.1f}")
print(f"kernel time a step: {tot:.0f} us")
PY
tar -C "$FINAL" -czf "$FINAL/profile.tgz" raw && rm -rf "$OUT"
