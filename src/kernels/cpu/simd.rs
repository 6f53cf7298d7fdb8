//! The few vector primitives the CPU kernels are built from, with AVX2+FMA paths chosen
//! once at run time (the binary stays portable) and scalar fallbacks.

use crate::sync::OnceLock;

/// The vector paths the CPU kernels take, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuPath {
    Scalar,
    Avx2,
    Avx512,
    /// AVX-512 with VNNI (and VL): one instruction for the packed kernels' 8-bit dots.
    Avx512Vnni,
}

impl CpuPath {
    pub fn name(self) -> &'static str {
        match self {
            CpuPath::Scalar => "scalar",
            CpuPath::Avx2 => "avx2",
            CpuPath::Avx512 => "avx512",
            CpuPath::Avx512Vnni => "avx512vnni",
        }
    }
}

/// The best path this CPU has, capped by `TROUPE_MAX_CPU_ISA` (`scalar`, `avx2`,
/// `avx512`, `avx512vnni`: what an older CPU would take, for benchmarks and tests on this one). An
/// unknown value is named in a warning and ignored.
pub fn cpu_path() -> CpuPath {
    static PATH: OnceLock<CpuPath> = OnceLock::new();
    *PATH.get_or_init(|| {
        let detected = detect();
        let cap = match std::env::var("TROUPE_MAX_CPU_ISA").as_deref() {
            Err(_) => CpuPath::Avx512Vnni,
            Ok("scalar") => CpuPath::Scalar,
            Ok("avx2") => CpuPath::Avx2,
            Ok("avx512") => CpuPath::Avx512,
            Ok("avx512vnni") => CpuPath::Avx512Vnni,
            Ok(other) => {
                tracing::warn!(
                    "TROUPE_MAX_CPU_ISA={other:?} is not one of scalar, avx2, avx512, avx512vnni: ignored"
                );
                CpuPath::Avx512Vnni
            }
        };
        detected.min(cap)
    })
}

fn detect() -> CpuPath {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                return CpuPath::Avx512Vnni;
            }
            return CpuPath::Avx512;
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return CpuPath::Avx2;
        }
    }
    CpuPath::Scalar
}

/// AVX2, FMA and F16C, on a CPU that has them (every AVX-512 CPU does).
pub fn has_avx2_fma() -> bool {
    cpu_path() >= CpuPath::Avx2
}

pub fn has_avx512() -> bool {
    cpu_path() >= CpuPath::Avx512
}

/// `Σ a[i]·b[i]`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_scalar(a, b)
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums so LLVM can vectorize without reassociating a single chain.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads 8 floats below `n`.
    unsafe {
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let off = i + 8 * k;
                *acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(off)),
                    _mm256_loadu_ps(pb.add(off)),
                    *acc,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let hi = _mm256_extractf128_ps(s, 1);
        let lo = _mm256_castps256_ps128(s);
        let s4 = _mm_add_ps(hi, lo);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        let mut sum = _mm_cvtss_f32(s1);
        while i < n {
            sum += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        sum
    }
}

/// `acc[d] += Σ_s w[s] · rows[s · stride + d]`, `s` in order, each step a multiply then an
/// add (not fused: the bits of the plain loop, on every path). Attention's weighted sum of
/// V rows: the vector path keeps 64 accumulators in registers across the rows instead of
/// loading and storing them for every row.
pub fn accumulate_rows(acc: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    if let Some(last) = w.len().checked_sub(1) {
        assert!(rows.len() >= last * stride + acc.len(), "rows too short");
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 (checked above); `rows` covers every read (asserted).
        return unsafe { accumulate_rows_avx2(acc, w, rows, stride) };
    }
    accumulate_rows_scalar(acc, w, rows, stride);
}

