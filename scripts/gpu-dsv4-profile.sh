#!/usr/bin/env bash
# On the device machine: where a DeepSeek-V4 prefill (and a few decode steps) spends its
# GPU time — a 3-layer V4-Flash shape (SWA, CSA, HCA) with --dummy-weights under Nsight
# Compute, kernel durations summed by kernel name, largest first. Carry gpu-bin/troupe.
#   bash scripts/gpu-dsv4-profile.sh [prompt tokens] [new tokens]
# With DECODE_STEPS=N: profiled twice (1 and 1 + N new tokens) and the difference shown per
# decode step, so the prefill's kernels drop out. LAYERS=N changes the depth (default 3).
# With KERNEL=name: instead, Nsight Compute's full sections (throughput, occupancy, warp
# stall reasons) for that kernel's launches after the first SKIP (default 12) of a run of NEW
# tokens. EXTRA="--batch-invariant ..." is passed to every troupe run.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
PROMPT=${1:-4096}
NEW=${2:-1}
M=$(mktemp -d)
python3 - "$M" "${LAYERS:-3}" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from gpu_dsv4 import shape
json.dump(dict(shape(int(sys.argv[2])), model_type="deepseek_v4"), open(f"{sys.argv[1]}/config.json", "w"))
PY
IDS=$(python3 -c "import random; r=random.Random(0); print(','.join(str(r.randrange(2, 129280)) for _ in range($PROMPT)))")
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# The kernels are compiled before the profiled run, so NVRTC's time is not in it; the same
# run unprofiled gives the wall time the kernel times are compared with.
gpu-bin/troupe generate --model "$M" --dummy-weights --device cuda --prompt-ids "$IDS" \
  --max-tokens "$NEW" --ignore-eos --kv-cache-mib 4096 --max-num-seqs 1 \
  --max-num-batched-tokens 8192 ${EXTRA:-} --stats "$M/stats.json" >/dev/null
python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"unprofiled: prefill {s['prefill_tokens']} tokens at {s['prefill_tokens_per_s']:.0f} tok/s = {s['prefill_tokens'] / s['prefill_tokens_per_s'] * 1e3:.1f} ms\")" "$M/stats.json"
profile() {
  timeout 400 "$NCU" --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size \
    gpu-bin/troupe generate --model "$M" --dummy-weights --device cuda --prompt-ids "$IDS" \
    --max-tokens "$1" --ignore-eos --kv-cache-mib 4096 --max-num-seqs 1 \
    --max-num-batched-tokens 8192 --skip-warmup ${EXTRA:-} > "$2" 2> "$M/ncu.err" || { tail -5 "$M/ncu.err"; }
}
if [ -n "${KERNEL:-}" ]; then
  timeout 400 "$NCU" --set full -k "regex:^${KERNEL}" --launch-skip "${SKIP:-12}" -c 2 \
    gpu-bin/troupe generate --model "$M" --dummy-weights --device cuda --prompt-ids "$IDS" \
    --max-tokens "$NEW" --ignore-eos --kv-cache-mib 4096 --max-num-seqs 1 \
    --max-num-batched-tokens 8192 --skip-warmup ${EXTRA:-} 2> "$M/ncu.err" \
    | grep -E "^  [a-z_]+|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|stalled|Warp Cycles|Issued|Eligible|Block Limit|Local" \
    | head -80 || tail -5 "$M/ncu.err"
  exit 0
fi
if [ -n "${DECODE_STEPS:-}" ]; then
  profile 1 "$M/base.csv"
  profile $((1 + DECODE_STEPS)) "$M/ncu.csv"
else
  profile "$NEW" "$M/ncu.csv"
fi
[ -n "${OUT:-}" ] && gzip -c "$M/ncu.csv" > "$OUT/ncu.csv.gz"

python3 - "$M/ncu.csv" "${DECODE_STEPS:-}" "$M/base.csv" <<'PY'
import csv, sys, collections
def sums(path):
    rows = list(csv.reader(open(path)))
    at = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head = rows[at]
    k, t = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    total = collections.Counter(); count = collections.Counter()
    for r in rows[at + 1:]:
        if len(r) != len(head):
            continue
        try:
            v = float(r[t].replace(",", ""))
        except ValueError:
            continue
        name = r[k].split("(")[0].split("<")[0][:60]
        if name in ("random_bf16_kernel", "random_mxfp4_kernel"):  # --dummy-weights being made
            continue
        total[name] += v; count[name] += 1
    return total, count
total, count = sums(sys.argv[1])
steps = 1
if sys.argv[2]:
    steps = int(sys.argv[2])
    base, base_count = sums(sys.argv[3])
    total.subtract(base); count.subtract(base_count)
    total = collections.Counter({k: v / steps for k, v in total.items() if count[k] > 0})
    count = collections.Counter({k: c / steps for k, c in count.items() if c > 0})
    print(f"per decode step (the difference of {steps} steps)")
s = sum(total.values())
print(f"{sum(count.values()):.0f} kernels, {s / 1e3:.1f} us of GPU time")
print("| kernel | calls | us | share |")
print("|---|---:|---:|---:|")
for name, v in total.most_common(30):
    print(f"| {name} | {count[name]:.0f} | {v / 1e3:.1f} | {v / s:.1%} |")
PY
