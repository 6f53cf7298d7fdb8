//! MXFP4 decode rows on AVX-512 VNNI: host experts' kernel. The integer sums take fewer
//! instructions than the shared kernel's; the f32 arithmetic is the shared kernel's lane
//! for lane, so the bits are `x86::dot`'s and the scalar path's.
//!
//! The shared kernel makes a signed code unsigned for `vpdpbusd` by `abs` and moves its
//! sign onto the activation (`sign`), two instructions a block. Here the codes are offset
//! to unsigned bytes (`level + 16`) by the lookup itself and the offset is taken back in
//! the integer sum from the activations' group sums (`Q8Row::neg_group_sums`), exactly.
//! Measured on one core with the weights streamed from memory (`benches/matmul.rs`,
//! `mxfp4_stream`): 1.05–1.10× the shared kernel on an AMD EPYC, 1.10× on the Xeon host
//! of an H100. Variants that measured worse: two weight rows a call (two f32 chains:
//! 1.12× on the Xeon, 0.45× on the EPYC) and 512-bit integer steps over two blocks
//! (0.7–0.9× on the EPYC, where 512-bit operations are split in two); at four activation
//! rows and more the shared kernel is faster (its chains already overlap).

use std::arch::x86_64::*;

use super::{ACT_BLOCK, ACT_GROUP, Mxfp4Kernel, Q8Row, check_shapes, mxfp4_kernel};
use crate::kernels::cpu::simd::{CpuPath, cpu_path};
use crate::kernels::quant::{MXFP4_LEVELS, mxfp4_half_scale};

/// Bytes of an MXFP4 block: the E8M0 exponent, then 16 bytes of E2M1 code pairs.
const BLOCK_BYTES: usize = 17;
/// Added to each level so codes are unsigned bytes; a power of two, so the correction is
/// a shift of the activations' group sums.
const OFFSET_LOG2: i32 = 4;

/// Only handed out by `row_dot` when `cpu_path()` is AVX-512 VNNI.
pub(super) fn dot_mxfp4_checked<const R: usize>(
    w: &[u8],
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    assert!(cpu_path() >= CpuPath::Avx512Vnni);
    let row_bytes = check_shapes::<super::formats::Mxfp4, R>(w, out.len(), &xs);
    if mxfp4_kernel() == Mxfp4Kernel::Wide && has_vbmi() {
        // SAFETY: AVX-512 F/VL/VNNI (asserted), BW/DQ/VBMI (checked); shapes checked.
        unsafe { dot_mxfp4_wide::<R>(w, row_bytes, xs, out) }
    } else {
        // SAFETY: AVX-512 F/VL/VNNI are present (asserted); shapes are checked above.
        unsafe { dot_mxfp4::<R>(w, row_bytes, xs, out) }
    }
}

/// `dot_mxfp4_checked` on the wide kernel (`wide`, where `has_vbmi`) or the narrow one,
/// whatever `TROUPE_MXFP4_KERNEL` says: tests compare the two.
#[cfg(test)]
pub(super) fn dot_mxfp4_on<const R: usize>(
    wide: bool,
    w: &[u8],
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    assert!(cpu_path() >= CpuPath::Avx512Vnni && (!wide || has_vbmi()));
    let row_bytes = check_shapes::<super::formats::Mxfp4, R>(w, out.len(), &xs);
    // SAFETY: the features are asserted and the shapes checked, as in `dot_mxfp4_checked`.
    unsafe {
        if wide {
            dot_mxfp4_wide::<R>(w, row_bytes, xs, out)
        } else {
            dot_mxfp4::<R>(w, row_bytes, xs, out)
        }
    }
}

/// Whether the wide kernel's instructions are here (AVX-512 BW, DQ and VBMI beside the
/// VNNI path's F, VL and VNNI).
pub(super) fn has_vbmi() -> bool {
    static HAS: crate::sync::OnceLock<bool> = crate::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vbmi")
    })
}

/// `out[j][i] = w_j · x_i` for MXFP4 rows, on a CPU with AVX-512 VL and VNNI (the
/// caller checked it and the shapes: `w` is whole rows of `row_bytes`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn dot_mxfp4<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out) {
        // SAFETY: this function's features are enabled; the caller checked the shapes.
        *o = unsafe { row_dot::<R>(row, xs) };
    }
}

