#!/usr/bin/env python3
"""Tensor parallelism on two H200s, checked against transformers and timed against one GPU.

Correctness (random-weight bf16 HF models made here, as in gpu_check.py): two ranks
(`--tensor-parallel-size 2`, NCCL) against transformers in fp32 on the same weights —
first-token top-20 log-probabilities (relative error) and greedy tokens — and against one
rank. Throughput (Llama-3.1-8B shape, `--dummy-weights`): batch-1 decode and 64 requests at
once, one GPU against two, each against its roofline (weights read once per step, split
over the ranks; copy bandwidth measured in the same run).

Usage (device machine with 2 GPUs): python3 scripts/gpu_tp.py target/release/troupe
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_check import (OUT, WORK, first_logprob_err, make_model, matches, prompts,  # noqa: E402
                       reference, run_troupe, shapes)
from gpu_bench import copy_bandwidth  # noqa: E402


def check(binary, name, results):
    path = make_model(name)
    cls, cfg = shapes()[name]
    ps = prompts(4, 100, cfg.vocab_size, 1)
    lp = ["--top-logprobs", "20"]
    tp1, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp, f"tp-{name}-tp1.log")
    tp2, stats, _ = run_troupe(binary, path, "cuda", ps, 16, lp + ["--tp", "2"], f"tp-{name}-tp2.log")
    tp2_eager, _, _ = run_troupe(binary, path, "cuda", ps, 16, lp + ["--tp", "2", "--enforce-eager"],
                                 f"tp-{name}-tp2-eager.log")
    ref = cls.from_pretrained(path, dtype=torch.float32).cuda().eval()
    logp_rows, hf = reference(ref, ps, 16)
    del ref
    torch.cuda.empty_cache()
    results[name] = dict(
        tensor_parallel_size=stats["tensor_parallel_size"],
        logprob_rel_err_tp1=first_logprob_err(tp1, logp_rows),
        logprob_rel_err_tp2=first_logprob_err(tp2, logp_rows),
        greedy_tp2_vs_transformers=matches(tp2, hf),
        greedy_tp1_vs_transformers=matches(tp1, hf),
        greedy_tp2_vs_tp1=matches(tp2, tp1),
        greedy_tp2_graphs_vs_eager=matches(tp2, tp2_eager),
    )


def throughput(binary, results):
    path = os.path.join(WORK, "llama-3.1-8b-config")
    os.makedirs(path, exist_ok=True)
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False)
    cfg.save_pretrained(path)
    h, l, ff, v = 4096, 32, 14336, 128256
    weight_bytes = 2 * (l * (h * 4096 * 2 + 2 * h * 1024 + 3 * h * ff) + 2 * v * h)
    bw = copy_bandwidth()
    rows = []
    for batch in (1, 64):
        ps = prompts(batch, 512, v, 3)
        for tp in (1, 2):
            extra = ["--dummy-weights", "--kv-cache-mib", "8192", "--tp", str(tp)]
            _, stats, wall = run_troupe(binary, path, "cuda", ps, 256, extra, f"tp-8b-b{batch}-tp{tp}.log")
            # Each rank reads its share of the layers' weights; embeddings and head are whole.
            per_rank = 2 * (l * (h * 4096 * 2 + 2 * h * 1024 + 3 * h * ff) / tp + 2 * v * h)
            kv = 2 * l * 8 * 128 * 2 * (512 + 128) * batch / tp
            roofline = batch * bw / (per_rank + kv)
            rows.append(dict(batch=batch, tp=tp, decode_tok_s=stats["decode_tokens_per_s"], wall_s=wall,
                             roofline_tok_s=roofline, of_roofline=stats["decode_tokens_per_s"] / roofline))
    results["throughput"] = dict(model="llama-3.1-8b shape, dummy weights", weight_bytes=weight_bytes,
                                 copy_bandwidth_bytes_s=bw, rows=rows)


def main(binary):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    results = {"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for name, fn in (("qwen3-0.6b", lambda r: check(binary, "qwen3-0.6b", r)),
                     ("llama-3.2-1b", lambda r: check(binary, "llama-3.2-1b", r)),
                     ("throughput", lambda r: throughput(binary, r))):
        try:
            fn(results)
        except Exception as e:  # report and go on: device time is scarce
            results[name] = {"error": str(e)[-2000:]}
    with open(os.path.join(OUT, "gpu_tp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
