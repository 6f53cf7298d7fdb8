#!/usr/bin/env python3
"""troupe against llama.cpp on the same GGUF, same threads, in one run.

Batch 1: a 256-token prompt, then 128 greedy decode tokens (EOS ignored). Also measures
this machine's memory bandwidth to put decode against its physical limit (every weight
byte is streamed once per decoded token), and each engine's peak RSS.

Setup (once): llama.cpp through llama-cpp-python built from source for this CPU, without
AMX:
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
    python3 -m pip install --no-binary llama-cpp-python llama-cpp-python
and, for an AVX2-only comparison on an AVX-512 machine, a second build into a folder:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
    -DGGML_AVX_VNNI=OFF" python3 -m pip install --no-deps --no-binary llama-cpp-python \
    --target DIR llama-cpp-python
Run: cargo build --release && python3 scripts/bench_cpu.py [--threads 2] [--runs 3]
     [--model GGUF] [--max-isa avx2 --llama-path DIR]
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


def default_model(troupe):
    # `troupe` fetches the default model on first use; ask it where by generating one token.
    subprocess.run([troupe, "generate", "--prompt-ids", "1", "--max-tokens", "1"], check=True, capture_output=True)
    home = os.environ.get("TROUPE_HOME") or os.path.join(os.path.expanduser("~/.cache"), "troupe")
    return os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def prompt_ids():
    # Ordinary token ids (no specials); the same ids go to both engines.
    return [(17 + 7919 * i) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def run_child(cmd, env=None):
    """Runs `cmd`; returns (wall seconds, stdout, stderr)."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = p.communicate()
    wall = time.perf_counter() - start
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {err[-2000:]}")
    return wall, out, err


def run_troupe(troupe, model, threads, max_tokens, env):
    ids = ",".join(map(str, prompt_ids()))
    cmd = ["/usr/bin/time", "-f", "maxrss_kb=%M", troupe, "generate", "--model", model, "--prompt-ids", ids,
           "--max-tokens", str(max_tokens), "--ignore-eos", "--stats", "--threads", str(threads), "--json"]
    wall, _, err = run_child(cmd, env)
    lines = err.strip().splitlines()
    rss_mb = int(next(l for l in lines if l.startswith("maxrss_kb=")).split("=")[1]) / 1024
    stats = json.loads(next(l for l in reversed(lines) if l.startswith("{")))
    return wall, stats, rss_mb


def bench_troupe(troupe, model, threads, env):
    # Decode is timed from outside, as the difference of two whole runs (128 tokens vs 1),
    # so every per-step overhead of the actor pipeline is in it.
    wall_1, stats, _ = run_troupe(troupe, model, threads, 1, env)
    wall_n, stats_n, rss_mb = run_troupe(troupe, model, threads, DECODE_TOKENS, env)
    return stats["prefill_tokens_per_s"], (DECODE_TOKENS - 1) / (wall_n - wall_1), rss_mb, stats_n


def llama_worker(model, threads, runs):
    """In a child process (so its RSS is its own): llama.cpp's prefill and decode rates."""
    import resource

    from llama_cpp import Llama
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                n_batch=512, logits_all=False, verbose=False)
    ids = prompt_ids()
    results = []
    for _ in range(runs):
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
        results.append((PROMPT_TOKENS / (t1 - t0), (DECODE_TOKENS - 1) / t_decode))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import llama_cpp
    print(json.dumps({"runs": results, "rss_mb": rss_mb, "version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode()}))


def memory_bandwidth_gbs():
    # Read bandwidth of a sum over 1 GiB (single thread is what numpy gives; report it).
    a = np.ones(1 << 28, dtype=np.float32)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--troupe", default=os.path.join(ROOT, "target", "release", "troupe"))
    ap.add_argument("--model", help="a GGUF file (default: troupe's default model)")
    ap.add_argument("--max-isa", help="cap troupe's vector path (TROUPE_MAX_CPU_ISA)")
    ap.add_argument("--llama-path", help="a folder holding another llama-cpp-python build")
    ap.add_argument("--exact-activations", action="store_true", help="troupe with f32 activations")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(args.model, args.threads, args.runs)
    model = args.model or default_model(args.troupe)
    env = dict(os.environ)
    if args.max_isa:
        env["TROUPE_MAX_CPU_ISA"] = args.max_isa
    troupe = args.troupe
    if args.exact_activations:
        wrapper = os.path.join(os.path.dirname(troupe), "troupe-exact.sh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec "{troupe}" "$@" --exact-activations\n')
        os.chmod(wrapper, 0o755)
        troupe = wrapper
    llama_env = dict(os.environ)
    if args.llama_path:
        llama_env["PYTHONPATH"] = args.llama_path + os.pathsep + llama_env.get("PYTHONPATH", "")
    rows = {"troupe": [], "llama.cpp": []}
    rss = {}
    info = {}
    for _ in range(args.runs):
        p, d, rss["troupe"], info["troupe"] = bench_troupe(troupe, model, args.threads, env)
        rows["troupe"].append((p, d))
        _, out, _ = run_child([sys.executable, __file__, "--llama-worker", "--model", model, "--threads",
                               str(args.threads), "--runs", "1"], llama_env)
        got = json.loads(out.strip().splitlines()[-1])
        rows["llama.cpp"].extend(got["runs"])
        rss["llama.cpp"], info["llama.cpp"] = got["rss_mb"], got
    bw = memory_bandwidth_gbs()
    weight_bytes = os.path.getsize(model)
    roofline = bw * 1e9 / weight_bytes
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    print(f"{cpu_name()}; troupe path {info['troupe']['cpu_path']}; llama.cpp {info['llama.cpp']['version']}: "
          f"{' '.join(f for f in info['llama.cpp']['system_info'].split(' | ') if '= 1' in f)}")
    print(f"model {os.path.basename(model)} ({weight_bytes / 1e6:.0f} MB), {args.threads} threads, "
          f"prompt {PROMPT_TOKENS}, decode {DECODE_TOKENS}, median of {args.runs}; troupe weights resident "
          f"{info['troupe']['resident_weight_bytes'] / 1e6:.0f} MB")
    print(f"memory read bandwidth (1 thread) {bw:.1f} GB/s -> decode roofline ~{roofline:.0f} tok/s")
    print(f"{'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill vs llama.cpp':>21} "
          f"{'decode vs llama.cpp':>20} {'decode vs roofline':>19} {'peak RSS MB':>12}")
    for k, (p, d) in med.items():
        print(f"{k:<10} {p:>14.1f} {d:>13.1f} {p / med['llama.cpp'][0]:>21.2f} {d / med['llama.cpp'][1]:>20.2f} "
              f"{d / roofline:>19.2f} {rss[k]:>12.0f}")


if __name__ == "__main__":
    sys.exit(main())
