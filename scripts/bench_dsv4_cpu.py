#!/usr/bin/env python3
"""DeepSeek-V4 on the CPU: troupe's host reference pass against transformers'
`DeepseekV4ForCausalLM` (f32, eager, its own cache layers) on the same random checkpoint,
side by side in one run: prefill tokens/s, decode tokens/s, greedy agreement.

Usage: python3 scripts/bench_dsv4_cpu.py target/release/troupe [--prompt 512] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_shape import SHAPE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("troupe")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    cfg = DeepseekV4Config(**SHAPE)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(
                    torch.stack([torch.randperm(cfg.n_routed_experts)[:2] for _ in range(cfg.vocab_size)])
                )
    prompt = torch.randint(2, cfg.vocab_size, (args.prompt,)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "dsv4"
        model.save_pretrained(d)
        model = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

        ids = torch.tensor([prompt])
        with torch.no_grad():
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            hf_prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            hf_total_s = time.perf_counter() - t0
        hf_tokens = out[0, args.prompt:].tolist()
        hf_decode_s = hf_total_s - hf_prefill_s

        stats = Path(tmp) / "stats.json"
        cmd = [args.troupe, "generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", str(args.new), "--ignore-eos", "--json", "--stats", str(stats),
               "--threads", str(threads)]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        troupe_wall_s = time.perf_counter() - t0
        troupe_tokens = json.loads(res.stdout.splitlines()[0])["token_ids"]
        s = json.loads(stats.read_text())

    same = sum(a == b for a, b in zip(hf_tokens, troupe_tokens))
    first_diff = next((i for i, (a, b) in enumerate(zip(hf_tokens, troupe_tokens)) if a != b), None)
    print(f"shape: {json.dumps({k: v for k, v in SHAPE.items() if not k.endswith('types')})}")
    print(f"threads {threads}, prompt {args.prompt}, new tokens {args.new}")
    print("| engine | prefill tok/s | decode tok/s | wall s |")
    print("|---|---:|---:|---:|")
    print(f"| troupe | {s['prefill_tokens_per_s']:.0f} | {s['decode_tokens_per_s']:.1f} | {troupe_wall_s:.2f} |")
    print(f"| transformers | {args.prompt / hf_prefill_s:.0f} | {(args.new - 1) / hf_decode_s:.1f} | {hf_prefill_s + hf_total_s:.2f} |")
    print(f"greedy tokens equal: {same}/{args.new} (first difference at {first_diff})")


if __name__ == "__main__":
    main()
