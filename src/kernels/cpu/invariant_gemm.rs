//! The batch-invariant matmul: `out[i][j] = Σ_k x[i][k] · w[j][k]` where every output
//! element is one FMA chain over k in increasing order. Weight rows are expanded to f32
//! and transposed into k-major panels of `PANEL` columns; the microkernel holds up to 4
//! activation rows × 32 columns in registers. Neither the number of rows, nor a row's
//! place in the batch, nor the panel it falls in changes any element's arithmetic — so a
//! request's logits are bitwise the same alone, in any batch, and in any prefill chunking.

use std::cell::RefCell;

use rayon::prelude::*;

use super::qmatrix::{CpuMatrix, PANEL};
use super::simd::{has_avx2_fma, has_avx512};

/// Activation rows per microkernel call.
const ROWS: usize = 4;

thread_local! {
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each panel writes only its own columns of `out`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

pub fn matmul_invariant(x: &[f32], m: usize, w: &CpuMatrix, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert!(
        x.len() >= m * k && out.len() >= m * n,
        "matmul shape mismatch"
    );
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(PANEL)).into_par_iter().for_each(|panel| {
        let first = panel * PANEL;
        let cols = PANEL.min(n - first);
        SCRATCH.with_borrow_mut(|(row, scratch)| {
            let wt: &[f32] = match w {
                // Resident panels (batch-invariant backend): nothing to expand.
                CpuMatrix::Panels { data, .. } => &data[panel * k * PANEL..(panel + 1) * k * PANEL],
                _ => {
                    row.resize(k, 0.0);
                    scratch.clear();
                    scratch.resize(k * PANEL, 0.0);
                    for c in 0..cols {
                        w.dequantize_row(first + c, row);
                        for (kk, &v) in row.iter().enumerate() {
                            scratch[kk * PANEL + c] = v;
                        }
                    }
                    scratch
                }
            };
            let mut i = 0;
            while i < m {
                let rows = ROWS.min(m - i);
                let mut acc = [[0f32; PANEL]; ROWS];
                microkernel(&x[i * k..(i + rows) * k], rows, k, wt, &mut acc);
                for (r, acc) in acc.iter().take(rows).enumerate() {
                    for (c, &v) in acc.iter().take(cols).enumerate() {
                        // SAFETY: (i + r, first + c) lies in `out` and belongs to this panel.
                        unsafe { *out_ptr.get().add((i + r) * n + first + c) = v };
                    }
                }
                i += rows;
            }
        });
    });
}

/// `acc[r][c] = Σ_kk x[r][kk] · wt[kk][c]`, one FMA chain per element in kk order.
fn microkernel(x: &[f32], rows: usize, k: usize, wt: &[f32], acc: &mut [[f32; PANEL]; ROWS]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F is present; `x` holds `rows` rows of `k`, `wt` k rows of PANEL.
        unsafe { microkernel_avx512(x, rows, k, wt, acc) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present; `x` holds `rows` rows of `k`, `wt` k rows of PANEL.
        unsafe { microkernel_avx2(x, rows, k, wt, acc) };
        return;
    }
    microkernel_scalar(x, rows, k, wt, acc);
}

fn microkernel_scalar(
    x: &[f32],
    rows: usize,
    k: usize,
    wt: &[f32],
    acc: &mut [[f32; PANEL]; ROWS],
) {
    for (r, acc) in acc.iter_mut().take(rows).enumerate() {
        for kk in 0..k {
            let xv = x[r * k + kk];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = xv.mul_add(wt[kk * PANEL + c], *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn microkernel_avx512(
    x: &[f32],
    rows: usize,
    k: usize,
    wt: &[f32],
    acc: &mut [[f32; PANEL]; ROWS],
) {
    use std::arch::x86_64::*;
    // SAFETY: every load stays inside `x` (rows × k) and `wt` (k × PANEL).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); 2]; ROWS];
        let wp = wt.as_ptr();
        let xp = x.as_ptr();
        for kk in 0..k {
            let w0 = _mm512_loadu_ps(wp.add(kk * PANEL));
            let w1 = _mm512_loadu_ps(wp.add(kk * PANEL + 16));
            for (r, a) in a.iter_mut().enumerate().take(rows) {
                let xb = _mm512_set1_ps(*xp.add(r * k + kk));
                a[0] = _mm512_fmadd_ps(xb, w0, a[0]);
                a[1] = _mm512_fmadd_ps(xb, w1, a[1]);
            }
        }
        for (r, a) in a.iter().enumerate().take(rows) {
            _mm512_storeu_ps(acc[r].as_mut_ptr(), a[0]);
            _mm512_storeu_ps(acc[r].as_mut_ptr().add(16), a[1]);
        }
    }
}

/// `microkernel_avx512` in eight lanes: each element still one fused FMA chain in kk
/// order, so every path gives the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn microkernel_avx2(
    x: &[f32],
    rows: usize,
    k: usize,
    wt: &[f32],
    acc: &mut [[f32; PANEL]; ROWS],
) {
    use std::arch::x86_64::*;
    // SAFETY: every load stays inside `x` (rows × k) and `wt` (k × PANEL).
    unsafe {
        let mut a = [[_mm256_setzero_ps(); 4]; ROWS];
        let wp = wt.as_ptr();
        let xp = x.as_ptr();
        for kk in 0..k {
            let w = [0, 8, 16, 24].map(|c| _mm256_loadu_ps(wp.add(kk * PANEL + c)));
            for (r, a) in a.iter_mut().enumerate().take(rows) {
                let xb = _mm256_set1_ps(*xp.add(r * k + kk));
                for (a, w) in a.iter_mut().zip(w) {
                    *a = _mm256_fmadd_ps(xb, w, *a);
                }
            }
        }
        for (r, a) in a.iter().enumerate().take(rows) {
            for (j, a) in a.iter().enumerate() {
                _mm256_storeu_ps(acc[r].as_mut_ptr().add(8 * j), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path of the microkernel gives the scalar chain's bits.
    #[test]
    fn every_microkernel_path_gives_the_scalar_bits() {
        let k = 37;
        let rows = ROWS - 1;
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let wt: Vec<f32> = (0..k * PANEL)
            .map(|i| ((i * 31 % 41) as f32 - 20.0) / 17.0)
            .collect();
        let mut want = [[0f32; PANEL]; ROWS];
        microkernel_scalar(&x, rows, k, &wt, &mut want);
        let mut got = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if has_avx2_fma() {
            let mut acc = [[0f32; PANEL]; ROWS];
            // SAFETY: AVX2 and FMA are present; the shapes match.
            unsafe { microkernel_avx2(&x, rows, k, &wt, &mut acc) };
            got.push(("avx2", acc));
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx512() {
            let mut acc = [[0f32; PANEL]; ROWS];
            // SAFETY: AVX-512F is present; the shapes match.
            unsafe { microkernel_avx512(&x, rows, k, &wt, &mut acc) };
            got.push(("avx512", acc));
        }
        for (path, acc) in got {
            for r in 0..rows {
                let bits = |a: &[f32; PANEL]| a.map(f32::to_bits);
                assert_eq!(bits(&acc[r]), bits(&want[r]), "{path} row {r}");
            }
        }
    }
}
