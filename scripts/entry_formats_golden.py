#!/usr/bin/env python3
"""Goldens for DeepSeek-V4's cache entry formats (`src/kernels/entry_format.rs`): random
rows quantized by the seed's rules with ml_dtypes' own casts (e4m3fn, e2m1fn, bf16) as the
independent reference for every rounding, written with the bytes and the decoded values.

Usage: pip install numpy ml_dtypes && python3 scripts/entry_formats_golden.py
(writes tests/goldens/entry_formats.json)
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np

F32 = np.float32


def fp8(row):
    tile = min(128, len(row))
    data, scales, out = [], [], []
    for x in row.reshape(-1, tile):
        amax = np.max(np.abs(x))
        scale = F32(1.0) if amax == 0 else F32(amax) / F32(448.0)
        q = (x / scale).astype(ml_dtypes.float8_e4m3fn)
        data += list(q.view(np.uint8))
        scales += list(np.array([scale], dtype="<f4").view(np.uint8))
        out += list(q.astype(F32) * scale)
    return bytes(data + scales), out


def fp4_like(row, group, scale_of):
    data, scales, out = [], [], []
    for x in row.reshape(-1, group):
        code, scale = scale_of(F32(np.max(np.abs(x))))
        if scale > 0:
            q = np.clip(x / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn)
        else:
            q = np.zeros(group, dtype=ml_dtypes.float4_e2m1fn)
        nib = q.view(np.uint8) & 0xF
        data += [int(a) | int(b) << 4 for a, b in zip(nib[0::2], nib[1::2])]
        scales.append(code)
        out += list(q.astype(F32) * scale)
    return bytes(data + scales), out


def e4m3_scale(amax):
    s = np.array([amax / F32(6.0)], dtype=F32).astype(ml_dtypes.float8_e4m3fn)
    return int(s.view(np.uint8)[0]), F32(s.astype(F32)[0])


def e8m0_scale(amax):
    if amax == 0:
        e = 0
    else:
        _, exp = np.frexp(amax)
        e = int(np.clip(exp - 1 - 2 + 127, 0, 254))
    return e, F32(np.ldexp(F32(1.0), e - 127))


def bf16(row):
    q = row.astype(ml_dtypes.bfloat16)
    return bytes(q.view(np.uint16).astype("<u2").view(np.uint8)), list(q.astype(F32))


FORMATS = {
    "Fp8": fp8,
    "Fp4": lambda r: fp4_like(r, 16, e4m3_scale),
    "Mxfp4": lambda r: fp4_like(r, 32, e8m0_scale),
    "Bf16": bf16,
}


def f32_hex(values):
    """Little-endian f32 bits, 8 hex digits a value: exact and short."""
    return np.asarray(values, dtype="<f4").tobytes().hex()


def main():
    rng = np.random.default_rng(26)
    cases = []
    for name, dims in [("Fp8", [64, 256]), ("Fp4", [64]), ("Mxfp4", [64, 128]), ("Bf16", [64])]:
        for dim in dims:
            for kind in range(6):
                row = rng.standard_normal(dim).astype(F32) * F32(10.0 ** rng.uniform(-4, 3))
                if kind == 1:
                    row[rng.integers(0, dim, 3)] *= F32(50.0)  # outliers
                if kind == 2:
                    row[: dim // 2] = 0  # a zero group
                if kind == 3:
                    row[:] = 0
                if kind == 4:
                    row = np.exp2(rng.integers(-8, 8, dim)).astype(F32)  # exact powers of two
                if kind == 5:
                    # E2M1's ties exactly, where a group's scale is a power of two.
                    ties = F32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
                    row = rng.choice(ties, dim) * rng.choice(F32([1, -1]), dim) * F32(2.0**-3)
                    row[::16] = F32(5.0 * 2.0**-3)
                data, out = FORMATS[name](row)
                cases.append(dict(format=name, values=f32_hex(row), bytes=data.hex(),
                                  decoded=f32_hex(out)))
    path = Path(__file__).resolve().parent.parent / "tests/goldens/entry_formats.json"
    path.write_text(json.dumps(cases))
    print(f"{len(cases)} rows -> {path}")


if __name__ == "__main__":
    main()
