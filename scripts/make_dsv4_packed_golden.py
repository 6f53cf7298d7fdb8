#!/usr/bin/env python3
"""A tiny DeepSeek-V4 checkpoint in the formats the released ones ship, and transformers'
reference outputs for it: tests/goldens/tiny-dsv4-packed/.

Routed experts are MXFP4 (`X.weight` two E2M1 codes a byte, the low nibble first, as int8;
`X.scale` one E8M0 exponent per 32 values of a row), attention projections and shared
experts FP8 e4m3 (`X.weight` float8_e4m3fn; `X.weight_scale_inv` one f32 scale per
128×128 block, a power of two as DeepSeek's `ue8m0` scale format makes it), everything
else bf16. The reference (transformers' DeepseekV4ForCausalLM in
f32) runs on the dequantized values, read back through transformers' own loader, so troupe
is checked on exactly the numbers the packed bytes mean. The rest — prompts, logits, greedy
continuation — is scripts/make_dsv4_goldens.py's `make`.

Usage:
    python3 -m pip install -r scripts/requirements-goldens.txt
    python3 scripts/make_dsv4_packed_golden.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dsv4_goldens import CONFIGS, make  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_BLOCK = 128
FP8 = re.compile(r"^model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")
FP4 = re.compile(r"^model\.layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized, e4m3 codes, scale grid): each 128×128 block scaled by the smallest
    power of two that brings its largest magnitude within 448."""
    rows, cols = w.shape
    gr, gc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    scales = torch.empty(gr, gc)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            # A power of two (DeepSeek's `scale_fmt: ue8m0`): the dequantized values are
            # then exact in bf16 too, as a GPU's dequantize-for-cuBLAS path holds them.
            s = torch.exp2(torch.ceil(torch.log2(blk.abs().max().clamp(min=1e-30) / 448.0)))
            scales[i, j] = s
            codes[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    deq = codes.float() * scales.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return deq, codes, scales


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized, packed int8 pairs, E8M0 exponents): each group of 32 scaled by the
    power of two that puts its largest magnitude in E2M1's top binade, codes the nearest."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2
    scale = torch.exp2(exp)
    x = (g / scale[..., None]).clamp(-6.0, 6.0)
    codes = (x[..., None] - E2M1).abs().argmin(-1)
    deq = (E2M1[codes] * scale[..., None]).reshape(rows, cols)
    codes = codes.reshape(rows, cols).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.int8)
    exponents = (exp + 127).to(torch.uint8).reshape(rows, cols // 32)
    return deq, packed, exponents.view(torch.float8_e8m0fnu)


def pack(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    dequantized, stored = {}, {}
    for name, t in tensors.items():
        base = name[: -len(".weight")]
        if FP4.match(name):
            deq, packed, exponents = mxfp4(t.float())
            stored[name], stored[f"{base}.scale"] = packed, exponents
        elif FP8.match(name):
            deq, codes, scales = fp8_blocks(t.float())
            stored[name], stored[f"{base}.weight_scale_inv"] = codes, scales
        else:
            # bf16-representable already (make() rounds every float weight).
            deq = t
            stored[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        dequantized[name] = deq.contiguous()
    return dequantized, {k: v.contiguous() for k, v in stored.items()}


def main() -> None:
    # Expert widths that are whole MXFP4 groups (32), otherwise checkpoint A's shape.
    params = dict(CONFIGS["tiny-dsv4-a"], moe_intermediate_size=32)
    make("tiny-dsv4-packed", params, 23, pack=pack)


if __name__ == "__main__":
    main()
