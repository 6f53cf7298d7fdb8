//! `out[m, n] = x[m, k] · wᵀ` with `w` stored `[n, k]` (one row per output feature).
//!
//! Decode (few rows) is bandwidth-bound: each weight row is streamed once and dotted with
//! every activation row while it is in cache, rows split across threads. Prefill (many
//! rows) is compute-bound and goes to the `gemm` crate's packed, blocked kernels.

use rayon::prelude::*;

use super::simd::dot;

/// Above this many activation rows, packing for a blocked GEMM pays for itself.
const GEMV_MAX_ROWS: usize = 8;
/// Weight rows per parallel task: enough to amortize scheduling, few enough to balance.
const ROWS_PER_TASK: usize = 32;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint columns of `out`; the pointer outlives the parallel scope.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

pub fn matmul(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matmul shape mismatch");
    if m <= GEMV_MAX_ROWS {
        gemv_rows(x, m, w, n, k, out);
    } else {
        // SAFETY: the asserts above bound every index the strides reach.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            );
        }
    }
}

fn gemv_rows(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    let out_ptr = OutPtr(out.as_mut_ptr());
    w[..n * k]
        .par_chunks(ROWS_PER_TASK * k)
        .enumerate()
        .for_each(|(task, w_rows)| {
            let out_ptr = out_ptr;
            let first_row = task * ROWS_PER_TASK;
            for (r, w_row) in w_rows.chunks_exact(k).enumerate() {
                let j = first_row + r;
                for i in 0..m {
                    let v = dot(&x[i * k..(i + 1) * k], w_row);
                    // SAFETY: (i, j) is written by this task only, and i < m, j < n.
                    unsafe { *out_ptr.0.add(i * n + j) = v };
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn both_paths_match_naive_product() {
        for &(m, n, k) in &[(1, 70, 33), (3, 65, 64), (8, 31, 100), (9, 40, 17), (37, 129, 96)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 13 % 19) as f32 - 9.0) / 9.0).collect();
            let mut out = vec![f32::NAN; m * n];
            matmul(&x, m, &w, n, k, &mut out);
            let want = naive(&x, m, &w, n, k);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "m={m} n={n} k={k}: {a} vs {b}");
            }
        }
    }
}