/// One weight row against `R` activation rows: per lane and row
/// `acc = fma(float(isum), scale · d, acc)`, block after block, as the shared kernel.
#[inline(always)]
unsafe fn row_dot<const R: usize>(w: &[u8], xs: [Q8Row<'_>; R]) -> [f32; R] {
    // SAFETY: the caller's shape check bounds every block and activation index below.
    unsafe {
        let unsigned: [i8; 16] = MXFP4_LEVELS.map(|l| l + (1 << OFFSET_LOG2));
        let table = _mm_loadu_si128(unsigned.as_ptr() as *const __m128i);
        let table = _mm256_set_m128i(table, table);
        let nibble = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
            block_dot(blk, b, (table, nibble), xs, &mut acc);
        }
        finish(acc)
    }
}

/// One block's step of `row_dot` (block `b` of its row) into `acc`.
#[inline(always)]
unsafe fn block_dot<const R: usize>(
    blk: &[u8],
    b: usize,
    (table, nibble): (__m256i, __m256i),
    xs: [Q8Row<'_>; R],
    acc: &mut [__m256; R],
) {
    // SAFETY: the caller's shape check bounds the block and activation indices.
    unsafe {
        let raw = _mm_loadu_si128(blk.as_ptr().add(1) as *const __m128i);
        // Elements 0–15 from the low nibbles, 16–31 from the high, as the activations lie.
        let n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nibble);
        let codes = _mm256_shuffle_epi8(table, n);
        let scale = _mm256_set1_ps(mxfp4_half_scale(blk[0]));
        let (q, g) = (b * ACT_BLOCK, b * ACT_BLOCK / ACT_GROUP);
        for (r, x) in xs.iter().enumerate() {
            let xq = _mm256_loadu_si256(x.quants.as_ptr().add(q) as *const __m256i);
            let neg = _mm256_loadu_si256(x.neg_group_sums.as_ptr().add(g) as *const __m256i);
            let offset = _mm256_slli_epi32::<OFFSET_LOG2>(neg);
            let sums = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(offset, codes, xq));
            let d = _mm256_loadu_ps(x.scales.as_ptr().add(g));
            acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, d), acc[r]);
        }
    }
}

/// The row's sums from its lanes.
#[inline(always)]
unsafe fn finish<const R: usize>(acc: [__m256; R]) -> [f32; R] {
    // `+ 0.0`: the shared kernel adds its (here empty) min lanes, which turns a −0 sum
    // into +0; the same bits need the same addition.
    // SAFETY: AVX is enabled wherever this is inlined.
    std::array::from_fn(|r| unsafe { super::x86::hsum(acc[r]) } + 0.0)
}

/// `out[j][i] = w_j · x_i` two weight rows at a time (`rows_dot_wide`), the last odd row
/// alone; the caller checked the features and the shapes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni,avx512bw,avx512dq,avx512vbmi")]
unsafe fn dot_mxfp4_wide<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    let mut pairs = w.chunks_exact(2 * row_bytes);
    let mut outs = out.chunks_exact_mut(2);
    for (two, o) in (&mut pairs).zip(&mut outs) {
        let (a, b) = two.split_at(row_bytes);
        // SAFETY: this function's features are enabled; the caller checked the shapes.
        let [ya, yb] = unsafe { rows_dot_wide::<R, 2>([a, b], xs) };
        o[0] = ya;
        o[1] = yb;
    }
    if let ([o], last) = (outs.into_remainder(), pairs.remainder()) {
        // SAFETY: as above.
        *o = unsafe { rows_dot_wide::<R, 1>([last], xs) }[0];
    }
}

/// Byte `j` of each 128-bit lane of the permuted pair: lanes 0 and 1 the first block's
/// 16 code bytes (bytes 1–16 of the pair), lanes 2 and 3 the second's (18–33).
const CODE_BYTES: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        idx[i] = if i < 32 { 1 } else { 18 } + (i % 16) as u8;
        i += 1;
    }
    idx
};

/// Byte 0 of each 32-bit lane: the first block's exponent (byte 0) in lanes 0–7, the
/// second's (byte 17) in lanes 8–15; the other bytes are zeroed by `EXPONENT_MASK`.
const EXPONENT_BYTES: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut i = 32;
    while i < 64 {
        idx[i] = 17;
        i += 4;
    }
    idx
};
const EXPONENT_MASK: u64 = 0x1111_1111_1111_1111;

