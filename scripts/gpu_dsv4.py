#!/usr/bin/env python3
"""DeepSeek-V4 on the H200: a reduced-depth V4-Flash shape with `--dummy-weights` (bf16
matrices made on the device), troupe's CUDA pass against transformers'
`DeepseekV4ForCausalLM` (bf16, eager, random init) with the same config, one after the
other in one run, and against the physical limits measured in the same run.

Usage (on the device machine): python3 scripts/gpu_dsv4.py target/release/troupe \
    [--layers 9] [--prompt 4096] [--decode-prompt 512] [--new 64] [--batch 32] [--out DIR]
Prints a table last; writes gpu_dsv4.json to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

# V4-Flash (transformers' DeepseekV4Config defaults) at reduced depth: one sliding layer,
# then CSA and HCA alternating; the first three MLPs hash-routed.
FLASH = dict(
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    q_lora_rank=1024,
    num_experts_per_tok=6,
    n_routed_experts=256,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    compress_rope_theta=160000.0,
    rope_theta=10000.0,
    partial_rotary_factor=64 / 512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=128,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=1048576,
    bos_token_id=0,
    eos_token_id=1,
)


def shape(layers: int) -> dict:
    kinds = ["sliding_attention"] + [
        "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
        for i in range(layers - 1)
    ]
    mlps = ["hash_moe" if i < 3 else "moe" for i in range(layers)]
    return dict(FLASH, num_hidden_layers=layers, layer_types=kinds, mlp_layer_types=mlps)


def bytes_per_token(s: dict) -> tuple[float, float]:
    """Bytes of weights a batch-1 decode step reads per layer (dense parts, the routed
    experts a token picks and the shared one), and once per token (the head), as
    --dummy-weights keeps them: routed experts in troupe's MXFP4 blocks (17 bytes a 32),
    the projections DeepSeek ships in FP8 (wq_a, wq_b, wkv, wo_b, the shared expert) at
    1 byte, the rest bf16."""
    d, hd, h = s["hidden_size"], s["head_dim"], s["num_attention_heads"]
    q, o, g = s["q_lora_rank"], s["o_lora_rank"], s["o_groups"]
    ih, ihd = s["index_n_heads"], s["index_head_dim"]
    n = s["hc_mult"]
    layers = s["num_hidden_layers"]
    total = 0
    for kind in s["layer_types"]:
        shipped_fp8 = d * q + q * h * hd + d * hd + d * g * o
        shipped_fp8 += s["n_shared_experts"] * 3 * d * s["moe_intermediate_size"]
        p = g * o * (h * hd // g) + 2 * (2 + n) * n * n * d + d * s["n_routed_experts"]
        if kind == "compressed_sparse_attention":
            p += 2 * d * 2 * hd + 2 * d * 2 * ihd + q * ih * ihd + d * ih
        elif kind == "heavily_compressed_attention":
            p += 2 * d * hd
        routed = s["num_experts_per_tok"] * 3 * d * s["moe_intermediate_size"]
        total += 2 * p + shipped_fp8 + 17 / 32 * routed
    return total / layers, 2 * s["vocab_size"] * d


def command(binary: str, model: Path, prompts: list[list[int]], new: int, tmp: Path, kv_mib: int,
            extra=()) -> list[str]:
    """`troupe generate` on `prompts` with `--dummy-weights` on the GPU, its stats to
    tmp/stats.json."""
    stats = tmp / "stats.json"
    cmd = [binary, "generate", "--model", str(model), "--dummy-weights", "--device", "cuda",
           "--max-tokens", str(new), "--ignore-eos", "--json", "--stats", str(stats),
           "--kv-cache-mib", str(kv_mib), "--max-num-seqs", str(max(len(prompts), 1)),
           "--max-num-batched-tokens", "4096", *extra]
    if len(prompts) == 1:
        cmd += ["--prompt-ids", ",".join(map(str, prompts[0]))]
    else:
        f = tmp / "prompts.jsonl"
        f.write_text("".join(json.dumps({"prompt_ids": p, "max_tokens": new}) + "\n" for p in prompts))
        cmd += ["--prompts-file", str(f)]
    return cmd


def troupe(binary: str, model: Path, prompts: list[list[int]], new: int, tmp: Path, kv_mib: int,
           extra: tuple = ()) -> dict:
    stats = tmp / "stats.json"
    cmd = command(binary, model, prompts, new, tmp, kv_mib, extra)
    stats.unlink(missing_ok=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        # Stats written means the work was done and the process died on its way out.
        after = "after writing its stats" if stats.exists() else "before writing its stats"
        raise SystemExit(f"troupe failed ({res.returncode}) {after}, {len(prompts)} prompt(s): "
                         f"{res.stderr[-3000:]}")
    s = json.loads(stats.read_text())
    s["wall_s"] = wall
    return s


def peer(s: dict, prompt: list[int], decode_prompt: list[int], new: int) -> dict:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**s)
    cfg._attn_implementation = "eager"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg).eval()
    out = {}
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        model(ids[:, :256], use_cache=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        torch.cuda.synchronize()
        out["prefill_tokens_per_s"] = len(prompt) / (time.perf_counter() - t0)
        ids = torch.tensor([decode_prompt], device="cuda")
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        out["decode_tokens_per_s"] = (new - 1) / (time.perf_counter() - t0 - first)
    del model
    torch.cuda.empty_cache()
    return out


def copy_bandwidth() -> float:
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("troupe")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv-mib", type=int, default=4096)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--invariant", action="store_true", help="also decode with --batch-invariant")
    ap.add_argument("--batches", default="", help="more decode batch sizes, comma-separated")
    ap.add_argument("--eager", action="store_true",
                    help="also decode every batch size with --enforce-eager (no recorded steps)")
    ap.add_argument("--mtp", action="store_true",
                    help="also decode batch 1 and --batch with --spec mtp (confidence and fixed verification)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rng = random.Random(0)
    s = shape(args.layers)
    ids = lambda n: [rng.randrange(2, s["vocab_size"]) for _ in range(n)]
    prompt, decode_prompt = ids(args.prompt), ids(args.decode_prompt)
    batch = [ids(args.decode_prompt) for _ in range(args.batch)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "v4-flash"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(dict(s, model_type="deepseek_v4",
                                                           architectures=["DeepseekV4ForCausalLM"])))
        rows["troupe prefill"] = troupe(args.troupe, model, [prompt], 1, tmp, args.kv_mib)
        rows["troupe decode b1"] = troupe(args.troupe, model, [decode_prompt], args.new, tmp, args.kv_mib)
        rows[f"troupe decode b{args.batch}"] = troupe(args.troupe, model, batch, args.new, tmp, args.kv_mib)
        for b in [int(x) for x in args.batches.split(",") if x]:
            rows[f"troupe decode b{b}"] = troupe(args.troupe, model, [ids(args.decode_prompt) for _ in range(b)],
                                                 args.new, tmp, args.kv_mib)
        if args.eager:
            for name in [k for k in rows if k.startswith("troupe decode b")]:
                b = int(name.removeprefix("troupe decode b"))
                rows[f"{name} eager"] = troupe(args.troupe, model, [ids(args.decode_prompt) for _ in range(b)],
                                               args.new, tmp, args.kv_mib, ("--enforce-eager",))
        if args.invariant:
            for b in (1, 16, 64):
                rows[f"troupe decode b{b} invariant"] = troupe(
                    args.troupe, model, [ids(args.decode_prompt) for _ in range(b)], args.new, tmp,
                    args.kv_mib, ("--batch-invariant",))
                if f"troupe decode b{b}" not in rows:
                    rows[f"troupe decode b{b}"] = troupe(
                        args.troupe, model, [ids(args.decode_prompt) for _ in range(b)], args.new, tmp,
                        args.kv_mib)
        if args.mtp:
            for b in (1, args.batch):
                for verify in ("confidence", "fixed"):
                    rows[f"troupe decode b{b} mtp {verify}"] = troupe(
                        args.troupe, model, [ids(args.decode_prompt) for _ in range(b)], args.new, tmp,
                        args.kv_mib, ("--spec", "mtp", "--num-speculative-tokens", "1",
                                      "--spec-verify", verify))
    bw = copy_bandwidth()
    layer_bytes, head_bytes = bytes_per_token(s)
    roofline = bw / (args.layers * layer_bytes + head_bytes)
    print(f"troupe: {json.dumps({k: (v['prefill_tokens_per_s'], v['decode_tokens_per_s']) for k, v in rows.items()})}",
          flush=True)
    peer_row = None if args.no_peer else peer(s, prompt, decode_prompt, args.new)
    result = dict(layers=args.layers, shape=s, copy_bandwidth=bw, roofline_b1=roofline,
                  troupe=rows, transformers=peer_row)
    Path(args.out, "gpu_dsv4.json").write_text(json.dumps(result, indent=1))
    L = args.layers
    b1_stats = rows["troupe decode b1"]
    print(f"V4-Flash shape, {L} layers, dummy weights ({b1_stats.get('weight_card')}), "
          f"{b1_stats.get('resident_weight_bytes', 0) / 2**30:.1f} GiB resident; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"batch-1 decode roofline {roofline:.1f} tok/s ({layer_bytes / 1e6:.0f} MB/layer + head {head_bytes / 1e6:.0f} MB)")
    print("| run | tok/s | layer-tok/s (× layers) | vs transformers |")
    print("|---|---:|---:|---:|")
    b1 = rows["troupe decode b1"]["decode_tokens_per_s"]
    for name, st, key, p in [
        (f"prefill {args.prompt} tokens", rows["troupe prefill"], "prefill_tokens_per_s", "prefill_tokens_per_s"),
        ("decode batch 1", rows["troupe decode b1"], "decode_tokens_per_s", "decode_tokens_per_s"),
        (f"decode batch {args.batch}", rows[f"troupe decode b{args.batch}"], "decode_tokens_per_s", None),
    ]:
        v = st[key]
        ratio = f"{v / peer_row[p]:.2f}×" if peer_row and p else "-"
        print(f"| troupe {name} | {v:.1f} | {v * L:.0f} | {ratio} |")
    if peer_row:
        print(f"| transformers prefill | {peer_row['prefill_tokens_per_s']:.1f} | {peer_row['prefill_tokens_per_s'] * L:.0f} | |")
        print(f"| transformers decode batch 1 | {peer_row['decode_tokens_per_s']:.1f} | {peer_row['decode_tokens_per_s'] * L:.0f} | |")
    for name, st in rows.items():
        if name.startswith("troupe decode b") and name not in ("troupe decode b1", f"troupe decode b{args.batch}"):
            accepted = ""
            if st.get("spec_draft_tokens"):
                accepted = (f" (drafts {st['spec_draft_tokens']}, accepted {st['spec_accepted_tokens']}, "
                            f"verify rows {st['spec_verify_rows']})")
            print(f"| {name}{accepted} | {st['decode_tokens_per_s']:.1f} | {st['decode_tokens_per_s'] * L:.0f} | - |")
    print(f"troupe batch-1 decode = {b1 / roofline:.3f} of the roofline")


if __name__ == "__main__":
    main()
