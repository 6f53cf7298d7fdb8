#!/usr/bin/env python3
"""`troupe serve` on one H200 against `troupe generate` on the same requests (issue 27).

Qwen3-0.6B shape (--dummy-weights from its config.json), 512-token prompts, 256 new tokens,
EOS ignored, greedy. For each server mode — limits `off` (no key, text logs at the default
`warn`) and `on` (an API key on every request, JSON logs at `RUST_LOG=troupe=debug`: a line
for each request's admission and finish, in its span, and the engine's per-step debug
lines) — `troupe bench-serve` sends NUM requests at once (saturation), then NUM Poisson
arrivals at 80 % of the saturation request rate (fresh prompts, so no prefix-cache hits).
The saturation prompts are written out (`--write-prompts`) and `troupe generate` runs the
very same requests offline; its `generate_s` (first submit to last finish, no load time)
is the offline throughput the server is held to (goal ≥ 0.95), TTFT p99 at 80 % load goal
≤ 50 ms, the limits' overhead goal ≤ 2 %.

Usage (device machine): python3 scripts/gpu_serve.py BINARY [NUM]
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from transformers import Qwen3Config

OUT = os.environ.get("OUT", "/tmp/gpu_serve_out")
WORK = "/tmp/gpu_serve_models"
KEY = "sk-bench-serve"


def config_dir():
    path = os.path.join(WORK, "qwen3-0.6b-config")
    os.makedirs(path, exist_ok=True)
    Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=True).save_pretrained(path)
    return path


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(port, proc, secs=300):
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"troupe serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("troupe serve not healthy in time")


def bench(binary, port, label, rate, num, seed, key, extra=()):
    path = os.path.join(OUT, f"bench-{label}.json")
    cmd = [binary, "bench-serve", "--url", f"http://127.0.0.1:{port}", "--rates", rate,
           "--num-prompts", str(num), "--input-len", "512", "--output-len", "256",
           "--seed", str(seed), "--json", path, *extra]
    env = dict(os.environ, **({"TROUPE_API_KEY": key} if key else {}))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    with open(os.path.join(OUT, f"bench-{label}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stdout + r.stderr[-20000:])
    if r.returncode != 0:
        raise RuntimeError(f"bench-serve {label}: {r.stderr[-2000:]}")
    print(r.stdout, flush=True)
    return json.load(open(path))[0]


def serve_mode(binary, model, mode, num, prompts):
    port = free_port()
    flags = ["--max-queued-requests", str(2 * num)]
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    if mode == "on":
        flags += ["--api-key", KEY, "--log-format", "json"]
        env["RUST_LOG"] = "troupe=debug"
    log = open(os.path.join(OUT, f"serve-{mode}.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--model", model, "--dummy-weights", "--device", "cuda",
                             "--port", str(port), *flags], stdout=log, stderr=log, env=env)
    try:
        wait_healthy(port, proc)
        key = KEY if mode == "on" else None
        sat = bench(binary, port, f"{mode}-inf", "inf", num, 0, key,
                    ["--write-prompts", prompts] if prompts else [])
        rate = 0.8 * sat["request_throughput"]
        load = bench(binary, port, f"{mode}-80", f"{rate:.2f}", num, 1, key)
        return dict(saturation=sat, load80=load, rate80=rate)
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed after 60 s"
        log.close()
        print(f"serve {mode}: exit {code} after SIGTERM", flush=True)


def offline(binary, model, prompts, num):
    cmd = [binary, "generate", "--model", model, "--dummy-weights", "--device", "cuda",
           "--prompts-file", prompts, "--ignore-eos", "--json", "--stats"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    with open(os.path.join(OUT, "offline.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stderr[-20000:])
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    outs = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    stats = json.loads([l for l in r.stderr.splitlines() if l.startswith("{")][-1])
    tokens = sum(len(o["token_ids"]) for o in outs)
    assert tokens == 256 * num, tokens
    return dict(out_tokens=tokens, generate_s=stats["generate_s"], out_tok_s=tokens / stats["generate_s"])


def main():
    binary, num = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    os.makedirs(OUT, exist_ok=True)
    model = config_dir()
    prompts = os.path.join(WORK, "saturation.jsonl")
    results = dict(num_requests=num)
    results["off"] = serve_mode(binary, model, "off", num, prompts)
    results["on"] = serve_mode(binary, model, "on", num, None)
    results["offline"] = offline(binary, model, prompts, num)
    with open(os.path.join(OUT, "gpu_serve.json"), "w") as f:
        json.dump(results, f, indent=1)
    off = results["offline"]["out_tok_s"]
    print(f"{'mode':<5} {'sat tok/s':>10} {'/offline':>9} {'80% rate':>9} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'fail':>5}")
    for mode in ("off", "on"):
        r = results[mode]
        s, l = r["saturation"], r["load80"]
        print(f"{mode:<5} {s['output_token_throughput']:>10.0f} {s['output_token_throughput'] / off:>9.3f} "
              f"{r['rate80']:>9.1f} {l['ttft_p50_ms']:>9.1f} {l['ttft_p99_ms']:>9.1f} {l['tpot_p50_ms']:>9.2f} "
              f"{s['failed'] + l['failed']:>5}")
    print(f"offline generate: {off:.0f} out tok/s ({results['offline']['generate_s']:.2f} s)")
    on_off = results["on"]["saturation"]["output_token_throughput"] / results["off"]["saturation"]["output_token_throughput"]
    print(f"limits on / off at saturation: {on_off:.3f}")


if __name__ == "__main__":
    main()
