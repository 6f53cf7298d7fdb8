//! `out[m, n] = x[m, k] · wᵀ` with `w` stored `[n, k]` (one row per output feature).
//!
//! Decode (few rows) is bandwidth-bound: each weight row is streamed once, in its
//! quantized form, and dotted with every activation row while it is in cache; rows are
//! split across threads. Prefill (many rows) is compute-bound: panels of weight rows are
//! expanded to f32 and multiplied by the `gemm` crate's packed, blocked kernels.

use std::cell::RefCell;

use rayon::prelude::*;

use super::packed::{Q8Act, row_dot};
use super::qmatrix::{CpuMatrix, QBLOCK, block_sums};

/// Above this many activation rows, a blocked GEMM beats row dots.
pub const GEMV_MAX_ROWS: usize = 8;
/// Weight rows per parallel task: enough to amortize scheduling, few enough to balance.
const ROWS_PER_TASK: usize = 32;
/// Activation rows swept together over a task's weight rows in the row-dot path.
const ACTIVATION_ROWS_PER_BLOCK: usize = 32;
/// Weight rows expanded to f32 at a time in the prefill path (bounded scratch).
const PANEL_ROWS: usize = 128;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint columns of `out`; the pointer outlives the parallel scope.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the `Send` wrapper, not its raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// With `batch_invariant`, every row takes the row-dot path whatever `m` is, so a row's
/// result is bitwise the same alone, in any batch, or in any prefill chunk.
pub fn matmul(x: &[f32], m: usize, w: &CpuMatrix, out: &mut [f32], batch_invariant: bool) {
    let (n, k) = (w.rows(), w.cols());
    assert!(
        x.len() >= m * k && out.len() >= m * n,
        "matmul shape mismatch"
    );
    if batch_invariant {
        super::invariant_gemm::matmul_invariant(x, m, w, out);
    } else if m <= GEMV_MAX_ROWS {
        gemv_rows(x, m, w, out);
    } else if let CpuMatrix::F32 { data, .. } = w {
        // SAFETY: the assert above bounds every index the strides reach.
        unsafe {
            gemm_f32(
                x,
                m,
                data,
                n,
                k,
                n,
                out.as_mut_ptr(),
                rayon::current_num_threads(),
            )
        };
    } else {
        gemm_panels(x, m, w, out);
    }
}

/// `dst[i * dst_stride + j] = Σ_t x[i, t] · w[j, t]` for `i < m`, `j < n`.
///
/// # Safety
/// `dst` must be valid for writes at those indices.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_f32(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    dst_stride: usize,
    dst: *mut f32,
    threads: usize,
) {
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: x is [m, k] with row stride k, w is [n, k] read transposed, dst per the contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_stride as isize,
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
            parallelism,
        );
    }
}

fn gemv_rows(x: &[f32], m: usize, w: &CpuMatrix, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    if let CpuMatrix::Packed {
        ggml_type, bytes, ..
    } = w
    {
        let (Some(dot4), Some(dot1)) = (row_dot::<4>(*ggml_type), row_dot::<1>(*ggml_type)) else {
            unreachable!("a Packed matrix is only made of a type with a row dot")
        };
        let row_bytes = bytes.len() / n;
        let weights = |j: usize| &bytes[j * row_bytes..(j + 1) * row_bytes];
        let mut act = Q8Act::default();
        act.quantize(x, m, k);
        sweep(
            m,
            n,
            out,
            |j, rows| dot4(weights(j), rows.map(|i| act.row(i))),
            |j, i| dot1(weights(j), [act.row(i)])[0],
        );
        return;
    }
    let nb = k / QBLOCK;
    let mut sums = Vec::new();
    if w.needs_block_sums() {
        let mut row = Vec::new();
        for i in 0..m {
            block_sums(&x[i * k..(i + 1) * k], &mut row);
            sums.extend_from_slice(&row);
        }
    }
    let x_row = |i: usize| &x[i * k..(i + 1) * k];
    let sum_row = |i: usize| {
        if sums.is_empty() {
            &[][..]
        } else {
            &sums[i * nb..(i + 1) * nb]
        }
    };
    sweep(
        m,
        n,
        out,
        |j, rows| w.dot_rows::<4>(j, rows.map(x_row), rows.map(sum_row)),
        |j, i| w.dot_rows::<1>(j, [x_row(i)], [sum_row(i)])[0],
    );
}

