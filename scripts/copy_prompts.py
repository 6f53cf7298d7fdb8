#!/usr/bin/env python3
"""The 32 chat prompts asking to copy text and code that speculative decoding is measured
on (prompt lookup predicts them): bench_spec.sh on the CPU, gpu_spec.py on the H200.

Usage: python3 scripts/copy_prompts.py OUT.jsonl   (one {"prompt", "chat": true} a line)
"""

import json
import sys

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long.",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "The mitochondria is the powerhouse of the cell. It produces energy for the cell.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
ASKS = [
    "Repeat this text exactly, twice:\n{}",
    "Copy the following verbatim, then copy it again:\n{}",
    "Rewrite this, keeping every word, in a code block:\n{}",
    "Quote this back to me exactly:\n{}",
]


def prompts():
    return [ask.format(t) for ask in ASKS for t in TEXTS]


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        for p in prompts():
            f.write(json.dumps({"prompt": p, "chat": True}) + "\n")
