#!/usr/bin/env python3
"""Two troupe builds side by side on one GPU, in one call: batch-1 decode of the
Llama-3.1-8B shape, the offline workload (Qwen3-0.6B shape, 256 requests) and DeepSeek-V4
(V4-Flash shape at 9 layers, batch 1 and 32), all `--dummy-weights`, each run alternating
A, B, A, B... `--rounds` times; the median of each and B / A. For a change that is meant to
change nothing (a restructuring), every ratio should sit within noise of 1.

Usage (on the device machine): python3 scripts/gpu_ab.py A_BINARY B_BINARY [--rounds 3]
    [--parts decode,offline,dsv4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import gpu_bench
from gpu_dsv4 import command, shape


def llama_decode(binary: str) -> float:
    path, _ = gpu_bench.llama_8b_config()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 128000) for _ in range(512)]
    _, stats, _ = gpu_bench.troupe(binary, path, [{"prompt_ids": prompt, "max_tokens": 256}],
                                   ["--kv-cache-mib", "4096", "--dummy-weights"], "ab-decode")
    return stats["decode_tokens_per_s"]


def offline(binary: str) -> float:
    path = os.path.join(gpu_bench.WORK, "qwen3-0.6b-config")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        gpu_bench.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, tie_word_embeddings=True).save_pretrained(path)
    reqs = gpu_bench.offline_requests()
    total = sum(r["max_tokens"] for r in reqs)
    _, stats, _ = gpu_bench.troupe(binary, path, reqs, ["--dummy-weights"], "ab-offline")
    return total / stats["generate_s"]


def dsv4(binary: str, batch: int) -> float:
    rng = random.Random(0)
    s = shape(9)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "m").mkdir()
        (tmp / "m" / "config.json").write_text(json.dumps(dict(
            s, model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])))
        prompts = [[rng.randrange(2, s["vocab_size"]) for _ in range(512)] for _ in range(batch)]
        cmd = command(binary, tmp / "m", prompts, 64, tmp, 4096)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        return json.loads((tmp / "stats.json").read_text())["decode_tokens_per_s"]


PARTS = {
    "decode": ("Llama-3.1-8B batch-1 decode tok/s", llama_decode),
    "offline": ("offline 256 requests, Qwen3-0.6B, out tok/s", offline),
    "dsv4": ("DeepSeek-V4 9 layers batch-1 decode tok/s", lambda b: dsv4(b, 1)),
    "dsv4_b32": ("DeepSeek-V4 9 layers batch-32 decode tok/s", lambda b: dsv4(b, 32)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="decode,offline,dsv4,dsv4_b32")
    args = ap.parse_args()
    os.makedirs(gpu_bench.WORK, exist_ok=True)
    os.makedirs(gpu_bench.OUT, exist_ok=True)
    table = []
    for part in args.parts.split(","):
        label, run = PARTS[part]
        got: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(args.rounds):
            for side in ("a", "b"):
                t0 = time.perf_counter()
                got[side].append(run(getattr(args, side)))
                print(f"{part} {side}: {got[side][-1]:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        a, b = statistics.median(got["a"]), statistics.median(got["b"])
        table.append((label, a, b, got))
    print("| measure | A (median) | B (median) | B / A | A runs | B runs |")
    print("|---|---:|---:|---:|---|---|")
    for label, a, b, got in table:
        runs = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
        print(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.3f} | {runs(got['a'])} | {runs(got['b'])} |")


if __name__ == "__main__":
    main()