/// `W` weight rows against `R` activation rows, two blocks a step: each lane's chain is
/// `row_dot`'s, one `fma` a block in block order (so the same bits), with the integer
/// sums, conversions and scales of both blocks in one 512-bit step each.
#[inline(always)]
unsafe fn rows_dot_wide<const R: usize, const W: usize>(
    ws: [&[u8]; W],
    xs: [Q8Row<'_>; R],
) -> [[f32; R]; W] {
    // SAFETY: the caller's shape check bounds every block and activation index below; the
    // masked load reads the pair's 34 bytes only.
    unsafe {
        let unsigned: [i8; 16] = MXFP4_LEVELS.map(|l| l + (1 << OFFSET_LOG2));
        let table128 = _mm_loadu_si128(unsigned.as_ptr() as *const __m128i);
        let table = _mm512_broadcast_i32x4(table128);
        let nibble = _mm512_set1_epi8(0x0F);
        let code_bytes = _mm512_loadu_si512(CODE_BYTES.as_ptr() as *const __m512i);
        let exponent_bytes = _mm512_loadu_si512(EXPONENT_BYTES.as_ptr() as *const __m512i);
        // The second copy of each block's codes shifted to its high nibbles.
        let shifts = _mm512_set_epi64(
            0x0004_0004_0004_0004,
            0x0004_0004_0004_0004,
            0,
            0,
            0x0004_0004_0004_0004,
            0x0004_0004_0004_0004,
            0,
            0,
        );
        let bias = _mm512_set1_ps(128.0);
        let blocks = ws[0].len() / BLOCK_BYTES;
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        for p in 0..blocks / 2 {
            let (q, g) = (2 * p * ACT_BLOCK, 2 * p * ACT_BLOCK / ACT_GROUP);
            let mut xq = [_mm512_setzero_si512(); R];
            let mut offset = [_mm512_setzero_si512(); R];
            let mut d = [_mm512_setzero_ps(); R];
            for (r, x) in xs.iter().enumerate() {
                xq[r] = _mm512_loadu_si512(x.quants.as_ptr().add(q) as *const __m512i);
                let neg = _mm512_loadu_si512(x.neg_group_sums.as_ptr().add(g) as *const __m512i);
                offset[r] = _mm512_slli_epi32::<{ OFFSET_LOG2 as u32 }>(neg);
                d[r] = _mm512_loadu_ps(x.scales.as_ptr().add(g));
            }
            for (j, w) in ws.iter().enumerate() {
                let pair = w.as_ptr().add(2 * p * BLOCK_BYTES) as *const i8;
                let v = _mm512_maskz_loadu_epi8((1u64 << (2 * BLOCK_BYTES)) - 1, pair);
                let raw = _mm512_permutexvar_epi8(code_bytes, v);
                let n = _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), nibble);
                let codes = _mm512_shuffle_epi8(table, n);
                let e = _mm512_maskz_permutexvar_epi8(EXPONENT_MASK, exponent_bytes, v);
                // 2^(e − 128) · d, rounded once as `mxfp4_half_scale(e) · d` is.
                let exponent = _mm512_sub_ps(_mm512_cvtepi32_ps(e), bias);
                for r in 0..R {
                    let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(offset[r], codes, xq[r]));
                    let sd = _mm512_scalef_ps(d[r], exponent);
                    let a = _mm256_fmadd_ps(
                        _mm512_castps512_ps256(sums),
                        _mm512_castps512_ps256(sd),
                        acc[j][r],
                    );
                    acc[j][r] = _mm256_fmadd_ps(
                        _mm512_extractf32x8_ps::<1>(sums),
                        _mm512_extractf32x8_ps::<1>(sd),
                        a,
                    );
                }
            }
        }
        if blocks % 2 == 1 {
            let b = blocks - 1;
            let table = _mm256_set_m128i(table128, table128);
            let nibble = _mm256_set1_epi8(0x0F);
            for (j, w) in ws.iter().enumerate() {
                block_dot(&w[b * BLOCK_BYTES..], b, (table, nibble), xs, &mut acc[j]);
            }
        }
        acc.map(|a| finish(a))
    }
}
