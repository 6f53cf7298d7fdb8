#!/usr/bin/env python3
"""The whole DeepSeek-V4-Flash (43 layers, `--dummy-weights`) on one GPU with the routed
experts that do not fit in host memory (issue 60), against the same shape cut to the
layers that fit the GPU whole, in one run; the host's read bandwidth measured in the same
run (torch summing a large host tensor on every core), the limit the host part is held to.

Usage (on the device machine): python3 scripts/gpu_dsv4_host.py gpu-bin/troupe \
    [--layers 43] [--gpu-layers 16] [--prompt 4096] [--decode-prompt 512] [--new 32] \
    [--batch 32] [--extra-flags '--cpu-moe'] [--skip-decode] [--skip-batch] [--skip-prefill] \
    [--compare-never] [--compare-host-calls] [--compare-host-moe]
    [--compare-mxfp4-kernel] [--out DIR]
Prints a table last; writes gpu_dsv4_host.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

from gpu_dsv4 import bytes_per_token, command, shape

# One troupe process's bound: a slow run is reported, not waited on past the call's limit.
RUN_TIMEOUT_S = int(os.environ.get("RUN_TIMEOUT_S", "240"))


def host_read_bandwidth() -> float:
    """Bytes a second torch's CPU sum reads from a 8 GiB host tensor on every core."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    x = torch.ones(1 << 31, dtype=torch.float32)
    x.sum()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best


def run(binary: str, model: Path, prompts: list[list[int]], new: int, tmp: Path, kv_mib: int,
        extra: list[str], env_more: dict | None = None) -> dict:
    stats = tmp / "stats.json"
    cmd = command(binary, model, prompts, new, tmp, kv_mib, extra)
    stats.unlink(missing_ok=True)
    env = dict(os.environ, RUST_LOG="troupe=info", **(env_more or {}))
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"TIMEOUT after {RUN_TIMEOUT_S} s: {' '.join(extra)} {len(prompts)} prompt(s): {err[-4000:]}",
              flush=True)
        return {"prefill_tokens_per_s": float("nan"), "decode_tokens_per_s": float("nan"),
                "placement": "timed out"}
    wall = time.perf_counter() - t0
    if res.returncode != 0 or not stats.exists():
        raise SystemExit(f"troupe failed ({res.returncode}): {' '.join(extra)} {len(prompts)} prompt(s): "
                         f"{res.stderr[-3000:]}")
    s = json.loads(stats.read_text())
    s["wall_s"] = wall
    placement = re.findall(r"routed experts: [^\n]*", res.stderr)
    s["placement"] = placement[-1] if placement else "all on the GPU"
    host = re.findall(r"host experts \(decode steps\): ([\d.]+) s computing, ([\d.]+) GB of experts read",
                      res.stderr)
    if host:
        s["host_secs"], s["host_gb"] = float(host[-1][0]), float(host[-1][1])
    for key, pattern in [("load_line", r"host experts: \d+ matrices pinned[^\n]*"),
                         ("streamed_line", r"host experts streamed to the device[^\n]*"),
                         ("prefill_host_line", r"host experts \(prefill steps\)[^\n]*")]:
        found = re.findall(pattern, res.stderr)
        if found:
            s[key] = found[-1]
            print(f"  {found[-1]}", flush=True)
    # TROUPE_LAYER_TIMES=1: one line an eager step; the prompt's own steps come last.
    timed = re.findall(r"layer times, [^\n]*", res.stderr)
    if timed:
        s["layer_times"] = timed
        for line in timed[-3:]:
            print(f"  {line}", flush=True)
    print(f"{' '.join(extra) or 'default'} {len(prompts)}x: prefill {s['prefill_tokens_per_s']:.1f} tok/s, "
          f"decode {s['decode_tokens_per_s']:.2f} tok/s, wall {wall:.0f} s; {s['placement']}; "
          f"host {s.get('host_secs')} s / {s.get('host_gb')} GB", flush=True)
    return s


