#!/usr/bin/env python3
"""The host part of DeepSeek-V4's routed experts on this CPU (issue 60): the V4-Flash
shape cut to a few layers (`--dummy-weights`, so MXFP4 experts packed as shipped), every
routed expert in host memory (`--cpu-moe`) on the CPU backend, batch-1 decode; the bytes
of experts its decode steps read over the time they took, against this machine's read
bandwidth measured in the same run (numpy summing a large array on every core).

Also a prefill of --prompt tokens: the host part's integer operations a second there.

Usage: python3 scripts/bench_dsv4_host_cpu.py target/release/troupe [--layers 2] [--new 16]
    [--prompt 512]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_dsv4 import shape  # noqa: E402


def read_bandwidth(gib: int = 4) -> float:
    """Bytes a second that one thread a core reads summing its share of a float64 array."""
    import numpy as np

    cores = os.cpu_count() or 1
    x = np.ones((gib << 30) // 8)
    parts = np.array_split(x, cores)
    best = 0.0
    with ThreadPoolExecutor(cores) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, x.nbytes / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("troupe")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args()
    bw = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "v4-flash"
        model.mkdir()
        s = shape(args.layers)
        (model / "config.json").write_text(json.dumps(dict(s, model_type="deepseek_v4",
                                                           architectures=["DeepseekV4ForCausalLM"])))
        cmd = [args.troupe, "generate", "--model", str(model), "--dummy-weights", "--cpu-moe",
               "--prompt-ids", ",".join(str(i + 2) for i in range(8)), "--max-tokens", str(args.new),
               "--ignore-eos", "--kv-cache-mib", "512", "--skip-warmup", "--stats", "-"]
        env = dict(os.environ, RUST_LOG="troupe=info")
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        prefill = [a for a in cmd if a not in ("--prompt-ids", cmd[cmd.index("--prompt-ids") + 1])]
        prefill = prefill[:prefill.index("--max-tokens") + 1] + ["1"] + prefill[prefill.index("--max-tokens") + 2:]
        prefill += ["--prompt-ids", ",".join(str(i + 2) for i in range(args.prompt)),
                    "--max-num-batched-tokens", str(args.prompt)]
        res_p = subprocess.run(prefill, capture_output=True, text=True, env=env)
    found = re.findall(r"host experts \(prefill steps\): ([\d.]+) s computing, ([\d.]+) GB of experts read, "
                       r"[\d.]+ GB/s, (\d+) products", res_p.stderr)
    pre = (float(found[-1][0]), float(found[-1][1]) * 1e9) if found else None
    # Each (token, expert) product: gate, up and down, a multiply and an add a weight.
    ops = 2 * 3 * s["hidden_size"] * s["moe_intermediate_size"] * int(found[-1][2]) if found else 0
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    host = re.findall(r"host experts \(decode steps\): ([\d.]+) s computing, ([\d.]+) GB of experts read",
                      res.stderr)
    stats = json.loads([l for l in res.stderr.splitlines() if l.startswith("{")][-1])
    secs, gb = float(host[-1][0]), float(host[-1][1])
    host_bw = gb * 1e9 / secs
    print(f"V4-Flash shape, {args.layers} layers, --cpu-moe on the CPU, batch-1 decode of {args.new} tokens "
          f"({wall:.0f} s with loading); {stats.get('resident_host_weight_bytes', 0) / 2**30:.2f} GiB of "
          f"host experts ({stats.get('weight_card')})")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| read bandwidth (numpy, {os.cpu_count()} threads) | {bw / 1e9:.1f} GB/s |")
    print(f"| host experts' decode steps | {gb:.2f} GB in {secs:.2f} s = {host_bw / 1e9:.1f} GB/s |")
    print(f"| host part / read bandwidth | {host_bw / bw:.2f} |")
    print(f"| decode (whole step, f32 attention on the CPU) | {stats['decode_tokens_per_s']:.2f} tok/s |")
    if pre:
        print(f"| host experts' prefill steps ({args.prompt} tokens) | {pre[0]:.2f} s, {ops / pre[0] / 1e9:.0f} "
              f"GOPS (8-bit), {pre[1] / pre[0] / 1e9:.1f} GB/s of experts |")


if __name__ == "__main__":
    main()
