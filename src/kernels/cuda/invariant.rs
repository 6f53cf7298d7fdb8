//! The batch-invariant GEMM's launches (`kernels-cuda/invariant_mma.cu`): bf16 weights,
//! FP8 parts read as stored, and the variant a batch takes (each gives a row the same sums
//! whatever the batch).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::weights::{DevicePart, PackedFormat};
use super::{CudaBackend, CudaMatrix, check};

impl CudaBackend {
    /// `out[m, n] = x[m, k] · wᵀ` for bf16 weights at `w_ptr`: the tensor-core kernel
    /// where its 8-value loads fit K, the FMA one otherwise.
    ///
    /// # Safety
    /// `x` addresses m·k f32, `w_ptr` n·k bf16 and `out` m·n f32 on this device.
    pub(super) unsafe fn invariant_bf16(
        &self,
        x: u64,
        (m, n, k): (usize, usize, usize),
        w_ptr: u64,
        out: u64,
    ) {
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        // The tensor-core kernel where its 8-value loads fit K (`invariant_mma.cu`).
        let (kernel, cfg) = if k.is_multiple_of(8) {
            let (variant, cfg) = invariant_mv_launch(m, n);
            (&self.kernels.matmul_invariant_mv[variant], cfg)
        } else {
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(64), (m as u32).div_ceil(64), 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            (&self.kernels.matmul_invariant, cfg)
        };
        // SAFETY: x holds m·k, w n·k, out m·n elements (the caller's contract).
        check(
            unsafe {
                self.stream
                    .launch_builder(kernel)
                    .arg(&out)
                    .arg(&x)
                    .arg(&w_ptr)
                    .arg(&mi)
                    .arg(&ni)
                    .arg(&ki)
                    .launch(cfg)
            },
            "matmul_invariant",
        );
    }

    /// The invariant GEMM on FP8 parts as stored (`invariant_mma.cu`), a launch a part;
    /// false, having launched nothing, where a part is not FP8 or its blocks split a lane's
    /// 8 columns.
    pub(super) fn invariant_fp8(
        &self,
        x: u64,
        m: usize,
        w: &CudaMatrix,
        parts: &[DevicePart],
        out: u64,
    ) -> bool {
        let fits = |p: &DevicePart| match p.format {
            PackedFormat::Fp8 { block_cols, .. } => {
                w.cols.is_multiple_of(8) && block_cols > 0 && block_cols.is_multiple_of(8)
            }
            PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => false,
        };
        if !parts.iter().all(fits) {
            return false;
        }
        // The variant by the whole matrix, so that every part of it takes the same one.
        let (variant, _) = invariant_mv_launch(m, w.rows);
        let kernel = &self.kernels.matmul_invariant_fp8_mv[variant];
        for p in parts {
            let PackedFormat::Fp8 {
                block_rows,
                block_cols,
            } = p.format
            else {
                unreachable!("checked above");
            };
            let (_, cfg) = invariant_mv_launch_for(variant, m, p.rows);
            let y = out + 4 * p.first_row as u64;
            // SAFETY: x holds m·cols f32; y's rows (stride w.rows) have room for the part's
            // columns; the part's bytes and scales are its own.
            let launched = unsafe {
                self.launch_fp8_part(
                    kernel,
                    cfg,
                    (y, w.rows),
                    x,
                    p,
                    (block_rows, block_cols),
                    (m, w.cols),
                )
            };
            check(launched, "matmul_invariant_fp8");
        }
        true
    }
}

/// The invariant tensor-core GEMM's variant for m rows and n features, and its launch:
/// eight-row tiles a block, as many as the rows fill (a row's sums do not depend on which);
/// past 32 rows, 64 features a block, so the activations are read N/64 times rather than
/// N/16 (a feature's sums are the same), where that still leaves a block an SM
/// (Qwen3-0.6B's 2 048-wide q at 64 rows lost 8 % on 64 blocks).
fn invariant_mv_launch(m: usize, n: usize) -> (usize, LaunchConfig) {
    let wide_blocks = n.div_ceil(64) * m.div_ceil(32);
    let variant = if m <= 8 {
        0
    } else if m <= 16 {
        1
    } else if m <= 32 || wide_blocks < 128 {
        2
    } else {
        3
    };
    invariant_mv_launch_for(variant, m, n)
}

/// Variant `variant`'s grid over m rows and n features.
fn invariant_mv_launch_for(variant: usize, m: usize, n: usize) -> (usize, LaunchConfig) {
    let (rows_per_block, features_per_block) = [(8, 16), (16, 16), (32, 16), (32, 64)][variant];
    let cfg = LaunchConfig {
        grid_dim: (
            (n as u32).div_ceil(features_per_block),
            (m as u32).div_ceil(rows_per_block),
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    (variant, cfg)
}