/// `out[i, j] = dot(j, i)` for `m` activation rows and `n` weight rows, weight rows split
/// across threads; `dot4` serves four activation rows at once.
fn sweep(
    m: usize,
    n: usize,
    out: &mut [f32],
    dot4: impl Fn(usize, [usize; 4]) -> [f32; 4] + Sync,
    dot1: impl Fn(usize, usize) -> f32 + Sync,
) {
    let out_ptr = OutPtr(out.as_mut_ptr());
    let tasks = n.div_ceil(ROWS_PER_TASK);
    (0..tasks).into_par_iter().for_each(|task| {
        let weight_rows = task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(n);
        // Activation rows in cache-sized blocks, each swept over the task's weight rows
        // (which stay in L1); within a block, four rows share each weight expansion.
        for block in (0..m).step_by(ACTIVATION_ROWS_PER_BLOCK) {
            let block_end = (block + ACTIVATION_ROWS_PER_BLOCK).min(m);
            for j in weight_rows.clone() {
                let mut i = block;
                while i + 4 <= block_end {
                    let rows = [i, i + 1, i + 2, i + 3];
                    let v = dot4(j, rows);
                    for (r, v) in rows.into_iter().zip(v) {
                        // SAFETY: (r, j) is written by this task only, and r < m, j < n.
                        unsafe { *out_ptr.get().add(r * n + j) = v };
                    }
                    i += 4;
                }
                for r in i..block_end {
                    let v = dot1(j, r);
                    // SAFETY: as above.
                    unsafe { *out_ptr.get().add(r * n + j) = v };
                }
            }
        }
    });
}

