#!/usr/bin/env python3
"""troupe against llama.cpp on the same GGUF, same threads, in one run.

Batch 1: a 256-token prompt, then 128 greedy decode tokens (EOS ignored). Also measures
this machine's memory bandwidth to put decode against its physical limit (every weight
byte is streamed once per decoded token).

Setup (once): llama.cpp through llama-cpp-python built from source, without AMX:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
    python3 -m pip install --no-binary llama-cpp-python llama-cpp-python
Run: cargo build --release && python3 scripts/bench_cpu.py [--threads 2] [--runs 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_TOKENS = 256
DECODE_TOKENS = 128


def model_path(troupe):
    # `troupe` fetches the default model on first use; ask it where by generating one token.
    subprocess.run([troupe, "generate", "--prompt-ids", "1", "--max-tokens", "1"], check=True, capture_output=True)
    home = os.environ.get("TROUPE_HOME") or os.path.join(os.path.expanduser("~/.cache"), "troupe")
    return os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def prompt_ids():
    # Ordinary token ids (no specials); the same ids go to both engines.
    return [(17 + 7919 * i) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def run_troupe(troupe, threads, max_tokens):
    ids = ",".join(map(str, prompt_ids()))
    start = time.perf_counter()
    out = subprocess.run(
        [troupe, "generate", "--prompt-ids", ids, "--max-tokens", str(max_tokens), "--ignore-eos",
         "--stats", "--threads", str(threads), "--json"],
        check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    return wall, json.loads(out.stderr.strip().splitlines()[-1])


def bench_troupe(troupe, threads):
    # Decode is timed from outside, as the difference of two whole runs (128 tokens vs 1),
    # so every per-step overhead of the actor pipeline is in it.
    wall_1, stats = run_troupe(troupe, threads, 1)
    wall_n, _ = run_troupe(troupe, threads, DECODE_TOKENS)
    return stats["prefill_tokens_per_s"], (DECODE_TOKENS - 1) / (wall_n - wall_1)


def bench_llama_cpp(llm):
    ids = prompt_ids()
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t_decode = 0.0
    for _ in range(DECODE_TOKENS - 1):
        s = time.perf_counter()
        llm.eval([tok])
        t_decode += time.perf_counter() - s
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return PROMPT_TOKENS / (t1 - t0), (DECODE_TOKENS - 1) / t_decode


def memory_bandwidth_gbs():
    # Read bandwidth of a sum over 1 GiB (single thread is what numpy gives; report it).
    a = np.ones(1 << 28, dtype=np.float32)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--troupe", default=os.path.join(ROOT, "target", "release", "troupe"))
    args = ap.parse_args()
    path = model_path(args.troupe)
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512,
                n_batch=512, logits_all=False, verbose=False)
    rows = {"troupe": [], "llama.cpp": []}
    for _ in range(args.runs):
        rows["troupe"].append(bench_troupe(args.troupe, args.threads))
        rows["llama.cpp"].append(bench_llama_cpp(llm))
    bw = memory_bandwidth_gbs()
    weight_bytes = os.path.getsize(path)
    roofline = bw * 1e9 / weight_bytes
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    print(f"model {os.path.basename(path)}, {args.threads} threads, prompt {PROMPT_TOKENS}, decode {DECODE_TOKENS}, "
          f"median of {args.runs}")
    print(f"memory read bandwidth (1 thread) {bw:.1f} GB/s -> decode roofline ~{roofline:.0f} tok/s "
          f"for {weight_bytes / 1e6:.0f} MB of weights")
    print(f"{'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs llama.cpp':>20} {'decode vs roofline':>19}")
    for k, (p, d) in med.items():
        print(f"{k:<10} {p:>14.1f} {d:>13.1f} {d / med['llama.cpp'][1]:>20.2f} {d / roofline:>19.2f}")


if __name__ == "__main__":
    sys.exit(main())
