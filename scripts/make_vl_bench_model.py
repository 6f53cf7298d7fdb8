#!/usr/bin/env python3
"""A Qwen2.5-VL checkpoint for timing runs on the CPU (random weights): the tokenizer and
chat template of the generated test cases (a byte-level vocabulary), a vision tower of
Qwen2.5-VL-3B's width (hidden 1280, 16 heads, MLP 3420, window 112) with `--vision-depth`
of its 32 blocks, and a language model of `--text-layers` layers at `--hidden` width.
Images up to 1024 x 1024 keep their size through the processor.

Run: python3 scripts/make_vl_bench_model.py OUT_DIR [--vision-depth 4] [--text-layers 4]
     [--hidden 1024] [--full-attention 7,15,23,31]   (needs torch, transformers, pillow: scripts/requirements-goldens.txt)
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

CASE = Path(__file__).resolve().parent.parent / "tests/goldens/qwen25vl/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vision-depth", type=int, default=4)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--full-attention", default=None,
                    help="blocks with full attention, comma-separated (default: the last)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case = json.loads((CASE / "config.json").read_text())
    heads = args.hidden // 128
    text = dict(case["text_config"], hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.text_layers, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), head_dim=128, max_position_embeddings=32768,
                layer_types=["full_attention"] * args.text_layers,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    depth = args.vision_depth
    full = [int(b) for b in args.full_attention.split(",")] if args.full_attention else [depth - 1]
    vision = dict(case["vision_config"], depth=depth, hidden_size=1280, intermediate_size=3420,
                  num_heads=16, out_hidden_size=args.hidden, fullatt_block_indexes=full)
    ids = {k: case[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id", "vocab_size")}
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CASE / name, out / name)
    proc = json.loads((CASE / "preprocessor_config.json").read_text())
    proc.update(min_pixels=28 * 28 * 4, max_pixels=1024 * 1024 + 1,
                size={"shortest_edge": 28 * 28 * 4, "longest_edge": 1024 * 1024 + 1})
    (out / "preprocessor_config.json").write_text(json.dumps(proc, indent=1))
    print(f"{out}: vision depth {depth}, {args.text_layers} text layers at {args.hidden}")


if __name__ == "__main__":
    main()