# The whole model's decode runs compared against the default, by their key's last word.
VARIANT_ENV = {"eager": {"TROUPE_HOST_CALLS": "0"}, "flat": {"TROUPE_HOST_MOE": "flat"},
               "shared": {"TROUPE_MXFP4_KERNEL": "shared"}, "wide": {"TROUPE_MXFP4_KERNEL": "wide"},
               "timed": {"TROUPE_LAYER_TIMES": "1"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("troupe")
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="the all-GPU baseline's depth (default: 36 on a GPU of 100 GiB or more, else 16)")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv-mib", type=int, default=4096)
    ap.add_argument("--extra-flags", default="", help="flags for the whole model's runs")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-batch", action="store_true", help="no batch decode runs")
    ap.add_argument("--skip-decode", action="store_true", help="no batch-1 decode runs")
    ap.add_argument("--compare-never", action="store_true",
                    help="also the whole model's prefill with --stream-experts never (the CPU computes every host expert)")
    ap.add_argument("--compare-host-calls", action="store_true",
                    help="also the whole model's decode runs with TROUPE_HOST_CALLS=0 (decode steps "
                         "with host experts eager, against the default: recorded as CUDA graphs, "
                         "the host part as calls on the stream)")
    ap.add_argument("--compare-host-moe", action="store_true",
                    help="also the whole model's decode runs with TROUPE_HOST_MOE=flat (every active "
                         "host expert's rows in two flat sweeps, against the default: each expert's "
                         "products a task of its own)")
    ap.add_argument("--compare-mxfp4-kernel", action="store_true",
                    help="also the whole model's decode runs with TROUPE_MXFP4_KERNEL=shared (host "
                         "experts through the kernel every packed format shares, against the "
                         "default: MXFP4's own decode kernel; the same bits)")
    ap.add_argument("--compare-mxfp4-wide", action="store_true",
                    help="also the whole model's decode runs with TROUPE_MXFP4_KERNEL=wide (two MXFP4 "
                         "blocks a 512-bit step and two weight rows at once where AVX-512 VBMI is "
                         "present, against the default: one block a step; the same bits)")
    ap.add_argument("--layer-times", action="store_true",
                    help="also the whole model's prefill with TROUPE_LAYER_TIMES=1 (each block waited "
                         "on and timed; a streamed layer's copies apart)")
    ap.add_argument("--skip-gpu", action="store_true",
                    help="no all-GPU baseline runs (the whole model's alone, no scaled ratios)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.gpu_layers == 0:
        import torch
        args.gpu_layers = 36 if torch.cuda.get_device_properties(0).total_memory > 100 << 30 else 16
    rng = random.Random(0)
    whole, cut = shape(args.layers), shape(args.gpu_layers)
    ids = lambda n: [rng.randrange(2, whole["vocab_size"]) for _ in range(n)]
    prompt = ids(args.prompt)
    decode_prompt = ids(args.decode_prompt)
    batch = [ids(args.decode_prompt) for _ in range(args.batch)]
    hbw = host_read_bandwidth()
    print(f"host read bandwidth {hbw / 1e9:.1f} GB/s", flush=True)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        configs = {"whole": (whole, args.extra_flags.split()), "gpu": (cut, [])}
        if args.skip_gpu:
            del configs["gpu"]
        for name, (s, _) in configs.items():
            (tmp / name).mkdir()
            (tmp / name / "config.json").write_text(json.dumps(dict(s, model_type="deepseek_v4",
                                                                    architectures=["DeepseekV4ForCausalLM"])))
        # The figures that matter most first: a slow run is cut (RUN_TIMEOUT_S), not waited on.
        plan = [] if args.skip_decode else [(n, "b1", [decode_prompt], args.new, []) for n in configs]
        if not args.skip_batch:
            plan += [(n, f"b{args.batch}", batch, args.new, []) for n in configs]
        compared = [v for v, on in (("eager", args.compare_host_calls), ("flat", args.compare_host_moe),
                                    ("shared", args.compare_mxfp4_kernel),
                                    ("wide", args.compare_mxfp4_wide)) if on]
        for variant in compared:
            if not args.skip_decode:
                plan.append(("whole", f"b1 {variant}", [decode_prompt], args.new, []))
            if not args.skip_batch:
                plan.append(("whole", f"b{args.batch} {variant}", batch, args.new, []))
        if compared:
            # Each default run beside its variants, so a cut call still pairs them.
            plan.sort(key=lambda p: (p[1].split()[0] != "b1", p[0] != "whole"))
        if not args.skip_prefill:
            plan += [(n, "prefill", [prompt], 1, []) for n in configs]
            if args.compare_never:
                plan.append(("whole", "prefill never", [prompt], 1, ["--stream-experts", "never"]))
            if args.layer_times:
                plan.append(("whole", "prefill timed", [prompt], 1, []))
        for name, key, prompts, new, more in plan:
            extra = configs[name][1] + more
            env_more = VARIANT_ENV.get(key.split()[-1])
            rows[f"{name} {key}"] = run(args.troupe, tmp / name, prompts, new, tmp, args.kv_mib, extra,
                                        env_more)
    layer_bytes, head_bytes = bytes_per_token(whole)
    Path(args.out, "gpu_dsv4_host.json").write_text(json.dumps(
        dict(host_read_bandwidth=hbw, layers=args.layers, gpu_layers=args.gpu_layers, rows=rows), indent=1))
    L, G = args.layers, args.gpu_layers
    print(f"V4-Flash shape, dummy weights; host read {hbw / 1e9:.1f} GB/s; "
          f"{layer_bytes / 1e6:.0f} MB a layer at batch 1")
    first = next((v for k, v in rows.items() if k.startswith("whole")), {})
    print(f"whole model: {first.get('placement')}")
    print("| run | whole (43 layers) tok/s | all-GPU (G layers) tok/s | all-GPU scaled to 43 | whole / scaled |"
          .replace("G layers", f"{G} layers"))
    print("|---|---:|---:|---:|---:|")
    keys = [] if args.skip_decode else [("decode batch 1", "b1", "decode_tokens_per_s")]
    if not args.skip_batch:
        keys.append((f"decode batch {args.batch}", f"b{args.batch}", "decode_tokens_per_s"))
    if not args.skip_prefill:
        keys.append((f"prefill {args.prompt}", "prefill", "prefill_tokens_per_s"))
    for label, k, f in keys if not args.skip_gpu else []:
        w, g = rows[f"whole {k}"][f], rows[f"gpu {k}"][f]
        scaled = g * G / L
        print(f"| {label} | {w:.2f} | {g:.2f} | {scaled:.2f} | {w / scaled:.2f} |")
    if "whole prefill never" in rows:
        never = rows["whole prefill never"]["prefill_tokens_per_s"]
        auto = rows["whole prefill"]["prefill_tokens_per_s"]
        print(f"prefill {args.prompt}, whole model: streamed (auto) {auto:.2f} tok/s vs CPU-computed (never) "
              f"{never:.2f} tok/s = {auto / never:.2f}x")
    variants = {"eager": ("recorded steps with host calls", "eager (TROUPE_HOST_CALLS=0)"),
                "flat": ("host products one task an expert", "flat sweeps (TROUPE_HOST_MOE=flat)"),
                "shared": ("MXFP4's own kernel", "the shared kernel (TROUPE_MXFP4_KERNEL=shared)"),
                "wide": ("MXFP4's one-block kernel", "the wide kernel (TROUPE_MXFP4_KERNEL=wide)")}
    for variant, (default_label, label) in variants.items():
        for k in ("b1", f"b{args.batch}"):
            if f"whole {k} {variant}" in rows:
                base = rows[f"whole {k}"]["decode_tokens_per_s"]
                other = rows[f"whole {k} {variant}"]["decode_tokens_per_s"]
                print(f"decode {k}, whole model: {default_label} (the default) {base:.2f} tok/s "
                      f"vs {label} {other:.2f} tok/s = {base / other:.2f}x")
    for k in [f"{b} {v}".strip() for v in ("", *VARIANT_ENV) for b in ("b1", f"b{args.batch}")]:
        st = rows.get(f"whole {k}", {})
        if st.get("host_secs"):
            bw = st["host_gb"] * 1e9 / st["host_secs"]
            print(f"host part of decode steps, whole {k}: {st['host_gb']:.1f} GB of experts in {st['host_secs']:.2f} s = "
                  f"{bw / 1e9:.1f} GB/s = {bw / hbw:.2f} of the host read bandwidth")


if __name__ == "__main__":
    main()
