//! The f32-activation row dots of `--exact-activations`: Q4_1 nibbles and Q8_0 quants
//! expanded to f32 inside the dot (AVX-512, AVX2+FMA, scalar), so the arithmetic is the
//! dequantized model's but for the order of the additions.

use super::simd::{has_avx2_fma, has_avx512};

/// Elements per Q4_1 / Q8_0 block.
pub const QBLOCK: usize = 32;

/// `Σ x` over each 32-block of `x`.
pub fn block_sums(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(QBLOCK).map(|b| b.iter().sum::<f32>()));
}

/// `Σ_b d[b] · Σ_j q[b][j] · x[b][j]` over Q4_1 nibbles (the `m` term is added apart),
/// for `R` activation rows at once: each block's nibbles are expanded once and used by
/// every row. Row `i`'s result comes from the same operations in the same order whatever
/// `R` is and whichever rows share the call — the batch-invariance of the CPU matmul
/// rests on this.
#[inline]
pub fn dot_q4_1_rows<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F is present (checked above); slices hold whole blocks.
        return unsafe { dot_q4_1_avx512::<R>(d, nibbles, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present (checked above); slices hold whole blocks.
        return unsafe { dot_q4_1_avx2::<R>(d, nibbles, xs) };
    }
    xs.map(|x| dot_q4_1_scalar(d, nibbles, x))
}

#[inline]
pub fn dot_q4_1(d: &[f32], nibbles: &[u8], x: &[f32]) -> f32 {
    dot_q4_1_rows::<1>(d, nibbles, [x])[0]
}

pub fn dot_q4_1_scalar(d: &[f32], nibbles: &[u8], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for (b, &d) in d.iter().enumerate() {
        let qs = &nibbles[b * 16..(b + 1) * 16];
        let xb = &x[b * QBLOCK..(b + 1) * QBLOCK];
        let mut s = 0f32;
        for j in 0..16 {
            s += (qs[j] & 0xF) as f32 * xb[j] + (qs[j] >> 4) as f32 * xb[j + 16];
        }
        total += d * s;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q4_1_avx512<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mask = _mm_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: block b reads nibbles[16b..16b+16] and x[32b..32b+32], inside the slices.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let raw = _mm_loadu_si128(nibbles.as_ptr().add(b * 16) as *const __m128i);
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            let q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            let q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            let scale = _mm512_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let p = _mm512_fmadd_ps(
                    q_hi,
                    _mm512_loadu_ps(xp.add(16)),
                    _mm512_mul_ps(q_lo, _mm512_loadu_ps(xp)),
                );
                // Two accumulators break the FMA dependency chain across blocks.
                acc[b & 1] = _mm512_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }
}

/// `Σ_b d[b] · Σ_j q[b][j] · x[b][j]` over Q8_0 quants, for `R` rows at once (see
/// `dot_q4_1_rows` for why the result of a row does not depend on `R`).
#[inline]
pub fn dot_q8_0_rows<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F is present (checked above); slices hold whole blocks.
        return unsafe { dot_q8_0_avx512::<R>(d, quants, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present (checked above); slices hold whole blocks.
        return unsafe { dot_q8_0_avx2::<R>(d, quants, xs) };
    }
    xs.map(|x| dot_q8_0_scalar(d, quants, x))
}

#[inline]
pub fn dot_q8_0(d: &[f32], quants: &[i8], x: &[f32]) -> f32 {
    dot_q8_0_rows::<1>(d, quants, [x])[0]
}

pub fn dot_q8_0_scalar(d: &[f32], quants: &[i8], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for (b, &d) in d.iter().enumerate() {
        let s: f32 = (0..QBLOCK)
            .map(|j| quants[b * QBLOCK + j] as f32 * x[b * QBLOCK + j])
            .sum();
        total += d * s;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q8_0_avx512<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: block b reads quants and x at [32b, 32b + 32), inside the slices.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let qp = quants.as_ptr().add(b * QBLOCK) as *const __m128i;
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp.add(1))));
            let scale = _mm512_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let p = _mm512_fmadd_ps(
                    q1,
                    _mm512_loadu_ps(xp.add(16)),
                    _mm512_mul_ps(q0, _mm512_loadu_ps(xp)),
                );
                acc[b & 1] = _mm512_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }
}

/// The AVX2 twin of `dot_q4_1_avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_1_avx2<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mask = _mm_set1_epi8(0x0F);
    let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    // SAFETY: block b reads nibbles[16b..16b+16], inside the slice.
    let weights = |b: usize| unsafe {
        let raw = _mm_loadu_si128(nibbles.as_ptr().add(b * 16) as *const __m128i);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        [
            widen(lo),
            widen(_mm_srli_si128(lo, 8)),
            widen(hi),
            widen(_mm_srli_si128(hi, 8)),
        ]
    };
    // SAFETY: AVX2 and FMA are enabled here; `weights` covers every block of `d`.
    unsafe { dot_blocks_avx2(d, xs, weights) }
}

