//! `out[m, n] = x[m, k] · wᵀ` with `w` stored `[n, k]` (one row per output feature).
//!
//! Packed (GGML) weights always take the integer row-dot path against 8-bit
//! activations: each weight row is streamed once, in its quantized form, and dotted with
//! every activation row while it is in cache; rows are split across threads. With f32
//! activations (`--exact-activations`, f32 weights), decode (few rows) takes row dots and
//! prefill (many rows) is compute-bound: panels of weight rows are expanded to f32 and
//! multiplied by the `gemm` crate's packed, blocked kernels.

use std::cell::RefCell;

use rayon::prelude::*;

use super::exact_dot::block_sums;
use super::packed_matmul::{OutPtr, ROWS_PER_TASK, gemv_packed};
use super::qmatrix::{CpuMatrix, QBLOCK};

/// Above this many activation rows, a blocked GEMM beats row dots.
pub const GEMV_MAX_ROWS: usize = 8;
/// Activation rows swept together over a task's weight rows in the row-dot path.
const ACTIVATION_ROWS_PER_BLOCK: usize = 32;
/// Weight rows expanded to f32 at a time in the prefill path (bounded scratch).
const PANEL_ROWS: usize = 128;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
    } else if m <= GEMV_MAX_ROWS || matches!(w, CpuMatrix::Packed { .. }) {
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
    if let CpuMatrix::Packed { parts, .. } = w {
        return gemv_packed(x, m, parts, n, k, out);
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
        // Q6_K keeps its one scale at the end of the block.
        let first = if ty == GgmlType::Q6K { 208 } else { 0 };
        for (b, blk) in bytes.chunks_exact_mut(bb).enumerate() {
            let blk = &mut blk[first..];
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
                let w_f32 = data.clone().into_f32(n * k);
                let want = naive(&x, m, &w_f32, n, k);
                let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                let float_tolerance = 1e-5 * scale * (k as f32).sqrt();
                // 8-bit activations (packed weights, decode-sized m) move a product by at
                // most Σ |w| · d / 2, d = the activation block's max / 127.
                let rounding = |i: usize, j: usize| -> f32 {
                    (0..k)
                        .map(|t| {
                            let b = &x[i * k + t / 32 * 32..i * k + t / 32 * 32 + 32];
                            let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                            w_f32[j * k + t].abs() * d / 2.0
                        })
                        .sum()
                };
                let quantized = matches!(data, HostData::Quantized { .. });
                let host = |data: HostData| HostMatrix {
                    rows: n,
                    cols: k,
                    data,
                };
                let mut layouts = vec![(false, CpuMatrix::from_host(host(data.clone())))];
                if quantized {
                    layouts.push((true, CpuMatrix::from_host_exact(host(data))));
                }
                for (exact, w) in layouts {
                    let eight_bit = quantized && !exact;
                    let mut out = vec![f32::NAN; m * n];
                    matmul(&x, m, &w, &mut out, false);
                    for (idx, (a, b)) in out.iter().zip(&want).enumerate() {
                        let (i, j) = (idx / n, idx % n);
                        let bound = float_tolerance + if eight_bit { rounding(i, j) } else { 0.0 };
                        assert!(
                            (a - b).abs() <= bound,
                            "{ty:?} exact {exact} m={m} n={n} k={k}: {a} vs {b}"
                        );
                    }
                    let mut invariant = vec![f32::NAN; m * n];
                    matmul(&x, m, &w, &mut invariant, true);
                    for (a, b) in invariant.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < float_tolerance,
                            "{ty:?} invariant m={m} n={n} k={k}: {a} vs {b}"
                        );
                    }
                    if batch_invariant_rows_equal_alone(&x, m, &w, &invariant).is_err() {
                        panic!("{ty:?} m={m}: a row in the batch differs from the row alone");
                    }
                }
            }
        }
    }

    /// A Q4_K_M file's stacked q/k (Q4_K) and v (Q6_K): each part stays in its format,
    /// resident bytes are the file's, and the product is the dequantized one within the
    /// activations' rounding.
    #[test]
    fn stacked_parts_of_two_formats_stay_packed() {
        let (k, parts) = (256, [(GgmlType::Q4K, 40), (GgmlType::Q6K, 24)]);
        let hosts: Vec<HostMatrix> = parts
            .iter()
            .map(|&(ty, rows)| HostMatrix {
                rows,
                cols: k,
                data: HostData::Quantized {
                    ggml_type: ty,
                    bytes: random_blocks(ty, rows * k / ty.block_len(), rows as u64),
                },
            })
            .collect();
        let file_bytes: usize = parts
            .iter()
            .map(|&(ty, r)| r * k / 256 * ty.block_bytes())
            .sum();
        let stacked = HostMatrix::concat_rows(hosts);
        let n = stacked.rows;
        let w_f32 = stacked.data.clone().into_f32(n * k);
        let w = CpuMatrix::from_host(stacked);
        assert_eq!(w.resident_bytes(), file_bytes);
        assert_eq!(w.format(), "Q4K+Q6K × q8");
        for m in [1, 5] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) / 11.0)
                .collect();
            let mut out = vec![f32::NAN; m * n];
            matmul(&x, m, &w, &mut out, false);
            let want = naive(&x, m, &w_f32, n, k);
            for (idx, (a, b)) in out.iter().zip(&want).enumerate() {
                let j = idx % n;
                // |x| ≤ 1 per block here, so d ≤ 1/127.
                let bound: f32 = w_f32[j * k..(j + 1) * k]
                    .iter()
                    .map(|v| v.abs() / 254.0)
                    .sum();
                assert!((a - b).abs() <= bound + 1e-4, "m={m} row {j}: {a} vs {b}");
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
    fn without_the_mode_f32_rows_alone_and_batched_differ_and_packed_ones_do_not() {
        // The invariance checks could pass vacuously if the fast paths agreed by accident.
        let (m, n, k) = (37, 64, 512);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 7.0)
            .collect();
        let host = || HostMatrix {
            rows: n,
            cols: k,
            data: HostData::Quantized {
                ggml_type: GgmlType::Q4_1,
                bytes: random_blocks(GgmlType::Q4_1, n * k / 32, 5),
            },
        };
        let differs = |w: &CpuMatrix| {
            let mut batched = vec![0f32; m * n];
            matmul(&x, m, w, &mut batched, false);
            let mut alone = vec![0f32; n];
            (0..m).any(|i| {
                matmul(&x[i * k..(i + 1) * k], 1, w, &mut alone, false);
                alone
                    .iter()
                    .zip(&batched[i * n..(i + 1) * n])
                    .any(|(a, b)| a.to_bits() != b.to_bits())
            })
        };
        // f32 activations: a blocked GEMM for the batch, row dots alone.
        assert!(differs(&CpuMatrix::from_host_exact(host())));
        // 8-bit activations: every row through the same integer kernel, whatever m is.
        assert!(!differs(&CpuMatrix::from_host(host())));
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
        use super::super::exact_dot::{dot_q4_1, dot_q4_1_scalar, dot_q8_0, dot_q8_0_scalar};
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
