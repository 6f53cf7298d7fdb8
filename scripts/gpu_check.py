#!/usr/bin/env python3
"""The CUDA backend on a GPU, checked against transformers and timed beside it.

Runs on the device machine (torch + transformers, no network). Makes random-weight bf16
HF models with transformers (SmolLM2-135M and Qwen3-0.6B shapes for the checks, a
Llama-3.2-1B shape for the timings) so troupe and transformers read the same weights, then:

- CUDA vs transformers (fp32 compute on the same bf16 weights): first-token top-20
  log-probabilities (relative error) and greedy tokens;
- CUDA vs troupe's CPU backend: greedy tokens;
- ZOS on vs off on CUDA: identical tokens;
- CUDA graphs on vs off (`--enforce-eager`): bitwise identical in the batch-invariant mode;
- decode throughput at batch 1, 16, 64 against transformers' `generate` (bf16) and the
  memory-bandwidth floor (weights read once per step).

Usage (device machine): python3 scripts/gpu_check.py target/release/troupe
Writes logs and a JSON summary under $OUT; prints a table last.
"""

import json
import math
import os
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

OUT = os.environ.get("OUT", "/tmp/gpu_check_out")
WORK = "/tmp/gpu_check_models"
# Measured on an H200 of this workplace (device-to-device copy through PyTorch).
HBM_BYTES_PER_S = 4.3e12


def shapes():
    common = dict(initializer_range=0.05)
    return {
        "smollm2-135m": (LlamaForCausalLM, LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, **common)),
        "qwen3-0.6b": (Qwen3ForCausalLM, Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, **common)),
        "llama-3.2-1b": (LlamaForCausalLM, LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, **common)),
    }


def make_model(name):
    cls, cfg = shapes()[name]
    path = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = cls(cfg).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def run_troupe(binary, model, device, prompt_ids, max_tokens, extra=(), log_name=None):
    path = os.path.join(WORK, f"prompts-{len(prompt_ids)}-{len(prompt_ids[0])}.jsonl")
    with open(path, "w") as f:
        for p in prompt_ids:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    cmd = [binary, "generate", "--model", model, "--device", device, "--prompts-file", path,
           "--max-tokens", str(max_tokens), "--ignore-eos", "--temperature", "0", "--json",
           "--stats", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if log_name:
        with open(os.path.join(OUT, log_name), "w") as f:
            f.write(" ".join(cmd) + "\n" + r.stderr[-20000:])
    if r.returncode != 0:
        raise RuntimeError(f"troupe failed ({r.returncode}): {r.stderr[-2000:]}")
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    stats = json.loads([l for l in r.stderr.splitlines() if l.startswith("{")][-1])
    return lines, stats, wall


def reference(ref, ps, new_tokens):
    """transformers' first-token log-probabilities and greedy continuation of each prompt."""
    logp_rows, hf = [], []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p], device="cuda")
            logp_rows.append(torch.log_softmax(ref(ids).logits[0, -1].double(), -1).cpu())
            gen = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                               min_new_tokens=new_tokens, pad_token_id=0)
            hf.append({"token_ids": gen[0, len(p):].tolist()})
    return logp_rows, hf


def first_logprob_err(out, logp_rows):
    errs = []
    for o, logp in zip(out, logp_rows):
        top = o["top_logprobs"][0]
        got = torch.tensor([lp for _, lp in top], dtype=torch.float64)
        want = logp[torch.tensor([t for t, _ in top])]
        errs.append(float((got - want).norm() / want.norm()))
    return max(errs)


def matches(a, b):
    """Share of generated positions where two runs agree, and whether all do."""
    pairs = [(x, y) for oa, ob in zip(a, b) for x, y in zip(oa["token_ids"], ob["token_ids"])]
    return sum(x == y for x, y in pairs) / len(pairs)


def same_outputs(a, b):
    """Bitwise the same tokens and log-probabilities (the drawn seeds may differ)."""
    key = lambda o: (o["token_ids"], o.get("top_logprobs"))
    return [key(o) for o in a] == [key(o) for o in b]


def check_model(binary, name, results):
    path = make_model(name)
    cls, cfg = shapes()[name]
    ref = cls.from_pretrained(path, dtype=torch.float32).cuda().eval()
    # Over 64 tokens, so decode takes the split-K attention (64-key chunks).
    ps = prompts(4, 100, cfg.vocab_size, 1)
    lp = ["--top-logprobs", "20"]
    inv = ["--batch-invariant"]
    cuda, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp, f"{name}-cuda.log")
    cuda_nozos, _, _ = run_troupe(binary, path, "cuda", ps, 16, ["--no-zos"], f"{name}-nozos.log")
    inv_zos, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp + inv, f"{name}-inv.log")
    inv_nozos, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp + inv + ["--no-zos"], f"{name}-inv-nozos.log")
    # CUDA graphs (decode steps recorded and replayed, the default) against every step eager.
    eager, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp + ["--enforce-eager"], f"{name}-eager.log")
    inv_eager, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp + inv + ["--enforce-eager"], f"{name}-inv-eager.log")
    # The needle: prompt 0 alone, then among 15 others; bitwise the same logprobs.
    crowd = [ps[0]] + prompts(15, 40, cfg.vocab_size, 5)
    alone, _, _ = run_troupe(binary, path, "cuda", ps[:1], 16, lp + inv, f"{name}-alone.log")
    among, _, _ = run_troupe(binary, path, "cuda", crowd, 16, lp + inv, f"{name}-among.log")
    cpu, _, _ = run_troupe(binary, path, "cpu", ps, 16, [], f"{name}-cpu.log")
    logp_rows, hf = reference(ref, ps, 16)
    results[name] = dict(
        logprob_rel_err=first_logprob_err(cuda, logp_rows),
        logprob_rel_err_invariant=first_logprob_err(inv_zos, logp_rows),
        greedy_vs_transformers=matches(cuda, hf),
        greedy_vs_transformers_invariant=matches(inv_zos, hf),
        greedy_vs_cpu=matches(cuda, cpu),
        greedy_vs_cpu_invariant=matches(inv_zos, cpu),
        cpu_vs_transformers=matches(cpu, hf),
        zos_identical_default=all(a["token_ids"] == b["token_ids"] for a, b in zip(cuda, cuda_nozos)),
        zos_identical_invariant=same_outputs(inv_zos, inv_nozos),
        graphs_vs_eager_default=matches(cuda, eager),
        graphs_identical_invariant=same_outputs(inv_zos, inv_eager),
        needle_bitwise=same_outputs(alone[:1], among[:1]),
    )
    del ref
    torch.cuda.empty_cache()