/// The AVX2 twin of `dot_q8_0_avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q8_0_avx2<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    // SAFETY: block b reads quants[32b..32b+32], inside the slice.
    let weights = |b: usize| unsafe {
        let qp = quants.as_ptr().add(b * QBLOCK);
        [0, 8, 16, 24].map(|o| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                qp.add(o) as *const __m128i
            )))
        })
    };
    // SAFETY: AVX2 and FMA are enabled here; `weights` covers every block of `d`.
    unsafe { dot_blocks_avx2(d, xs, weights) }
}

/// `Σ_b d[b] · Σ_j w[b][j] · x[b][j]` for `R` rows, block b's 32 weights from `weights(b)`
/// (four vectors of eight), expanded once for every row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_blocks_avx2<const R: usize>(
    d: &[f32],
    xs: [&[f32]; R],
    weights: impl Fn(usize) -> [std::arch::x86_64::__m256; 4],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: block b reads x[32b..32b+32], inside each row.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let q = weights(b);
            let scale = _mm256_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let mut p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), p);
                p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), p);
                p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), p);
                // Two accumulators break the FMA dependency chain across blocks.
                acc[b & 1] = _mm256_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| hsum256(_mm256_add_ps(a[0], a[1])))
    }
}

/// The sum of an AVX register's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(nb: usize) -> (Vec<f32>, Vec<u8>, Vec<i8>, [Vec<f32>; 2]) {
        let d: Vec<f32> = (0..nb).map(|b| 0.01 * (b as f32 + 1.0)).collect();
        let bits = |i: usize| crate::sampling::splitmix64(i as u64);
        let nibbles = (0..nb * 16).map(|i| bits(i) as u8).collect();
        let quants = (0..nb * QBLOCK).map(|i| bits(7 + i) as i8).collect();
        let x = |s: usize| {
            (0..nb * QBLOCK)
                .map(|i| ((i * 7 + s) % 23) as f32 / 11.0 - 1.0)
                .collect()
        };
        (d, nibbles, quants, [x(0), x(5)])
    }

    /// A path's name, its Q4_1 and Q8_0 dots of two rows, and the second row's alone.
    type PathDots = (&'static str, [f32; 2], [f32; 2], f32, f32);

    /// Each vector path this CPU has against the scalar one, and a row's bits the same
    /// whichever rows share the call (the batch-invariant matmul rests on it).
    #[test]
    fn every_vector_path_matches_the_scalar_dot_and_keeps_rows_apart() {
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        for nb in [1, 2, 9] {
            let (d, nibbles, quants, [x0, x1]) = blocks(nb);
            let want_q4 = [0, 1].map(|i| dot_q4_1_scalar(&d, &nibbles, [&x0, &x1][i]));
            let want_q8 = [0, 1].map(|i| dot_q8_0_scalar(&d, &quants, [&x0, &x1][i]));
            let mut paths: Vec<PathDots> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                // SAFETY: AVX2 and FMA are present; the slices hold whole blocks.
                unsafe {
                    paths.push((
                        "avx2",
                        dot_q4_1_avx2::<2>(&d, &nibbles, [&x0, &x1]),
                        dot_q8_0_avx2::<2>(&d, &quants, [&x0, &x1]),
                        dot_q4_1_avx2::<1>(&d, &nibbles, [&x1])[0],
                        dot_q8_0_avx2::<1>(&d, &quants, [&x1])[0],
                    ));
                }
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx512() {
                // SAFETY: AVX-512F is present; the slices hold whole blocks.
                unsafe {
                    paths.push((
                        "avx512",
                        dot_q4_1_avx512::<2>(&d, &nibbles, [&x0, &x1]),
                        dot_q8_0_avx512::<2>(&d, &quants, [&x0, &x1]),
                        dot_q4_1_avx512::<1>(&d, &nibbles, [&x1])[0],
                        dot_q8_0_avx512::<1>(&d, &quants, [&x1])[0],
                    ));
                }
            }
            for (path, q4, q8, q4_alone, q8_alone) in paths {
                for i in 0..2 {
                    assert!(close(q4[i], want_q4[i]), "{path} q4_1 {nb} blocks row {i}");
                    assert!(close(q8[i], want_q8[i]), "{path} q8_0 {nb} blocks row {i}");
                }
                assert_eq!(q4[1].to_bits(), q4_alone.to_bits(), "{path} q4_1 row apart");
                assert_eq!(q8[1].to_bits(), q8_alone.to_bits(), "{path} q8_0 row apart");
            }
        }
    }
}
