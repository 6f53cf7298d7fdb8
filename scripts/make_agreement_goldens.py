#!/usr/bin/env python3
"""Greedy agreement goldens for the default model (SmolLM2-135M-Instruct Q4_1): for
generated chat prompts (templates × subjects), transformers' fp32 greedy sequence on the
GGUF's dequantized weights, and llama.cpp's argmax at each step of that sequence fed back
(teacher forcing, so one near-tie flip does not end the comparison). The Rust test
`models::eight_bit_greedy_agrees_with_transformers_at_least_as_well_as_llama_cpp` runs
troupe's 8-bit decode path the same way and must agree at least as often.

Needs torch, transformers, gguf and llama-cpp-python (built from source: see
scripts/bench_cpu.py), and the default model (`troupe generate` fetches it).
Writes tests/goldens/smollm2_agreement.json.
Run: python3 scripts/make_agreement_goldens.py [--model PATH]
"""

import argparse
import itertools
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "goldens", "smollm2_agreement.json")
TEMPLATES = ["Explain {} in simple terms.", "Write a short story about {}.", "What are three facts about {}?"]
SUBJECTS = ["the moon", "photosynthesis", "a binary search", "the Roman empire", "volcanoes",
            "prime numbers", "a lighthouse keeper", "coffee"]
TOKENS = 40


def main():
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    home = os.environ.get("TROUPE_HOME") or os.path.join(os.path.expanduser("~/.cache"), "troupe")
    ap.add_argument("--model", default=os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    d, name = os.path.dirname(args.model), os.path.basename(args.model)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    prompts = []
    for template, subject in itertools.product(TEMPLATES, SUBJECTS):
        text = template.format(subject)
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(rendered, add_special_tokens=False)
        inp = torch.tensor([ids])
        with torch.no_grad():
            # No EOS stop: every step is a comparison point.
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=TOKENS,
                                 min_new_tokens=TOKENS, pad_token_id=tok.eos_token_id, output_logits=True,
                                 return_dict_in_generate=True)
        greedy = gen.sequences[0, len(ids):].tolist()
        margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in gen.logits]
        llm.reset()
        llm.eval(ids)
        forced = []
        for t in greedy:
            row = llm.scores[llm.n_tokens - 1]
            forced.append(int(max(range(len(row)), key=lambda i: row[i])))
            llm.eval([t])
        prompts.append({"text": text, "prompt_ids": ids, "greedy": greedy,
                        "margins": [round(m, 4) for m in margins], "llama_cpp_forced_argmax": forced})
        agree = sum(a == b for a, b in zip(forced, greedy))
        print(f"  {text!r}: llama.cpp agrees on {agree}/{len(greedy)}")
    with open(OUT, "w") as f:
        json.dump({"model": name, "llama_cpp_python": llama_cpp.__version__, "prompts": prompts}, f)
        f.write("\n")
    total = sum(len(p["greedy"]) for p in prompts)
    agree = sum(sum(a == b for a, b in zip(p["llama_cpp_forced_argmax"], p["greedy"])) for p in prompts)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes): llama.cpp {agree}/{total}")


if __name__ == "__main__":
    main()