fn accumulate_rows_scalar(acc: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    for (s, &p) in w.iter().enumerate() {
        for (d, a) in acc.iter_mut().enumerate() {
            *a += p * rows[s * stride + d];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_rows_avx2(acc: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    const REGS: usize = 8;
    let hd = acc.len();
    let mut d = 0;
    // SAFETY: the caller checked that rows[s · stride + d] exists for every s < w.len(),
    // d < acc.len(); loads and stores stay below those bounds.
    unsafe {
        while d < hd {
            let width = (hd - d) / LANES;
            if width == 0 {
                break;
            }
            let regs = width.min(REGS);
            let mut a = [_mm256_setzero_ps(); REGS];
            for (r, a) in a.iter_mut().enumerate().take(regs) {
                *a = _mm256_loadu_ps(acc.as_ptr().add(d + r * LANES));
            }
            for (s, &p) in w.iter().enumerate() {
                let p = _mm256_set1_ps(p);
                let row = rows.as_ptr().add(s * stride + d);
                for (r, a) in a.iter_mut().enumerate().take(regs) {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(p, _mm256_loadu_ps(row.add(r * LANES))));
                }
            }
            for (r, a) in a.iter().enumerate().take(regs) {
                _mm256_storeu_ps(acc.as_mut_ptr().add(d + r * LANES), *a);
            }
            d += regs * LANES;
        }
    }
    for (s, &p) in w.iter().enumerate() {
        for (dd, a) in acc.iter_mut().enumerate().skip(d) {
            *a += p * rows[s * stride + dd];
        }
    }
}

/// `v[i] *= c`, vectorized where the CPU allows (the product's bits are the same).
pub fn scale(v: &mut [f32], c: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 (checked above).
        return unsafe { scale_avx2(v, c) };
    }
    v.iter_mut().for_each(|x| *x *= c);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_avx2(v: &mut [f32], c: f32) {
    // Vectorized by LLVM under the enabled features.
    v.iter_mut().for_each(|x| *x *= c);
}

/// `v[i] = exp(v[i] - shift)` for `v[i] ≤ shift` (softmax weights), and their sum. The
/// vector path is Cephes' single-precision exp (range reduction by ln 2, a degree-5
/// polynomial: within 2 ulp of libm's), eight lanes at a time, the tail through the same
/// lanes; arguments below -87 give 2^-125.5 instead of their subnormal or zero, a
/// difference under 2^-125 in a weight summed with at least one 1.
pub fn exp_shifted(v: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { exp_shifted_avx2(v, shift) };
    }
    let mut sum = 0.0;
    for x in v.iter_mut() {
        *x = (*x - shift).exp();
        sum += *x;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(v: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: AVX2 and FMA are enabled wherever this is inlined.
        unsafe {
            let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            // ln 2 in two parts, so that n · ln2_hi is exact.
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
            let mut p = _mm256_set1_ps(1.987_569_1e-4);
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let y = _mm256_fmadd_ps(
                _mm256_mul_ps(p, r),
                r,
                _mm256_add_ps(r, _mm256_set1_ps(1.0)),
            );
            let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
        }
    }
    let shift8 = _mm256_set1_ps(shift);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c holds 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), shift8));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let tail = chunks.into_remainder();
    let mut lanes = [shift - 200.0; 8]; // unused lanes: 2^-125.5, not added
    lanes[..tail.len()].copy_from_slice(tail);
    // SAFETY: lanes holds 8 floats.
    let e = unsafe { exp8(_mm256_sub_ps(_mm256_loadu_ps(lanes.as_ptr()), shift8)) };
    let mut out = [0f32; 8];
    // SAFETY: out holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), e) };
    tail.copy_from_slice(&out[..tail.len()]);
    let mut lane_sums = [0f32; 8];
    // SAFETY: lane_sums holds 8 floats.
    unsafe { _mm256_storeu_ps(lane_sums.as_mut_ptr(), acc) };
    lane_sums.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_shifted_matches_f64_exp_and_sums_its_weights() {
        for n in [0usize, 1, 7, 8, 9, 33, 300] {
            let v: Vec<f32> = (0..n)
                .map(|i| -((i * 37 % 101) as f32) * 0.93 + 0.5)
                .collect();
            let shift = 0.5;
            let mut got = v.clone();
            let sum = exp_shifted(&mut got, shift);
            let mut want_sum = 0f64;
            for (g, x) in got.iter().zip(&v) {
                let want = ((*x - shift) as f64).exp();
                want_sum += if want < 1e-37 { 0.0 } else { want };
                let err = (*g as f64 - want).abs();
                assert!(
                    err <= want * 3e-7 || err < 1e-37,
                    "exp({x} - {shift}): {g} vs {want}"
                );
            }
            assert!(
                (sum as f64 - want_sum).abs() <= want_sum * 1e-6 + 1e-37,
                "n={n}"
            );
        }
    }

    #[test]
    fn accumulate_rows_keeps_the_plain_loops_bits_at_every_width() {
        for (hd, n, stride) in [
            (64usize, 17usize, 192usize),
            (128, 3, 128),
            (72, 5, 80),
            (5, 4, 9),
            (0, 2, 3),
        ] {
            let rows: Vec<f32> = (0..n * stride)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let w: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.3)).collect();
            let start: Vec<f32> = (0..hd).map(|i| i as f32 * 0.01 - 0.3).collect();
            let mut got = start.clone();
            accumulate_rows(&mut got, &w, &rows, stride);
            let mut want = start;
            accumulate_rows_scalar(&mut want, &w, &rows, stride);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "hd {hd}, {n} rows");
        }
    }

    #[test]
    fn dot_matches_scalar_reference_at_odd_lengths() {
        for n in [0usize, 1, 7, 8, 31, 32, 33, 100, 577] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-3, "n={n}");
        }
    }
}
