#!/usr/bin/env bash
# End-to-end offline run through the actor engine on the CPU backend: 64 prompts of the
# default model, 64 new tokens each (EOS ignored), zero-overhead scheduling on vs off.
# Prints throughput and the rank worker's idle time between steps, from `--stats`.
# Run: cargo build --release && bash scripts/bench_engine.sh
set -euo pipefail
cd "$(dirname "$0")/.."
troupe=target/release/troupe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work/prompts.jsonl" <<'PY'
import json, sys
topics = ["the sea", "Rust", "Paris", "a cat", "winter", "music", "the moon", "bread"]
forms = ["Write about {}.", "What is {}?", "The best thing about {} is", "Tell me a fact about {}.",
         "{} reminds me of", "List three words about {}:", "Why do people like {}?", "Describe {}."]
with open(sys.argv[1], "w") as f:
    for form in forms:
        for t in topics:
            f.write(json.dumps({"prompt": form.format(t), "chat": True}) + "\n")
PY
run() {
  local start end
  start=$(date +%s.%N)
  "$troupe" generate --prompts-file "$work/prompts.jsonl" --max-tokens 64 --ignore-eos --stats "$@" \
    >/dev/null 2>"$work/stats"
  end=$(date +%s.%N)
  python3 - "$work/stats" "$start" "$end" "$*" <<'PY'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
wall = float(sys.argv[3]) - float(sys.argv[2])
mode = "ZOS off" if "--no-zos" in sys.argv[4] else "ZOS on"
print(f"{mode:<8} {wall:>7.2f} s {s['decode_tokens'] / wall:>9.1f} tok/s {s['steps']:>6} steps "
      f"{s['worker_idle_secs'] * 1e3:>9.1f} ms idle {s['worker_idle_secs'] * 1e6 / max(s['steps'], 1):>7.1f} µs/step")
PY
}
echo "64 prompts x 64 tokens, SmolLM2-135M Q4_1, CPU (wall includes model load)"
for _ in 1 2 3; do run "$@"; run --no-zos "$@"; done