fn gemm_panels(x: &[f32], m: usize, w: &CpuMatrix, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(PANEL_ROWS))
        .into_par_iter()
        .for_each(|panel| {
            let first = panel * PANEL_ROWS;
            let rows = PANEL_ROWS.min(n - first);
            SCRATCH.with_borrow_mut(|buf| {
                buf.resize(PANEL_ROWS * k, 0.0);
                for r in 0..rows {
                    w.dequantize_row(first + r, &mut buf[r * k..(r + 1) * k]);
                }
                // SAFETY: this panel writes columns first..first + rows of every output row.
                unsafe { gemm_f32(x, m, buf, rows, k, n, out_ptr.get().add(first), 1) };
            });
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::GgmlType;
    use crate::kernels::{HostData, HostMatrix};

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Random blocks with sane f16 scales at the front of each block.
    fn random_blocks(ty: GgmlType, num_blocks: usize, seed: u64) -> Vec<u8> {
        let bb = ty.block_bytes();
        let mut bytes: Vec<u8> = (0..num_blocks * bb)
            .map(|i| crate::sampling::splitmix64(seed + i as u64) as u8)
            .collect();
        let scale_bytes = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4K) {
            4
        } else {
            2
        };
        for (b, blk) in bytes.chunks_exact_mut(bb).enumerate() {
            for s in (0..scale_bytes).step_by(2) {
                let v = 0.01 + 0.001 * ((b * 7 + s) % 13) as f32 - if s == 2 { 0.02 } else { 0.0 };
                blk[s..s + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn every_layout_and_path_matches_the_naive_product() {
        for ty in [GgmlType::F32, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K] {
            for &(m, n, k) in &[
                (1, 70, 64),
                (3, 65, 256),
                (8, 31, 256),
                (9, 40, 256),
                (37, 300, 512),
            ] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let data = if ty == GgmlType::F32 {
                    HostData::F32(
                        (0..n * k)
                            .map(|i| ((i * 13 % 19) as f32 - 9.0) / 9.0)
                            .collect(),
                    )
                } else {
                    if k % ty.block_len() != 0 {
                        continue;
                    }
                    HostData::Quantized {
                        ggml_type: ty,
                        bytes: random_blocks(ty, n * k / ty.block_len(), (m * n * k) as u64),
                    }
                };
                let w_f32 = match &data {
                    HostData::F32(v) => v.clone(),
                    HostData::Quantized { ggml_type, bytes } => {
                        let mut v = vec![0f32; n * k];
                        crate::kernels::quant::dequantize(*ggml_type, bytes, &mut v);
                        v
                    }
                    HostData::Random { .. } | HostData::Bf16(_) => {
                        unreachable!("the test makes f32 and quantized weights only")
                    }
                };
                let w = CpuMatrix::from_host(HostMatrix {
                    rows: n,
                    cols: k,
                    data,
                });
                let mut out = vec![f32::NAN; m * n];
                matmul(&x, m, &w, &mut out, false);
                let mut invariant = vec![f32::NAN; m * n];
                matmul(&x, m, &w, &mut invariant, true);
                let want = naive(&x, m, &w_f32, n, k);
                let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                for (a, b) in out.iter().chain(&invariant).zip(want.iter().cycle()) {
                    assert!(
                        (a - b).abs() < 1e-5 * scale * (k as f32).sqrt(),
                        "{ty:?} m={m} n={n} k={k}: {a} vs {b}"
                    );
                }
                if batch_invariant_rows_equal_alone(&x, m, &w, &invariant).is_err() {
                    panic!("{ty:?} m={m}: a row in the batch differs from the row alone");
                }
            }
        }
    }

    /// Each row of a batch-invariant product, recomputed alone, bitwise.
    fn batch_invariant_rows_equal_alone(
        x: &[f32],
        m: usize,
        w: &CpuMatrix,
        batched: &[f32],
    ) -> Result<(), usize> {
        let (n, k) = (w.rows(), w.cols());
        let mut alone = vec![0f32; n];
        for i in 0..m {
            matmul(&x[i * k..(i + 1) * k], 1, w, &mut alone, true);
            if alone
                .iter()
                .zip(&batched[i * n..(i + 1) * n])
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                return Err(i);
            }
        }
        Ok(())
    }

    #[test]
    fn without_the_mode_a_row_alone_and_in_a_large_batch_differ() {
        // The invariance checks could pass vacuously if the fast paths agreed by accident.
        let (m, n, k) = (37, 64, 512);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 7.0)
            .collect();
        let w = CpuMatrix::from_host(HostMatrix {
            rows: n,
            cols: k,
            data: HostData::Quantized {
                ggml_type: GgmlType::Q4_1,
                bytes: random_blocks(GgmlType::Q4_1, n * k / 32, 5),
            },
        });
        let mut batched = vec![0f32; m * n];
        matmul(&x, m, &w, &mut batched, false);
        let mut alone = vec![0f32; n];
        let differs = (0..m).any(|i| {
            matmul(&x[i * k..(i + 1) * k], 1, &w, &mut alone, false);
            alone
                .iter()
                .zip(&batched[i * n..(i + 1) * n])
                .any(|(a, b)| a.to_bits() != b.to_bits())
        });
        assert!(differs);
    }

    #[test]
    fn resident_panels_give_the_same_bits_as_expanding_on_the_fly() {
        let (n, k) = (70, 256);
        let make = || {
            CpuMatrix::from_host(HostMatrix {
                rows: n,
                cols: k,
                data: HostData::Quantized {
                    ggml_type: GgmlType::Q4_1,
                    bytes: random_blocks(GgmlType::Q4_1, n * k / 32, 11),
                },
            })
        };
        let (w, panels) = (make(), make().into_panels());
        let mut a = vec![0f32; k];
        let mut b = vec![0f32; k];
        for r in [0, 31, 32, 69] {
            w.dequantize_row(r, &mut a);
            panels.dequantize_row(r, &mut b);
            assert_eq!(a, b, "row {r}");
        }
        for m in [1usize, 3, 9] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0)
                .collect();
            let (mut on_the_fly, mut resident) = (vec![0f32; m * n], vec![1f32; m * n]);
            matmul(&x, m, &w, &mut on_the_fly, true);
            matmul(&x, m, &panels, &mut resident, true);
            assert!(
                on_the_fly
                    .iter()
                    .zip(&resident)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "m={m}"
            );
            let [dot] = panels.dot_rows::<1>(5, [&x[..k]], [&[][..]]);
            assert_eq!(dot.to_bits(), on_the_fly[5].to_bits());
        }
    }

    #[test]
    fn simd_and_scalar_block_dots_agree() {
        use super::super::qmatrix::{dot_q4_1, dot_q4_1_scalar, dot_q8_0, dot_q8_0_scalar};
        let nb = 9;
        let d: Vec<f32> = (0..nb).map(|b| 0.01 * (b as f32 + 1.0)).collect();
        let nibbles: Vec<u8> = (0..nb * 16)
            .map(|i| crate::sampling::splitmix64(i as u64) as u8)
            .collect();
        let quants: Vec<i8> = (0..nb * 32)
            .map(|i| crate::sampling::splitmix64(99 + i as u64) as i8)
            .collect();
        let x: Vec<f32> = (0..nb * 32)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 11.0)
            .collect();
        let (a, b) = (
            dot_q4_1(&d, &nibbles, &x),
            dot_q4_1_scalar(&d, &nibbles, &x),
        );
        assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "{a} vs {b}");
        let (a, b) = (dot_q8_0(&d, &quants, &x), dot_q8_0_scalar(&d, &quants, &x));
        assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "{a} vs {b}");
    }
}
