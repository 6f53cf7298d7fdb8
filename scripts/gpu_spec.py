#!/usr/bin/env python3
"""Speculative decoding on one H200: no speculation, fixed-K and confidence-scheduled
verification with the n-gram drafter, at two concurrencies.

Random bf16 weights (Qwen3-0.6B shape, made by transformers as in gpu_bench.py) cannot
predict text, so the prompts are copy-heavy (a random phrase repeated) and the model's own
greedy loops do the rest: prompt lookup then proposes what the model repeats. Reports
output tok/s over the generation, accept length (tokens per verify row), verify tokens
per step, the share of the generation the GPU sat idle between steps and the drafts
proposed / verified / accepted, from `--stats`.

With a model file (`python3 scripts/gpu_spec.py target/release/troupe MODEL.gguf`: real
weights, carried to the device machine in pieces, see `scripts/gpu-spec-real.sh`) the
prompts are bench_spec.sh's chat prompts asking to copy text and code, up to 128 new tokens
each, ending at the model's EOS as on the CPU.

Usage (device machine): python3 scripts/gpu_spec.py target/release/troupe [MODEL]
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
import copy_prompts  # noqa: E402
from gpu_bench import OUT, WORK, make, troupe  # noqa: E402


def requests(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randint(100, 150000) for _ in range(rng.randint(8, 16))]
        out.append(dict(prompt_ids=phrase * 8, max_tokens=256))
    return out


# GPU_SPEC_IGNORE_EOS=1: real weights run their 128 tokens past EOS too.
IGNORE_EOS = os.environ.get("GPU_SPEC_IGNORE_EOS") == "1"
# GPU_SPEC_CONCURRENCY=1,32: the concurrencies to run (default: the four); "1x32"
# runs 32 requests one at a time (`--max-num-seqs 1`): batch 1 over every prompt, where
# one request of a few dozen tokens says little.
CONCURRENCY = os.environ.get("GPU_SPEC_CONCURRENCY", "1,8,32,128").split(",")
# GPU_SPEC_TEMPERATURE=0.7: seeded sampled requests at that temperature, and the drafts
# also accepted by rejection sampling (`--spec-acceptance rejection`); "same_as_off" then
# holds for the coupled modes only.
TEMPERATURE = float(os.environ.get("GPU_SPEC_TEMPERATURE", "0"))
MODES = [("off", []),
         ("fixed", ["--spec", "ngram", "--spec-verify", "fixed"]),
         ("confidence", ["--spec", "ngram", "--spec-verify", "confidence"])]
if TEMPERATURE > 0:
    MODES += [(m + "-rej", f + ["--spec-acceptance", "rejection"]) for m, f in MODES[1:]]
# GPU_SPEC_DRAFT=DRAFT.gguf: a draft model too (`--spec draft`, fixed and confidence);
# GPU_SPEC_MODES=off,draft-fixed: only the listed modes.
if os.environ.get("GPU_SPEC_DRAFT"):
    draft = ["--spec", "draft", "--draft-model", os.environ["GPU_SPEC_DRAFT"]]
    MODES += [("draft-fixed", draft + ["--spec-verify", "fixed"]),
              ("draft-confidence", draft + ["--spec-verify", "confidence"])]
if os.environ.get("GPU_SPEC_MODES"):
    MODES = [m for m in MODES if m[0] in os.environ["GPU_SPEC_MODES"].split(",")]


def shape(c):
    """(requests, extra flags) for a GPU_SPEC_CONCURRENCY entry."""
    if "x" in c:
        seqs, n = c.split("x")
        return int(n), ["--max-num-seqs", seqs]
    return int(c), []


def chat_requests(n):
    """bench_spec.sh's 32 copy prompts, cycled to `n`."""
    prompts = copy_prompts.prompts()
    return [dict(prompt=prompts[i % len(prompts)], chat=True, max_tokens=128) for i in range(n)]


def main(binary, model=None):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    path = model or make("qwen3-0.6b")
    rows = []
    for c in CONCURRENCY:
        n, limit = shape(c)
        reqs = chat_requests(n) if model else requests(n, n)
        if TEMPERATURE > 0:
            for i, r in enumerate(reqs):
                r.update(temperature=TEMPERATURE, seed=1000 + i)
        for mode, extra in MODES:
            try:
                # Real weights stop at their own EOS, as bench_spec.sh's CPU runs do
                # (past it, a copy prompt's continuation is no longer a copy).
                outs, stats, wall = troupe(binary, path, reqs, extra + limit, f"spec-{c}-{mode}",
                                           ignore_eos=model is None or IGNORE_EOS)
            except Exception as e:  # report and go on: device time is scarce
                rows.append(dict(concurrency=c, mode=mode, error=str(e)[-1500:]))
                continue
            verify_rows = max(stats["spec_verify_rows"], 1)
            rows.append(dict(
                concurrency=c, mode=mode, output_tokens=stats["output_tokens"],
                out_tok_s=stats["output_tokens"] / stats["generate_s"], wall_s=wall, steps=stats["steps"],
                draft_tokens=stats["spec_draft_tokens"], verified_tokens=stats["spec_verified_tokens"],
                accepted_tokens=stats["spec_accepted_tokens"],
                sat_out=stats.get("spec_sat_out_rows", -1),
                accept_length=1 + stats["spec_accepted_tokens"] / verify_rows if mode != "off" else 1.0,
                verify_tokens_per_step=stats["spec_verified_tokens"] / max(stats["steps"], 1),
                gpu_idle=stats.get("device_idle_secs", 0.0) / max(stats["generate_s"], 1e-9),
                tokens=[o["token_ids"] for o in outs]))
    # Greedy: every mode must give the tokens speculation off gives (bf16 rounding of a
    # verify row's GEMM may flip near-ties; report the share that agrees).
    for r in rows:
        base = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["mode"] == "off"), None)
        if base and "tokens" in r and "tokens" in base:
            pairs = [(x, y) for a, b in zip(r["tokens"], base["tokens"]) for x, y in zip(a, b)]
            r["same_as_off"] = sum(x == y for x, y in pairs) / max(len(pairs), 1)
    for r in rows:
        r.pop("tokens", None)
    with open(os.path.join(OUT, "gpu_spec.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("conc mode        out_tok/s  steps  sat_out  accept_len  verify_tok/step  gpu_idle  drafts/verified/accepted  same_as_off")
    for r in rows:
        if "error" in r:
            print(r["concurrency"], r["mode"], "ERROR", r["error"][-300:])
            continue
        print(f'{r["concurrency"]:>4} {r["mode"]:10} {r["out_tok_s"]:10.0f} {r["steps"]:6} {r["sat_out"]:8} '
              f'{r["accept_length"]:11.2f} {r["verify_tokens_per_step"]:16.2f} {r["gpu_idle"]:9.2f}  '
              f'{r["draft_tokens"]}/{r["verified_tokens"]}/{r["accepted_tokens"]}'
              f'  {r.get("same_as_off", 1.0):.3f}')


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
