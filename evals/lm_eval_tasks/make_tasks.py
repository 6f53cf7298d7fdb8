#!/usr/bin/env python3
"""Writes the lm-eval task data beside this file (troupe_mc.jsonl, troupe_gen.jsonl):
capitals and opposites the default model (SmolLM2-135M-Instruct) mostly knows. The
distractors are other items' answers at fixed strides and the right choice's place rotates,
so no item's choices were picked by hand. Re-runnable; overwrites its outputs."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Russia", "Moscow"), ("England", "London"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("China", "Beijing"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("India", "New Delhi"), ("Kenya", "Nairobi"),
    ("Argentina", "Buenos Aires"), ("Thailand", "Bangkok"), ("Turkey", "Ankara"), ("Peru", "Lima"),
]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
    ("happy", "sad"), ("open", "closed"), ("old", "young"), ("light", "dark"), ("left", "right"),
    ("early", "late"), ("full", "empty"), ("wet", "dry"), ("hard", "soft"), ("rich", "poor"),
    ("strong", "weak"),
]


def rotated(right, others, i):
    choices = [right] + others
    rot = i % 4
    return choices[rot:] + choices[:rot]


def main():
    cities = [c for _, c in CAPITALS]
    words = [w for pair in OPPOSITES for w in pair]
    mc = []
    for i, (country, cap) in enumerate(CAPITALS):
        others = [cities[(i + k * 7) % len(cities)] for k in (1, 2, 3)]
        choices = rotated(cap, others, i)
        mc.append({"kind": "capital", "text": f"Question: What is the capital of {country}?\nAnswer:",
                   "choices": [" " + c for c in choices], "answer": choices.index(cap)})
    for i, (a, b) in enumerate(OPPOSITES):
        picks = [words[(2 * i + s) % len(words)] for s in (5, 11, 19)]
        others = [w for w in picks if w not in (a, b)]
        others = (others + [w for w in words if w not in (a, b) and w not in others])[:3]
        choices = rotated(b, others, i)
        mc.append({"kind": "opposite", "text": f"The opposite of \"{a}\" is \"",
                   "choices": [c + "\"" for c in choices], "answer": choices.index(b)})
    gen = [{"question": f"What is the capital of {country}?", "answer": cap} for country, cap in CAPITALS[:16]]
    gen += [{"question": f"What is the opposite of \"{a}\"? Answer with one word.", "answer": b}
            for a, b in OPPOSITES[:8]]
    for name, rows in (("troupe_mc.jsonl", mc), ("troupe_gen.jsonl", gen)):
        with open(HERE / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(f"{len(mc)} multiple-choice items, {len(gen)} generation items")


if __name__ == "__main__":
    main()
