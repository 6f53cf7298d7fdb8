#!/usr/bin/env bash
# Speculative decoding on the CPU backend with the default model (SmolLM2-135M-Instruct):
# 32 chat prompts that copy or edit text and code (what prompt lookup predicts), 128 new
# tokens each, greedy, all at once; no speculation vs n-gram drafts verified in full
# (fixed, K = 5) vs confidence-scheduled (K = 5). Prints tok/s, steps, verify tokens a
# step, accepted drafts per verify row, and whether the outputs equal the plain run (and,
# in the batch-invariant mode, the plain invariant run).
# Then the same with a draft model (--spec draft): no smaller model with SmolLM2's tokenizer
# is at hand, so the draft is the model's first HEAD and last TAIL blocks
# (scripts/make_layer_draft.py; BENCH_SPEC_DRAFT="HEAD TAIL", default "22 6").
# Run: cargo build --release && bash scripts/bench_spec.sh
set -euo pipefail
cd "$(dirname "$0")/.."
troupe=target/release/troupe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 scripts/copy_prompts.py "$work/prompts.jsonl"
run() {
  local label=$1
  shift
  "$troupe" generate --prompts-file "$work/prompts.jsonl" --max-tokens 128 --temperature 0 \
    --json --stats "$work/$label.stats" "$@" >"$work/$label.out"
}
run plain
run fixed --spec ngram --spec-verify fixed --num-speculative-tokens 5
run confidence --spec ngram --spec-verify confidence --num-speculative-tokens 5
# Outside the batch-invariant mode a verify row's logits (a multi-token row) round
# differently from a one-token row's, so near-ties may flip greedy tokens; with it the
# outputs must be identical.
read -r head tail <<<"${BENCH_SPEC_DRAFT:-22 6}"
model=$("$troupe" generate --prompt x --max-tokens 1 --stats "$work/probe.stats" 2>/dev/null >/dev/null; \
  ls "${TROUPE_HOME:-$HOME/.cache/troupe}"/models/*.gguf | head -1)
python3 scripts/make_layer_draft.py "$model" "$work/draft.gguf" --head "$head" --tail "$tail"
run draft-fixed --spec draft --draft-model "$work/draft.gguf" --spec-verify fixed \
  --num-speculative-tokens 4
run draft-conf --spec draft --draft-model "$work/draft.gguf" --spec-verify confidence \
  --num-speculative-tokens 4
run plain-inv --batch-invariant
run confidence-inv --batch-invariant --spec ngram --spec-verify confidence --num-speculative-tokens 5
python3 - "$work" <<'PY'
import json, sys, os
work = sys.argv[1]
print(f"{'mode':<15} {'out tok/s':>9} {'steps':>6} {'verify tok/step':>15} {'accepted/row':>12} {'same output':>11}")
for label in ["plain", "fixed", "confidence", "draft-fixed", "draft-conf", "plain-inv", "confidence-inv"]:
    s = json.load(open(os.path.join(work, f"{label}.stats")))
    rows = s["spec_verify_rows"]
    ref = "plain-inv" if label.endswith("-inv") else "plain"
    ids = lambda l: [json.loads(x)["token_ids"] for x in open(os.path.join(work, f"{l}.out"))]
    same = ids(label) == ids(ref)
    print(f"{label:<15} {s['output_tokens'] / s['generate_s']:>9.1f} {s['steps']:>6} "
          f"{s['spec_verified_tokens'] / s['steps']:>15.2f} "
          f"{(s['spec_accepted_tokens'] / rows if rows else 0):>12.2f} {str(same):>11}")
PY
