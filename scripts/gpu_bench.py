#!/usr/bin/env python3
"""The CUDA backend's benchmarks, side by side with transformers on one H200.

Part `decode`: batch-1 decode, Llama-3.1-8B shape, 512-token prompt, 256 new tokens; tok/s
against transformers' `generate` and against the roofline = (weight bytes + KV bytes read
per step) / device-to-device copy bandwidth measured in the same run.
Part `offline`: the nano-vllm workload, Qwen3-0.6B shape, 256 requests, prompt ids of length
U[100, 1024], output length U[100, 1024], ignore_eos, seed 0: output tok/s; transformers'
continuous batching (`generate_batch`) as the peer; and the rank worker's idle share
between steps at batch 256 with ZOS on and off (host clock: time the worker waited for its
next step over the run).

Part `quant`: batch-1 decode, Llama-3.1-8B shape with dummy weights, bf16 against
`--quantization fp8` and a random Q4_K GGUF of the same shape (with the `gguf` package, carried
in gpu-bin/pylib), each against its roofline (the highest read bandwidth of the run).
GPU_BENCH_KV=bf16,fp8 runs `offline` once per KV cache dtype.
Part `quant_offline`: the offline workload with dummy weights, bf16 against FP8.
Part `peer`: the offline workload's first 64 requests through transformers' `generate_batch`.
Part `invariant`: `--batch-invariant` against the default mode, batch 1/16/64 decode, dummy
weights, Qwen3-0.6B and Llama-3.1-8B shapes.

Usage (device machine): python3 scripts/gpu_bench.py target/release/troupe decode|offline|peer|dummy
GPU_BENCH_ZOS_ONLY=1 skips the offline run with ZOS off; GPU_BENCH_OFFLINE_ARGS adds troupe
flags to the offline runs (e.g. "--max-num-batched-tokens 2048").
Random bf16 weights made here by transformers; both engines read the same files.
"""

import json
import shutil
import os
import random
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

OUT = os.environ.get("OUT", "/tmp/gpu_bench_out")
WORK = "/tmp/gpu_bench_models"


def make(name):
    path = os.path.join(WORK, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if name == "llama-3.1-8b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                          tie_word_embeddings=False, initializer_range=0.02)
        cls = LlamaForCausalLM
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=True, initializer_range=0.02)
        cls = Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1000 / 10
    del x, y
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / secs  # bytes read + written


