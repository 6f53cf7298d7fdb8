#!/usr/bin/env python3
"""Qwen2.5-VL's vision encoder on one GPU, troupe against transformers in one run (issue 64).

A checkpoint with Qwen2.5-VL-3B's vision tower whole (32 blocks of hidden 1280, full
attention at 7/15/23/31, random weights) and a 4-layer language model of its width is
written here (`scripts/make_vl_bench_model.py`). Then:
- encoder throughput: images/s at each size (square noise images), troupe's encoder on the
  GPU (`benches/vision_encoder.rs` with VISION_DEVICE=cuda; f32 activations, bf16 GEMM
  operands) beside transformers' `model.visual` in bf16 (sdpa) and f32;
- TTFT of a one-image chat: `troupe serve --device cuda`, a streamed chat with a new noise
  image each time, against transformers' processor + generate(max_new_tokens=1) in bf16.

Run: python3 scripts/gpu_vision.py --troupe BIN --bench BENCH_BIN [--sizes 448,1024]
     [--reps 5] [--out DIR]
"""

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from gpu_serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def noise(side, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def hf_encoder(model_dir, sizes, reps, dtype, batch=1):
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    out = {}
    for side in sizes:
        inputs = processor(images=[noise(side, 1)] * batch, return_tensors="pt")
        pixels = inputs["pixel_values"].cuda().to(dtype)
        grid = inputs["image_grid_thw"].cuda()
        with torch.no_grad():
            model.model.visual(pixels, grid_thw=grid)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(reps):
                model.model.visual(pixels, grid_thw=grid)
            torch.cuda.synchronize()
        out[side] = reps * batch / (time.perf_counter() - started)
    del model
    torch.cuda.empty_cache()
    return out


def chat_body(side, seed):
    buf = io.BytesIO()
    noise(side, seed).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this picture?"}]}],
        "max_tokens": 1, "temperature": 0, "stream": True}


def troupe_ttft(binary, model_dir, side, reps):
    port = free_port()
    proc = subprocess.Popen([binary, "serve", "--model", model_dir, "--device", "cuda",
                             "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        times = []
        for i in range(reps + 1):
            body = json.dumps(chat_body(side, 100 + i)).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            started = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: {") and b'"content"' in line:
                        break
                ttft = time.perf_counter() - started
                r.read()
            if i > 0:  # the first warms the kernels and the graphs
                times.append(ttft)
        return float(np.median(times))
    finally:
        proc.kill()
        proc.wait()


def hf_ttft(model_dir, side, reps):
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    times = []
    for i in range(reps + 1):
        started = time.perf_counter()
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[noise(side, 100 + i)], return_tensors="pt").to("cuda")
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - started)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--troupe", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--sizes", default="448,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model_dir = "/tmp/troupe-vl-bench"
    subprocess.run([sys.executable, str(ROOT / "scripts/make_vl_bench_model.py"), model_dir,
                    "--vision-depth", "32", "--full-attention", "7,15,23,31",
                    "--text-layers", "4", "--hidden", "2048"], check=True)
    env = dict(os.environ, VISION_DIR=model_dir, VISION_SIZES=args.sizes,
               VISION_REPS=str(args.reps), VISION_DEVICE="cuda")
    lines = subprocess.run([args.bench, "--bench"], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    ours = {r["side"]: r for r in (json.loads(l) for l in lines if l.startswith("{"))}
    # A batch of 8 images of 448² in one pass, each side.
    env8 = dict(env, VISION_SIZES="448", VISION_BATCH="8")
    lines = subprocess.run([args.bench, "--bench"], env=env8, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    ours8 = [json.loads(l) for l in lines if l.startswith("{")][0]["images_per_sec"]
    hf8 = hf_encoder(model_dir, [448], args.reps, torch.bfloat16, batch=8)[448]
    hf_bf16 = hf_encoder(model_dir, sizes, args.reps, torch.bfloat16)
    hf_f32 = hf_encoder(model_dir, sizes, args.reps, torch.float32)
    ttft = {"troupe": troupe_ttft(args.troupe, model_dir, 448, args.reps),
            "transformers": hf_ttft(model_dir, 448, args.reps)}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "encoder": {s: {"troupe": ours[s]["images_per_sec"], "grid": ours[s]["grid"],
                              "transformers_bf16": hf_bf16[s], "transformers_f32": hf_f32[s]}
                          for s in sizes},
              "batch8_448": {"troupe": ours8, "transformers_bf16": hf8},
              "ttft_448_s": ttft}
    Path(args.out, "vision.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    print(f"{result['gpu']}, torch {torch.__version__}; encoder: Qwen2.5-VL-3B's tower, 32 blocks")
    print("| image | troupe img/s | transformers bf16 img/s | transformers f32 img/s | troupe / bf16 |")
    print("|---|---|---|---|---|")
    for s in sizes:
        e = result["encoder"][s]
        print(f"| {s}² | {e['troupe']:.1f} | {e['transformers_bf16']:.1f} | {e['transformers_f32']:.1f} "
              f"| {e['troupe'] / e['transformers_bf16']:.2f} |")
    print(f"| 8 × 448² a pass | {ours8:.1f} | {hf8:.1f} | - | {ours8 / hf8:.2f} |")
    print(f"TTFT, one 448² image chat: troupe {ttft['troupe'] * 1e3:.0f} ms, "
          f"transformers {ttft['transformers'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
