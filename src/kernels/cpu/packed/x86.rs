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
        [*o] = unsafe { dot::<F, R, 1, false>([row], xs) };
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn dot_vnni<F: BlockFormat, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; R],
    out: &mut [[f32; R]],
) {
    // Two weight rows at a time: each activation block and scale load then serves both,
    // and 32 registers hold the 2·R sums. A row's arithmetic is the same either way.
    if R < 4 {
        // A decode row: pairing its weight rows measured 1.4× slower.
        for (row, o) in w.chunks_exact(row_bytes).zip(out) {
            // SAFETY: as below.
            [*o] = unsafe { dot::<F, R, 1, true>([row], xs) };
        }
        return;
    }
    let mut rows = w.chunks_exact(row_bytes).zip(out.iter_mut());
    while let (Some((w0, o0)), Some((w1, o1))) = (rows.next(), rows.next()) {
        // SAFETY: as below.
        [*o0, *o1] = unsafe { dot::<F, R, 2, true>([w0, w1], xs) };
    }
    if out.len() % 2 == 1 {
        let last = out.len() - 1;
        // SAFETY: the features `dot` needs are enabled here; the caller checked shapes.
        [out[last]] = unsafe { dot::<F, R, 1, true>([&w[last * row_bytes..]], xs) };
    }
}

/// `W` weight rows of one length (whole blocks; activation rows at least as long, checked
/// by the caller). Inlined into the entry points above, which enable its instructions; no
/// closures here (a closure would not inherit them, and its intrinsics become calls).
#[inline(always)]
unsafe fn dot<F: BlockFormat, const R: usize, const W: usize, const VNNI: bool>(
    ws: [&[u8]; W],
    xs: [Q8Row<'_>; R],
) -> [[f32; R]; W] {
    let blocks = ws[0].len() / F::BYTES;
    // SAFETY: the caller's `check_shapes` bounds every block and activation index below.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        let mut min_acc = [[_mm_setzero_ps(); R]; W];
        let (mut scales, mut mins) = ([[0f32; 16]; W], [[0f32; 16]; W]);
        let mut q = [_mm256_setzero_si256(); W];
        let mut q_unsigned = [_mm256_setzero_si256(); W];
        let mut scale = [_mm256_setzero_ps(); W];
        for b in 0..blocks {
            for v in 0..W {
                let blk = &ws[v][b * F::BYTES..(b + 1) * F::BYTES];
                F::scales::<F16c>(blk, &mut scales[v], &mut mins[v]);
            }
            for sub in 0..F::SUBS {
                let g = b * F::SUBS + sub;
                for v in 0..W {
                    q[v] = F::quants_avx2(ws[v].as_ptr().add(b * F::BYTES), sub);
                    scale[v] = if F::HALF_SCALES {
                        _mm256_set_m128(
                            _mm_set1_ps(scales[v][2 * sub + 1]),
                            _mm_set1_ps(scales[v][2 * sub]),
                        )
                    } else {
                        _mm256_set1_ps(scales[v][2 * sub])
                    };
                    q_unsigned[v] = if F::SIGNED {
                        _mm256_abs_epi8(q[v])
                    } else {
                        q[v]
                    };
                }
                for (r, x) in xs.iter().enumerate() {
                    let xq0 =
                        _mm256_loadu_si256(x.quants.as_ptr().add(g * ACT_BLOCK) as *const __m256i);
                    let xd = _mm256_loadu_ps(x.scales.as_ptr().add(g * 8));
                    for v in 0..W {
                        // q·x = |q| · (x with q's sign), the unsigned × signed form both
                        // instructions take; |q| ≤ 128 and |x| ≤ 127 keep `maddubs` exact.
                        let xq = if F::SIGNED {
                            _mm256_sign_epi8(xq0, q[v])
                        } else {
                            xq0
                        };
                        let sums = if VNNI {
                            _mm256_dpbusd_epi32(_mm256_setzero_si256(), q_unsigned[v], xq)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(q_unsigned[v], xq), ones)
                        };
                        let step = _mm256_mul_ps(scale[v], xd);
                        acc[v][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), step, acc[v][r]);
                        if F::HAS_MIN {
                            // Both halves in two lanes: one chain, not two dependent scalar
                            // FMAs. (Built from registers: a wide load of two narrow stores
                            // stalls.)
                            let m = if F::HALF_SCALES {
                                _mm_setr_ps(mins[v][2 * sub], mins[v][2 * sub + 1], 0.0, 0.0)
                            } else {
                                _mm_set1_ps(mins[v][2 * sub])
                            };
                            let s = _mm_castpd_ps(_mm_load_sd(
                                x.sums.as_ptr().add(2 * g) as *const f64
                            ));
                            min_acc[v][r] = _mm_fmadd_ps(m, s, min_acc[v][r]);
                        }
                    }
                }
            }
        }
        let mut out = [[0f32; R]; W];
        for v in 0..W {
            for r in 0..R {
                let m = min_acc[v][r];
                out[v][r] =
                    hsum(acc[v][r]) + (_mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_movehdup_ps(m)));
            }
        }
        out
    }
}

/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, the order `dot_scalar` mirrors.
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX is enabled wherever this is inlined.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }
}