def troupe(binary, model, lines, extra, log, ignore_eos=True):
    path = os.path.join(WORK, f"{log}.jsonl")
    with open(path, "w") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    cmd = [binary, "generate", "--model", model, "--device", "cuda", "--prompts-file", path,
           *(["--ignore-eos"] if ignore_eos else []), "--temperature", "0", "--json", "--stats", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(OUT, f"{log}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stderr[-20000:])
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    outs = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    stats = json.loads([l for l in r.stderr.splitlines() if l.startswith("{")][-1])
    return outs, stats, wall


def decode(binary, results):
    path = make("llama-3.1-8b")
    bw = copy_bandwidth()
    prompt = torch.randint(100, 128000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    new = 256
    outs, stats, wall = troupe(binary, path, [{"prompt_ids": prompt, "max_tokens": new}],
                               ["--kv-cache-mib", "4096"], "decode-8b")
    troupe_tok_s = stats["decode_tokens_per_s"]
    # The same without CUDA graphs: what recording the decode step buys.
    _, eager_stats, _ = troupe(binary, path, [{"prompt_ids": prompt, "max_tokens": new}],
                               ["--kv-cache-mib", "4096", "--enforce-eager"], "decode-8b-eager")
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        hf_tok_s = new / (time.perf_counter() - t0)
    cfg = model.config
    # Mean KV bytes read per step, K and V in bf16 (as troupe keeps them on the GPU).
    mean_ctx = 512 + new / 2
    kv_bf16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 128 * 2 * mean_ctx
    roofline = bw / (weight_bytes + kv_bf16)
    results["decode"] = dict(copy_bandwidth_bytes_s=bw, weight_bytes=weight_bytes, kv_bytes_per_step=kv_bf16,
                             roofline_tok_s=roofline, troupe_tok_s=troupe_tok_s, troupe_wall_s=wall,
                             troupe_eager_tok_s=eager_stats["decode_tokens_per_s"],
                             transformers_tok_s=hf_tok_s, troupe_of_roofline=troupe_tok_s / roofline,
                             transformers_of_roofline=hf_tok_s / roofline)


def dummy(binary, results):
    """Batch-1 decode of the Llama-3.1-8B shape from its config.json alone (--dummy-weights:
    random weights made on the GPU, no checkpoint written or read)."""
    path, _ = llama_8b_config()
    prompt = torch.randint(100, 128000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    outs, stats, wall = troupe(binary, path, [{"prompt_ids": prompt, "max_tokens": 256}],
                               ["--kv-cache-mib", "4096", "--dummy-weights"], "dummy-8b")
    results["dummy"] = dict(tokens=len(outs[0]["token_ids"]), decode_tok_s=stats["decode_tokens_per_s"],
                            wall_s=wall)


def read_bandwidth():
    """Bytes/s of a read-only pass (a sum over 4 GiB), the other half of the roofline."""
    x = torch.ones(1 << 30, dtype=torch.int32, device="cuda")
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        x.sum()
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1000 / 10
    del x
    torch.cuda.empty_cache()
    return 4 * (1 << 30) / secs


def llama_8b_config():
    """The Llama-3.1-8B shape's config in a folder of its own (for --dummy-weights)."""
    path = os.path.join(WORK, "llama-3.1-8b-config")
    os.makedirs(path, exist_ok=True)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False)
    cfg.save_pretrained(path)
    return path, cfg


def quant(binary, results):
    """Batch-1 decode of the Llama-3.1-8B shape (--dummy-weights), bf16 weights against
    `--quantization fp8`: tok/s and each against its roofline = bytes read per step (the
    weights but the embedding table, plus the KV) / the highest read bandwidth of this run
    (a read-only pass, a copy, or what troupe's own decode streamed)."""
    path, cfg = llama_8b_config()
    prompt = torch.randint(100, 128000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    new = 256
    kv = 2 * 32 * 8 * 128 * 2 * (512 + new / 2)
    embed = 128256 * 4096 * 2
    bws = {"read": read_bandwidth(), "copy": copy_bandwidth()}
    rows = {}
    runs = [("bf16", path, ["--dummy-weights"]), ("fp8", path, ["--dummy-weights", "--quantization", "fp8"])]
    gguf_path = random_kquant_gguf(cfg)
    if gguf_path:
        runs.append(("q4_k gguf", gguf_path, []))
    for label, model, extra in runs:
        _, stats, wall = troupe(binary, model, [{"prompt_ids": prompt, "max_tokens": new}],
                                ["--kv-cache-mib", "4096", *extra], f"quant-{label.replace(' ', '-')}")
        # The embedding table: one row read a step (a Q4_K table: 144 bytes a 256 weights).
        table = embed if label != "q4_k gguf" else 128256 * 4096 // 256 * 144
        step_bytes = stats["resident_weight_bytes"] - table + kv
        tok_s = stats["decode_tokens_per_s"]
        rows[label] = dict(decode_tok_s=tok_s, step_bytes=step_bytes, streamed_bytes_s=tok_s * step_bytes,
                           weight_card=stats.get("weight_card"), wall_s=wall)
        bws[f"troupe_{label}"] = tok_s * step_bytes
    limit = max(bws.values())
    for r in rows.values():
        r["roofline_tok_s"] = limit / r["step_bytes"]
        r["of_roofline"] = r["decode_tok_s"] / r["roofline_tok_s"]
    # Logprob error of FP8 against bf16: the same dummy weights (FP8 quantizes bf16's), the
    # prompt's next-token log-probabilities, over bf16's top 20 that FP8's top 20 also holds.
    # (The Q4_K GGUF has weights of its own: no such comparison.)
    top = {}
    for label, model, extra in runs[:2]:
        outs, _, _ = troupe(binary, model, [{"prompt_ids": prompt, "max_tokens": 1, "top_logprobs": 20}],
                            ["--kv-cache-mib", "4096", *extra], f"quant-logprobs-{label}")
        top[label] = {int(i): lp for i, lp in outs[0]["top_logprobs"][0]}
    shared = [i for i in top["bf16"] if i in top["fp8"]]
    diffs = [abs(top["fp8"][i] - top["bf16"][i]) for i in shared]
    rows["fp8"]["logprob_error_vs_bf16"] = dict(
        shared_of_top20=len(shared), max_abs=max(diffs, default=None),
        mean_abs=sum(diffs) / len(diffs) if diffs else None,
        same_argmax=max(top["bf16"], key=top["bf16"].get) == max(top["fp8"], key=top["fp8"].get))
    results["quant"] = dict(bandwidths_bytes_s=bws, limit_bytes_s=limit, rows=rows,
                            fp8_over_bf16=rows["fp8"]["decode_tok_s"] / rows["bf16"]["decode_tok_s"])


def quant_prefill(binary, results):
    """Prefill of 4 x 4 096-token prompts, Llama-3.1-8B shape (--dummy-weights): bf16
    weights into cuBLAS against `--quantization fp8` (cuBLASLt on FP8 tensor cores, e4m3
    activations a scale per token) and the same FP8 weights dequantized to bf16 for cuBLAS
    (TROUPE_FP8_GEMM=0, the path before)."""
    path, _ = llama_8b_config()
    gen = torch.Generator().manual_seed(1)
    reqs = [dict(prompt_ids=torch.randint(100, 128000, (4096,), generator=gen).tolist(), max_tokens=1)
            for _ in range(4)]
    rows = {}
    for label, extra, env in [("bf16", [], {}), ("fp8", ["--quantization", "fp8"], {}),
                              ("fp8 dequantized", ["--quantization", "fp8"], {"TROUPE_FP8_GEMM": "0"})]:
        os.environ.pop("TROUPE_FP8_GEMM", None)
        os.environ.update(env)
        _, stats, wall = troupe(binary, path, reqs, ["--dummy-weights", "--kv-cache-mib", "8192", *extra],
                                f"quant-prefill-{label.replace(' ', '-')}")
        rows[label] = dict(prefill_tok_s=stats["prefill_tokens_per_s"], wall_s=wall)
    os.environ.pop("TROUPE_FP8_GEMM", None)
    results["quant_prefill"] = dict(rows=rows, fp8_over_bf16=rows["fp8"]["prefill_tok_s"] / rows["bf16"]["prefill_tok_s"])


def random_kquant_gguf(cfg):
    """The Llama config as a GGUF of random Q4_K blocks (every layer projection and the
    embedding table) and a Q6_K output, like a Q4_K_M file's bulk: no tokenizer (prompt ids
    only). Block scales are fixed small f16 values, the rest random bytes. Needs the `gguf`
    package (carried in gpu-bin/pylib when the device lacks it); None without it."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu-bin", "pylib"))
    try:
        import gguf
        import numpy as np
    except ImportError:
        return None
    from gguf import GGMLQuantizationType as T
    path = os.path.join(WORK, "llama-3.1-8b-q4k.gguf")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(0)

    def blocks(rows, cols, t):
        size, scale_at = {T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}[t]
        raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for at in scale_at:  # d (and dmin): 2^-14, small enough to keep activations finite
            raw[..., at:at + 2] = np.frombuffer(np.float16(2.0 ** -14).tobytes(), dtype=np.uint8)
        return raw.reshape(rows, -1)

    h, f, kv_dim = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * 128
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(500000.0)  # the config's (newer transformers nest it)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(128)
    ones = np.ones(h, dtype=np.float32)
    w.add_tensor("token_embd.weight", blocks(cfg.vocab_size, h, T.Q4_K), raw_dtype=T.Q4_K)
    for i in range(cfg.num_hidden_layers):
        for name, (rows, cols) in [("attn_q", (h, h)), ("attn_k", (kv_dim, h)), ("attn_v", (kv_dim, h)),
                                   ("attn_output", (h, h)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)),
                                   ("ffn_down", (h, f))]:
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(rows, cols, T.Q4_K), raw_dtype=T.Q4_K)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", blocks(cfg.vocab_size, h, T.Q6_K), raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quant_offline(binary, results):
    """The offline workload (Qwen3-0.6B shape, 256 requests) with --dummy-weights, bf16
    against `--quantization fp8`: batches past 8 rows on cuBLASLt's FP8 GEMM, and (TROUPE_FP8_GEMM=0)
    dequantized to bf16 for cuBLAS instead."""
    path = os.path.join(WORK, "qwen3-0.6b-config")
    os.makedirs(path, exist_ok=True)
    Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=True).save_pretrained(path)
    reqs = offline_requests()
    total_out = sum(r["max_tokens"] for r in reqs)
    rows = {}
    for label, extra, env in [("bf16", [], {}), ("fp8", ["--quantization", "fp8"], {}),
                              ("fp8 dequantized", ["--quantization", "fp8"], {"TROUPE_FP8_GEMM": "0"})]:
        os.environ.pop("TROUPE_FP8_GEMM", None)
        os.environ.update(env)
        _, stats, wall = troupe(binary, path, reqs, ["--dummy-weights", *extra],
                                f"quant-offline-{label.replace(' ', '-')}")
        rows[label] = dict(out_tok_s=total_out / wall, generate_out_tok_s=total_out / stats["generate_s"],
                           wall_s=wall, weight_card=stats.get("weight_card"),
                           resident_weight_bytes=stats.get("resident_weight_bytes"))
    os.environ.pop("TROUPE_FP8_GEMM", None)
    results["quant_offline"] = dict(total_out_tokens=total_out, rows=rows,
                                    fp8_over_bf16=rows["fp8"]["generate_out_tok_s"] / rows["bf16"]["generate_out_tok_s"])


def invariant(binary, results):
    """`--batch-invariant` against the default mode: decode at batch 1, 16 and 64 (128-token
    prompts, 128 new tokens), dummy weights, Llama-3.1-8B and Qwen3-0.6B shapes.
    GPU_BENCH_INVARIANT narrows it for A/B runs: "SHAPES:BATCHES[:MODES]", e.g.
    "llama-3.1-8b:16,64:invariant"."""
    only = (os.environ.get("GPU_BENCH_INVARIANT", "") + "::").split(":")
    shapes, batches, modes = (only[0].split(",") if only[0] else None,
                              [int(b) for b in only[1].split(",")] if only[1] else (1, 16, 64),
                              only[2].split(",") if only[2] else ("default", "invariant"))
    qwen = os.path.join(WORK, "qwen3-0.6b-config")
    os.makedirs(qwen, exist_ok=True)
    Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True).save_pretrained(qwen)
    rows = {}
    for name, path in (("qwen3-0.6b", qwen), ("llama-3.1-8b", llama_8b_config()[0])):
        if shapes and name not in shapes:
            continue
        for batch in batches:
            rng = random.Random(batch)
            lines = [dict(prompt_ids=[rng.randint(100, 100000) for _ in range(128)], max_tokens=128)
                     for _ in range(batch)]
            row = {}
            for mode, extra in (("default", []), ("invariant", ["--batch-invariant"])):
                if mode not in modes:
                    continue
                _, stats, _ = troupe(binary, path, lines, ["--dummy-weights", "--kv-cache-mib", "8192", *extra],
                                     f"invariant-{name}-b{batch}-{mode}")
                row[mode] = stats["decode_tokens_per_s"]
            if len(row) == 2:
                row["invariant_slower_by"] = row["default"] / row["invariant"] - 1
            rows[f"{name} b{batch}"] = row
            print(f"{name} b{batch}: {row}", flush=True)
    results["invariant"] = rows


def offline_requests():
    rng = random.Random(0)
    return [dict(prompt_ids=[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))],
                 max_tokens=rng.randint(100, 1024)) for _ in range(256)]


def offline(binary, results):
    path = make("qwen3-0.6b")
    reqs = offline_requests()
    total_out = sum(r["max_tokens"] for r in reqs)
    rows = {}
    # GPU_BENCH_KV=bf16,fp8: one ZOS run per KV cache dtype instead.
    kvs = [k for k in os.environ.get("GPU_BENCH_KV", "").split(",") if k]
    runs = [(True, kv) for kv in kvs] or [
        (zos, None) for zos in ((True,) if os.environ.get("GPU_BENCH_ZOS_ONLY") else (True, False))]
    for zos, kv in runs:
        extra = ([] if zos else ["--no-zos"]) + os.environ.get("GPU_BENCH_OFFLINE_ARGS", "").split()
        extra += ["--kv-cache-dtype", kv] if kv else []
        name = f"kv_{kv}" if kv else ("zos" if zos else "no_zos")
        _, stats, wall = troupe(binary, path, reqs, extra, f"offline-{name}")
        print(f"offline {name}: {total_out / wall:.0f} out tok/s, wall {wall:.2f} s", flush=True)
        rows[name] = dict(out_tok_s=total_out / wall, wall_s=wall,
                                                generate_out_tok_s=total_out / stats["generate_s"],
                                                idle_share=stats["worker_idle_secs"] / wall,
                                                # CUDA events: last work of a step to the next one's first.
                                                device_idle_share=stats["device_idle_secs"] / stats["generate_s"],
                                                stats=stats)
    results["offline"] = dict(total_out_tokens=total_out, troupe=rows)


def peer(binary, results):
    """The offline workload's peer: transformers' continuous batching on its first 64
    requests (the whole 256 takes longer than a device call may run)."""
    path = make("qwen3-0.6b")
    reqs = offline_requests()
    try:
        from transformers import GenerationConfig
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        sub = reqs[:64]
        gc = GenerationConfig(max_new_tokens=max(r["max_tokens"] for r in sub), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=[r["prompt_ids"] for r in sub], generation_config=gc)
        secs = time.perf_counter() - t0
        n = sum(len(v.generated_tokens) for v in out.values())
        peer = dict(requests=len(sub), out_tokens=n, out_tok_s=n / secs, wall_s=secs)
    except Exception as e:  # the peer's API moves between versions: report, do not fail
        peer = dict(error=str(e)[-800:])
    results["peer"] = dict(transformers_generate_batch=peer)


def startup(binary, results):
    """Seconds from process start to one generated token, Qwen3-0.6B shape: with the
    kernel cache cold and warm, the driver's JIT cache off, and with --dummy-weights (no
    checkpoint read)."""
    path = make("qwen3-0.6b")
    rows = {}
    cold = os.path.join(WORK, "startup-home")
    shutil.rmtree(cold, ignore_errors=True)
    for label, env, extra in [
        ("cold_kernel_cache", {"TROUPE_HOME": cold}, []),
        ("warm", {"TROUPE_HOME": cold}, []),
        ("warm_no_driver_jit_cache", {"TROUPE_HOME": cold, "CUDA_CACHE_DISABLE": "1"}, []),
        ("warm_dummy_weights", {"TROUPE_HOME": cold}, ["--dummy-weights"]),
    ]:
        cmd = [binary, "generate", "--model", path, "--device", "cuda", "--prompt-ids", "1",
               "--max-tokens", "1", "--stats", *extra]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        stats = json.loads([l for l in r.stderr.splitlines() if l.startswith("{")][-1])
        rows[label] = dict(wall_s=wall, generate_s=stats["generate_s"])
    results["startup"] = rows


def main(binary, part):
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0)}
    try:
        {"decode": decode, "offline": offline, "peer": peer, "dummy": dummy,
         "startup": startup, "quant": quant, "quant_offline": quant_offline,
         "quant_prefill": quant_prefill, "invariant": invariant}[part](binary, results)
    except Exception as e:
        results[part] = {"error": str(e)[-2000:]}
    with open(os.path.join(OUT, f"gpu_bench_{part}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
