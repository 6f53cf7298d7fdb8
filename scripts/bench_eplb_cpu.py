#!/usr/bin/env python3
"""DeepSeek-V4 expert parallelism on CPU ranks: one rank against an expert-parallel group
of two (each rank holding only its routed experts), without and with EPLB moving experts
between them, on the same seeded random weights (`--dummy-weights`) and a batch of random
prompts. Prints per mode the output tokens/s, the resident weight bytes of all ranks,
`moe_lb` of the routed loads and of the ranks' measured busy time at the end, the
rebalances and the expert replicas they moved.

Usage: python3 scripts/bench_eplb_cpu.py target/release/troupe [--requests 16] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

from dsv4_shape import SHAPE

GOLDEN_CONFIG = Path(__file__).parent.parent / "tests/goldens/tiny-dsv4-a/config.json"


def run(troupe: str, model: Path, prompts: Path, extra: list[str]) -> dict:
    cmd = [troupe, "generate", "--model", str(model), "--dummy-weights", "--prompts-file",
           str(prompts), "--ignore-eos", "--json", "--stats", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    stats = json.loads([l for l in res.stderr.splitlines() if l.startswith("{")][-1])
    tokens = sum(len(json.loads(l)["token_ids"]) for l in res.stdout.splitlines() if l.strip())
    return dict(stats=stats, tokens=tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("troupe")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        # A tiny checkpoint's config with the benchmark's shape: transformers' fields.
        model.mkdir()
        config = {**json.loads(GOLDEN_CONFIG.read_text()), **SHAPE}
        (model / "config.json").write_text(json.dumps(config))
        rng = random.Random(0)
        prompts = Path(tmp) / "prompts.jsonl"
        with open(prompts, "w") as f:
            for _ in range(args.requests):
                ids = [rng.randrange(2, SHAPE["vocab_size"]) for _ in range(args.prompt)]
                f.write(json.dumps({"prompt_ids": ids, "max_tokens": args.new}) + "\n")
        modes = [
            ("1 rank", ["--tp", "1"]),
            # EPLB measuring only (its first rebalance never comes): the equal shares' moe_lb.
            ("EP2, equal shares", ["--tp", "2", "--eplb-ranks", "2",
                                   "--eplb-period-steps", "1000000"]),
            ("EP2, EPLB (+2 redundant, every 16 steps)",
             ["--tp", "2", "--eplb-ranks", "2", "--eplb-redundant-experts", "2",
              "--eplb-period-steps", "16"]),
        ]
        rows = []
        for name, extra in modes:
            r = run(args.troupe, model, prompts, extra)
            s = r["stats"]
            rows.append((name, r["tokens"] / s["generate_s"], s.get("resident_weight_bytes", 0),
                         s.get("moe_lb", 0.0), s.get("moe_lb_measured", 0.0),
                         s.get("eplb_rebalances", 0),
                         s.get("eplb_moved_experts", 0)))
    print(f"{args.requests} requests x {args.prompt} prompt + {args.new} new tokens")
    print("| mode | out tok/s | resident weight MB | moe_lb (loads) | moe_lb (measured) "
          "| rebalances | experts moved |")
    print("|---|---|---|---|---|---|---|")
    for name, tps, bytes_, lb, measured, reb, moved in rows:
        print(f"| {name} | {tps:.1f} | {bytes_ / 1e6:.1f} | {lb:.3f} | {measured:.3f} | {reb} "
              f"| {moved} |")


if __name__ == "__main__":
    main()
