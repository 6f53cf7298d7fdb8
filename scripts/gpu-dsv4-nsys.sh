#!/usr/bin/env bash
# On the device machine: where a DeepSeek-V4 decode step's time goes, host side included —
# the V4-Flash shape at N layers (--dummy-weights) under Nsight Systems: a short prompt,
# then NEW batch-1 decode steps; prints the kernel summary and the CUDA API summary
# (allocations, copies, synchronizations), largest first. Carry gpu-bin/troupe.
#   OUT=... bash scripts/gpu-dsv4-nsys.sh [layers] [new tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export TROUPE_HOME=/tmp/troupe-home
LAYERS=${1:-9}
NEW=${2:-64}
M=$(mktemp -d)
python3 - "$M" "$LAYERS" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from gpu_dsv4 import shape
json.dump(dict(shape(int(sys.argv[2])), model_type="deepseek_v4"), open(f"{sys.argv[1]}/config.json", "w"))
PY
IDS=$(python3 -c "import random; r=random.Random(0); print(','.join(str(r.randrange(2, 129280)) for _ in range(64)))")
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
run() {
  "$@" gpu-bin/troupe generate --model "$M" --dummy-weights --device cuda --prompt-ids "$IDS" \
    --max-tokens "$NEW" --ignore-eos --kv-cache-mib 4096 --max-num-seqs 1 --stats "$M/stats.json" >/dev/null
}
run
python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"unprofiled: decode {s['decode_tokens_per_s']:.1f} tok/s = {1e3 / s['decode_tokens_per_s']:.2f} ms a step\")" "$M/stats.json"
run "$NSYS" profile -o "$M/p" --force-overwrite true -t cuda >/dev/null 2>&1
"$NSYS" stats -q -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$M/s" "$M/p.nsys-rep" >/dev/null 2>&1 || true
[ -n "${OUT:-}" ] && cp "$M"/s_*.csv "$OUT/" 2>/dev/null
python3 - "$M" "$NEW" <<'PY'
import csv, glob, sys
m, new = sys.argv[1], int(sys.argv[2])
for f in sorted(glob.glob(f"{m}/s_*.csv")):
    rows = list(csv.DictReader(open(f)))
    print(f"== {f.rsplit('/', 1)[-1]} (per decode step: total / {new})")
    for r in rows[:14]:
        t = float(r.get("Total Time (ns)", 0))
        print(f"{t / 1e6 / new:8.3f} ms  {int(r.get('Num Calls', r.get('Instances', 0))):7d}  {r.get('Name', '')[:90]}")
PY
