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

use super::{ACT_BLOCK, ACT_GROUP, Q8Row, check_shapes};
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
    // SAFETY: AVX-512 F/VL/VNNI are present (asserted); shapes are checked above.
    unsafe { dot_mxfp4::<R>(w, row_bytes, xs, out) }
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
        // `+ 0.0`: the shared kernel adds its (here empty) min lanes, which turns a −0 sum
        // into +0; the same bits need the same addition.
        std::array::from_fn(|r| super::x86::hsum(acc[r]) + 0.0)
    }
}
