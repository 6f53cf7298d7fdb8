#!/usr/bin/env python3
"""Structured output on one H200 with real weights: JSON-schema requests drawn on the
device (the rank masks each row with the grammar's bits, the sampling kernel draws it)
against the same requests sent to the host's sampler (a zero logit bias: a processor that
changes nothing, so the rows' logits cross to the host as before device masks), and the
same prompts without a grammar. Seeded sampling at 0.7, up to 128 tokens, ending at EOS.

Usage (device machine, after scripts/gpu-spec-real.sh's pieces):
  python3 scripts/gpu_grammar.py BIN MODEL.gguf
GPU_GRAMMAR_CONCURRENCY=1x16,32,128 as gpu_spec.py's GPU_SPEC_CONCURRENCY;
GPU_GRAMMAR_MODES=none,device,host (default) picks the modes; "device-spec" and
"none-spec" add n-gram speculation (confidence-scheduled) to "device" and "none".
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import OUT, WORK, troupe  # noqa: E402
from gpu_spec import shape  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Hanoi", "Porto"]


def lines(n, mode):
    out = []
    for i in range(n):
        line = dict(prompt=f"Describe a person from {CITIES[i % len(CITIES)]} as JSON "
                           f"(name, age, city, hobbies). Person number {i}.",
                    chat=True, max_tokens=128, temperature=0.7, seed=100 + i)
        if not mode.startswith("none"):
            line["json_schema"] = SCHEMA
        if mode == "host":
            line["logit_bias"] = {"0": 0.0}
        out.append(line)
    return out


def main(binary, model):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    rows = []
    for c in os.environ.get("GPU_GRAMMAR_CONCURRENCY", "1x16,32,128").split(","):
        n, limit = shape(c)
        for mode in os.environ.get("GPU_GRAMMAR_MODES", "none,device,host").split(","):
            spec = ["--spec", "ngram"] if mode.endswith("-spec") else []
            try:
                outs, stats, _ = troupe(binary, model, lines(n, mode), limit + spec,
                                        f"grammar-{c}-{mode}", ignore_eos=False)
            except Exception as e:  # report and go on: device time is scarce
                rows.append(dict(concurrency=c, mode=mode, error=str(e)[-1500:]))
                continue
            valid, stopped = 0, sum(o["finish_reason"] == "stop" for o in outs)
            for o in outs:
                try:
                    valid += isinstance(json.loads(o["text"]), dict)
                except ValueError:
                    pass
            rows.append(dict(
                concurrency=c, mode=mode, out_tok_s=stats["output_tokens"] / stats["generate_s"],
                output_tokens=stats["output_tokens"], steps=stats["steps"],
                host_rows=stats.get("host_sampled_rows", -1),
                sat_out=stats.get("spec_sat_out_rows", -1),
                accepted=stats.get("spec_accepted_tokens", 0),
                gpu_idle=stats.get("device_idle_secs", 0.0) / max(stats["generate_s"], 1e-9),
                valid_json=f"{valid}/{stopped}/{len(outs)}"))
    with open(os.path.join(OUT, "gpu_grammar.json"), "w") as f:
        json.dump(rows, f, indent=1)
    # valid_json: outputs that parse as a JSON object / outputs that ended (not cut at
    # max_tokens) / all.
    print("conc mode        out_tok/s  tokens  steps  host_rows  sat_out  accepted  gpu_idle  valid/ended/all")
    for r in rows:
        if "error" in r:
            print(f'{r["concurrency"]:>4} {r["mode"]:<11} error: {r["error"][-300:]}')
            continue
        print(f'{r["concurrency"]:>4} {r["mode"]:<11} {r["out_tok_s"]:9.0f} {r["output_tokens"]:7d} '
              f'{r["steps"]:6d} {r["host_rows"]:10d} {r["sat_out"]:8d} {r["accepted"]:9d} '
              f'{r["gpu_idle"]:9.2f}  {r["valid_json"]}')


if __name__ == "__main__":
    main(*sys.argv[1:3])
