#!/usr/bin/env python3
"""The K-quant and IQ4 GGUF golden (run by `make_goldens.py --only kquant`): a tiny Llama of
generated dimensions (rows of 256, which K-quants need) written as GGUF with every layer
tensor in one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS in turn (the stacked q/k/v
and gate/up mix formats), quantized by ggml's own quantizer (the library llama-cpp-python
ships: gguf-py quantizes none of them); the reference is transformers' fp32 on the values
gguf-py dequantizes the file to.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from make_goldens import OUT, SPECIALS, VOCAB, logit_cases, randomize, write_json
from make_gguf_goldens import gguf_hf_state_dict, write_tiny_gguf

NAME = "tiny-llama-kquants"


def ggml_quantizer():
    import gguf
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p,
    ]
    T = gguf.GGMLQuantizationType
    order = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
    seen = []

    def quantize(name, data):
        if name == "token_embd.weight":
            t = T.Q4_K
        elif name == "output.weight":
            t = T.Q6_K
        else:
            layer = int(name.split(".")[1])  # each layer shifted, so roles meet other formats
            t = order[(len(seen) + layer) % len(order)]
            seen.append((name, t.name))
        rows, cols = data.shape
        block, size = gguf.GGML_QUANT_SIZES[t]
        src = np.ascontiguousarray(data, dtype=np.float32)
        out = np.zeros((rows, cols // block * size), dtype=np.uint8)
        n = lib.ggml_quantize_chunk(int(t), src.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        assert n == out.nbytes, (name, n, out.nbytes)
        return out, t

    return quantize, seen


def make_kquants():
    import torch
    from transformers import AutoModelForCausalLM, AutoConfig, GenerationConfig, LlamaConfig

    rng = np.random.default_rng(51)
    hidden = 256 * int(rng.integers(1, 3))
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256 * int(rng.integers(2, 4)),
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
        num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(51)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, torch)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        model.save_pretrained(src, safe_serialization=True)
        GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0).save_pretrained(src)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(OUT / "tiny-llama" / f, src / f)
        quantize, seen = ggml_quantizer()
        path = OUT / f"{NAME}.gguf"
        write_tiny_gguf("llama", path, src=src, quantize=quantize)
        hp = AutoConfig.from_pretrained(src).to_dict()
        sd = gguf_hf_state_dict(path, "llama", hp)
    print(f"  {NAME}: hidden {hidden}, formats {seen}")
    model.eval()
    assert set(sd) == set(model.state_dict()), set(sd) ^ set(model.state_dict())
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    rng = np.random.default_rng(52)
    prompts = [[int(i) for i in rng.integers(len(SPECIALS), VOCAB, size=n)] for n in rng.integers(4, 60, size=3)]
    write_json(OUT / f"{NAME}.reference.json", {"cases": logit_cases(model, torch, prompts)})


if __name__ == "__main__":
    make_kquants()