def bench(binary, results):
    name = "llama-3.2-1b"
    path = make_model(name)
    cls, cfg = shapes()[name]
    model = cls.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in (1, 16, 64):
        ps = prompts(batch, 128, cfg.vocab_size, 7)
        new = 128
        # transformers: one generate call, all rows together.
        ids = torch.tensor(ps, device="cuda")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            hf_s = time.perf_counter() - t0
        hf_tok_s = batch * new / hf_s
        _, stats, wall = run_troupe(binary, path, "cuda", ps, new, [], f"bench-b{batch}.log")
        troupe_tok_s = stats["decode_tokens_per_s"]
        floor_tok_s = batch * HBM_BYTES_PER_S / weight_bytes
        rows.append(dict(batch=batch, mode="default", troupe_decode_tok_s=troupe_tok_s, troupe_wall_s=wall,
                         transformers_tok_s=hf_tok_s, roofline_tok_s=floor_tok_s,
                         vs_transformers=troupe_tok_s / hf_tok_s, of_roofline=troupe_tok_s / floor_tok_s))
        if batch == 16:
            _, stats, wall = run_troupe(binary, path, "cuda", ps, new, ["--batch-invariant"], "bench-b16-inv.log")
            t = stats["decode_tokens_per_s"]
            rows.append(dict(batch=batch, mode="invariant", troupe_decode_tok_s=t, troupe_wall_s=wall,
                             transformers_tok_s=hf_tok_s, roofline_tok_s=floor_tok_s,
                             vs_transformers=t / hf_tok_s, of_roofline=t / floor_tok_s))
    results["bench"] = dict(model=name, weight_bytes=weight_bytes, rows=rows)


def main(binary):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0)}
    for name in ("smollm2-135m", "qwen3-0.6b"):
        try:
            check_model(binary, name, results)
        except Exception as e:  # report and go on: device time is scarce
            results[name] = {"error": str(e)[-1500:]}
    try:
        if os.environ.get("GPU_CHECK_SKIP_BENCH"):
            results["bench"] = {"error": "skipped (GPU_CHECK_SKIP_BENCH)"}
        else:
            bench(binary, results)
    except Exception as e:
        results["bench"] = {"error": str(e)[-1500:]}
    with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    ok = True
    keys = ["logprob_rel_err", "logprob_rel_err_invariant", "greedy_vs_transformers",
            "greedy_vs_transformers_invariant", "greedy_vs_cpu", "greedy_vs_cpu_invariant",
            "cpu_vs_transformers", "zos_identical_default", "zos_identical_invariant",
            "graphs_vs_eager_default", "graphs_identical_invariant", "needle_bitwise"]
    print("\ncheck" + "".join(f"  {n:>14}" for n in ("smollm2-135m", "qwen3-0.6b")))
    for k in keys:
        cells = []
        for name in ("smollm2-135m", "qwen3-0.6b"):
            r = results[name]
            v = r.get(k, "ERROR")
            cells.append(f"{v:14.2e}" if isinstance(v, float) and "err" in k else f"{str(v) if not isinstance(v, float) else f'{v:.2f}':>14}")
        print(f"{k:34}" + "  ".join(cells))
    for name in ("smollm2-135m", "qwen3-0.6b"):
        r = results[name]
        if "error" in r:
            ok = False
            print(f"{name} ERROR {r['error'][-600:]}")
            continue
        ok = (ok and r["logprob_rel_err"] <= 2e-2 and r["zos_identical_invariant"] and r["needle_bitwise"]
              and r["graphs_identical_invariant"])
    b = results["bench"]
    if "error" in b:
        print("bench ERROR", b["error"][-300:])
    else:
        print(f"\ndecode, {b['model']} shape, 128-token prompts, 128 new tokens")
        print("batch  mode       troupe tok/s  transformers tok/s  ratio  roofline tok/s  of roofline")
        for r in b["rows"]:
            print(f"{r['batch']:5}  {r['mode']:9}  {r['troupe_decode_tok_s']:12.0f}  {r['transformers_tok_s']:18.0f}"
                  f"  {r['vs_transformers']:5.2f}  {r['roofline_tok_s']:14.0f}  {r['of_roofline']:11.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
