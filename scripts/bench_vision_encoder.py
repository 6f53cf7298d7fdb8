#!/usr/bin/env python3
"""The vision encoder on the CPU, troupe against transformers in one run: a Qwen2.5-VL
vision tower of Qwen2.5-VL-3B's width (hidden 1280, 16 heads, MLP 3420, window 112, out
2048) and `--depth` of its 32 blocks, random weights; images per second at each size
(square noise images, the processor's patches), transformers' `model.visual` under
torch.no_grad in f32 beside `cargo bench --bench vision_encoder`.

Run: python3 scripts/bench_vision_encoder.py [--depth 4] [--sizes 448,1024] [--reps 3]
(needs torch, transformers, pillow: scripts/requirements-goldens.txt)
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--sizes", default="448,1024")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=2048, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=args.depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[args.depth - 1], out_hidden_size=2048),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        vocab_size=512,
    )
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=1024 * 1024 + 1)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        processor.save_pretrained(d)
        rows = []
        rng = np.random.default_rng(0)
        for side in sizes:
            image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
            inputs = processor(images=[image], return_tensors="pt")
            pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
            with torch.no_grad():
                model.model.visual(pixels, grid_thw=grid)
                started = time.perf_counter()
                for _ in range(args.reps):
                    model.model.visual(pixels, grid_thw=grid)
                hf = (time.perf_counter() - started) / args.reps
            rows.append({"side": side, "grid": grid[0].tolist(), "transformers_secs": hf})
        env = dict(os.environ, VISION_DIR=d, VISION_SIZES=args.sizes, VISION_REPS=str(args.reps))
        out = subprocess.run(["cargo", "bench", "--quiet", "--bench", "vision_encoder"], env=env,
                             capture_output=True, text=True, check=True).stdout
        ours = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; vision depth {args.depth}")
    print(f"{'side':>5} {'grid':>12} {'transformers img/s':>19} {'troupe img/s':>13} {'troupe/transformers':>20}")
    for r, o in zip(rows, ours):
        assert r["grid"] == o["grid"], (r, o)
        print(f"{r['side']:>5} {str(r['grid']):>12} {1 / r['transformers_secs']:>19.3f} "
              f"{o['images_per_sec']:>13.3f} {o['images_per_sec'] * r['transformers_secs']:>20.2f}")


if __name__ == "__main__":
    main()
