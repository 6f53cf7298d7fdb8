#!/usr/bin/env python3
"""FP8 goldens for troupe's Rust tests (run by `make_goldens.py --only fp8`):

- `fp8/e4m3.json`: values across e4m3's range (subnormals, ties, past 448) and the bytes
  torch's `to(float8_e4m3fn)` gives them.
- `fp8/tiny-fp8-block` and `fp8/tiny-fp8-channel`: tiny Llama checkpoints with generated
  dimensions in the two FP8 layouts checkpoints ship — HF `quant_method: fp8` (e4m3 weights,
  `weight_scale_inv` per block of `weight_block_size`, generated too) and compressed-tensors
  (e4m3 weights, `weight_scale` per output channel) — with the logits transformers computes
  in fp32 from the dequantized weights.
- `fp8/tiny-llama-quantized.reference.json`: tiny-llama's projections quantized per
  channel as `--quantization fp8` does (scale = row amax / 448, e4m3 of w / scale), and
  transformers' logits for the dequantized model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from make_goldens import OUT, SPECIALS, VOCAB, logit_cases, randomize, write_json

FP8 = OUT / "fp8"
E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def e4m3_cases(torch):
    rng = np.random.default_rng(7)
    mags = np.exp2(rng.uniform(-12, 10, size=400)).astype(np.float32)
    signs = np.where(rng.random(400) < 0.5, -1.0, 1.0).astype(np.float32)
    values = mags * signs
    # Exact midpoints between neighbouring codes: the ties.
    codes = torch.arange(0, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    mids = ((codes[:-1] + codes[1:]) / 2).astype(np.float32)
    values = np.concatenate([values, mids[rng.choice(len(mids), 60, replace=False)]])
    got = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    write_json(FP8 / "e4m3.json", {"values": [float(v) for v in values], "bytes": [int(b) for b in got]})


def quantize_block(w, block, torch):
    """HF fp8 layout: one scale per block (ceil grid), w ≈ q · scale_inv."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(gr, gc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            s = blk.abs().amax() / E4M3_MAX
            scale[i, j] = s
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (blk / s).to(torch.float8_e4m3fn)
    deq = q.float() * scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q, scale, deq


def quantize_channel(w, torch):
    """compressed-tensors' channel strategy and `--quantization fp8`: one scale per row."""
    s = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    q = (w / s).to(torch.float8_e4m3fn)
    return q, s, q.float() * s


def tokenizer_files(d: Path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(OUT / "tiny-llama" / name, d / name)


def prompts(seed: int):
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.integers(len(SPECIALS), VOCAB, size=n)] for n in rng.integers(4, 60, size=3)]


def tiny_fp8(layout: str, seed: int):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    rng = np.random.default_rng(seed)
    head_dim = int(rng.choice([16, 32]))
    kv_heads = int(rng.integers(1, 3))
    heads = kv_heads * int(rng.integers(1, 4))
    hidden = 32 * int(rng.integers(3, 7))
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=32 * int(rng.integers(4, 12)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, torch)
    model.eval()
    # Blocks that need not divide the matrices: HF grids round up (partial last blocks).
    block = [int(rng.choice([64, 96, 128])), int(rng.choice([64, 96, 128]))]
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = name.removesuffix(".weight")
            if name.endswith(".weight") and base.rsplit(".", 1)[-1] in PROJECTIONS:
                if layout == "block":
                    q, s, deq = quantize_block(p.data, block, torch)
                    state[base + ".weight_scale_inv"] = s.contiguous()
                else:
                    q, s, deq = quantize_channel(p.data, torch)
                    state[base + ".weight_scale"] = s.contiguous()
                state[name] = q.contiguous()
                p.copy_(deq)  # the reference runs the dequantized weights
            else:
                state[name] = p.data.clone().contiguous()
    d = FP8 / f"tiny-fp8-{layout}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    if layout == "block":
        conf["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
        }
    else:
        conf["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    (d / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0).save_pretrained(d)
    tokenizer_files(d)
    cases = logit_cases(model, torch, prompts(seed + 1))
    print(f"  tiny-fp8-{layout}: hidden {hidden}, block {block}, greedy {cases[0]['greedy'][:6]}")
    write_json(d / "reference.json", {"cases": cases})


def quantized_tiny_llama():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(OUT / "tiny-llama", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS:
                p.copy_(quantize_channel(p.data, torch)[2])
    cases = logit_cases(model, torch, prompts(31))
    write_json(FP8 / "tiny-llama-quantized.reference.json", {"cases": cases})


def make_fp8():
    import torch

    FP8.mkdir(parents=True, exist_ok=True)
    e4m3_cases(torch)
    tiny_fp8("block", 41)
    tiny_fp8("channel", 42)
    quantized_tiny_llama()


if __name__ == "__main__":
    make_fp8()
