//! The AVX2 and AVX-512 VNNI kernels of `packed`: one body, two instruction choices for
//! the 4-element integer sums (`maddubs` + `madd`, or one `vpdpbusd`). Both are exact,
//! so the paths give the same bits.

use std::arch::x86_64::*;

use super::formats::{BlockFormat, F16c};
use super::{ACT_BLOCK, Q8Row, check_shapes};
use crate::kernels::cpu::simd::{CpuPath, cpu_path};

/// Only handed out by `row_dot` when `cpu_path()` is AVX2 or better.
pub(super) fn dot_avx2_checked<F: BlockFormat, const R: usize>(
    w: &[u8],
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    assert!(cpu_path() >= CpuPath::Avx2);
    let row_bytes = check_shapes::<F, R>(w, out.len(), &xs);
    // SAFETY: AVX2, FMA and F16C are present (asserted); shapes are checked above.
    unsafe { dot_avx2::<F, R>(w, row_bytes, xs, out) }
}

/// Only handed out by `row_dot` when `cpu_path()` is AVX-512 VNNI.
pub(super) fn dot_vnni_checked<F: BlockFormat, const R: usize>(
    w: &[u8],
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    assert!(cpu_path() >= CpuPath::Avx512Vnni);
    let row_bytes = check_shapes::<F, R>(w, out.len(), &xs);
    // SAFETY: AVX-512 F/VL/VNNI are present (asserted); shapes are checked above.
    unsafe { dot_vnni::<F, R>(w, row_bytes, xs, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2<F: BlockFormat, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out) {
        // SAFETY: the features `dot` needs are enabled here; the caller checked shapes.
        *o = unsafe { dot::<F, R, false>(row, xs) };
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn dot_vnni<F: BlockFormat, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out) {
        // SAFETY: the features `dot` needs are enabled here; the caller checked shapes.
        *o = unsafe { dot::<F, R, true>(row, xs) };
    }
}

/// One weight row (whole blocks; activation rows at least as long, checked by the
/// caller). Inlined into the two entry points above, which enable its instructions.
#[inline(always)]
unsafe fn dot<F: BlockFormat, const R: usize, const VNNI: bool>(
    w: &[u8],
    xs: [Q8Row<'_>; R],
) -> [f32; R] {
    let blocks = w.len() / F::BYTES;
    // SAFETY: the caller's `check_shapes` bounds every block and activation index below.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut min_acc = [_mm_setzero_ps(); R];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        for b in 0..blocks {
            let blk = &w[b * F::BYTES..(b + 1) * F::BYTES];
            F::scales::<F16c>(blk, &mut scales, &mut mins);
            for sub in 0..F::SUBS {
                let q = F::quants_avx2(blk.as_ptr(), sub);
                let g = b * F::SUBS + sub;
                let scale = if F::HALF_SCALES {
                    _mm256_set_m128(
                        _mm_set1_ps(scales[2 * sub + 1]),
                        _mm_set1_ps(scales[2 * sub]),
                    )
                } else {
                    _mm256_set1_ps(scales[2 * sub])
                };
                let q_unsigned = if F::SIGNED { _mm256_abs_epi8(q) } else { q };
                for (r, x) in xs.iter().enumerate() {
                    let xq =
                        _mm256_loadu_si256(x.quants.as_ptr().add(g * ACT_BLOCK) as *const __m256i);
                    // q·x = |q| · (x with q's sign), the unsigned × signed form both
                    // instructions take; |q| ≤ 128 and |x| ≤ 127 keep `maddubs` exact.
                    let xq = if F::SIGNED {
                        _mm256_sign_epi8(xq, q)
                    } else {
                        xq
                    };
                    let sums = if VNNI {
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), q_unsigned, xq)
                    } else {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(q_unsigned, xq), ones)
                    };
                    let step = _mm256_mul_ps(scale, _mm256_loadu_ps(x.scales.as_ptr().add(g * 8)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), step, acc[r]);
                    if F::HAS_MIN {
                        // Both halves in two lanes: one chain, not two dependent scalar FMAs.
                        // (Built from registers: a wide load of two narrow stores stalls.)
                        let m = if F::HALF_SCALES {
                            _mm_setr_ps(mins[2 * sub], mins[2 * sub + 1], 0.0, 0.0)
                        } else {
                            _mm_set1_ps(mins[2 * sub])
                        };
                        let s =
                            _mm_castpd_ps(_mm_load_sd(x.sums.as_ptr().add(2 * g) as *const f64));
                        min_acc[r] = _mm_fmadd_ps(m, s, min_acc[r]);
                    }
                }
            }
        }
        std::array::from_fn(|r| {
            let m = min_acc[r];
            hsum(acc[r]) + (_mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_movehdup_ps(m)))
        })
    }
}

/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, the order `dot_scalar` mirrors.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX is enabled wherever this is inlined.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }
}
