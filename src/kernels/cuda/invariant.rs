//! The batch-invariant GEMM's launches (`kernels-cuda/invariant_mma.cu`): bf16 weights,
//! FP8 parts read as stored, and the variant a batch takes (each gives a row the same sums
//! whatever the batch).

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

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
        // The tensor-core kernel where its 8-value loads fit K (`invariant_mma.cu`).
        if k.is_multiple_of(8) {
            // SAFETY: the caller's contract, as one group.
            unsafe { self.invariant_bf16_groups(x, (m, n, k), 1, w_ptr, out) };
            return;
        }
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        let (kernel, cfg) = {
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

    /// `groups` invariant GEMMs of the same shape in one launch: group g's rows
    /// `x[g·m .. (g + 1)·m, k]` times its bf16 `[n, k]` block of `w_ptr` into
    /// `out[g·m .. (g + 1)·m, n]`; K split (`invariant_splits`) where there is one group.
    ///
    /// # Safety
    /// `x` addresses groups·m·k f32, `w_ptr` groups·n·k bf16 and `out` groups·m·n f32 on
    /// this device; k is a multiple of 8.
    pub(super) unsafe fn invariant_bf16_groups(
        &self,
        x: u64,
        (m, n, k): (usize, usize, usize),
        groups: usize,
        w_ptr: u64,
        out: u64,
    ) {
        let staged = self.kernels.invariant_staged;
        let (variant, mut cfg) = invariant_mv_launch(m, n, false, staged);
        let splits = if groups == 1 {
            invariant_splits(n, k)
        } else {
            1
        };
        cfg.grid_dim.0 *= groups as u32;
        cfg.grid_dim.2 = splits as u32;
        let (mi, ni, ki, si) = (m as i32, n as i32, k as i32, splits as i32);
        self.with_splits(out, m * n, splits, |c| {
            // SAFETY: x holds groups·m·k, w groups·n·k elements, c splits·m·n (the
            // caller's contract, and with_splits's).
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.matmul_invariant_mv[variant])
                        .arg(&c)
                        .arg(&x)
                        .arg(&w_ptr)
                        .arg(&mi)
                        .arg(&ni)
                        .arg(&ki)
                        .arg(&si)
                        .launch(cfg)
                },
                "matmul_invariant",
            );
        });
    }

    /// The split sums' scratch, at least `n` long.
    fn split_scratch(&self, n: usize) -> crate::sync::MutexGuard<'_, Option<CudaSlice<f32>>> {
        let mut scratch = self.split_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < n) {
            self.moved();
            *scratch = None;
            *scratch = Some(check(self.stream.alloc_zeros::<f32>(n.max(1)), "alloc"));
        }
        scratch
    }

    /// `launch(c)` writing `splits` partial `[len]` outputs from `c`, added in split order
    /// into `out`; with one split, `launch(out)`.
    fn with_splits(&self, out: u64, len: usize, splits: usize, launch: impl FnOnce(u64)) {
        if splits == 1 {
            launch(out);
            return;
        }
        let mut scratch = self.split_scratch(splits * len);
        let parts = scratch.as_mut().expect("allocated above");
        let (ptr, guard) = parts.device_ptr(&self.stream);
        // The split launches write all of its first splits·len values.
        launch(ptr);
        drop(guard);
        let (si, n) = (splits as i32, len as i64);
        // SAFETY: parts holds splits·len values, out len.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.matmul_invariant_splits)
                    .arg(&out)
                    .arg(parts)
                    .arg(&si)
                    .arg(&n)
                    .launch(super::grid_for(len))
            },
            "matmul_invariant_splits",
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
        // The variant and splits by the whole matrix, so that every part of it takes the
        // same.
        let (variant, _) = invariant_mv_launch(m, w.rows, true, self.kernels.invariant_staged);
        let kernel = &self.kernels.matmul_invariant_fp8_mv[variant];
        let splits = invariant_splits(w.rows, w.cols);
        self.with_splits(out, m * w.rows, splits, |c| {
            self.invariant_fp8_parts(kernel, (variant, splits), x, m, w, parts, c)
        });
        true
    }

    /// `invariant_fp8`'s launches, a part each, into `out` (splits · m rows of w.rows).
    #[allow(clippy::too_many_arguments)]
    fn invariant_fp8_parts(
        &self,
        kernel: &cudarc::driver::CudaFunction,
        (variant, splits): (usize, usize),
        x: u64,
        m: usize,
        w: &CudaMatrix,
        parts: &[DevicePart],
        out: u64,
    ) {
        for p in parts {
            let PackedFormat::Fp8 {
                block_rows,
                block_cols,
            } = p.format
            else {
                unreachable!("checked above");
            };
            let (_, mut cfg) = invariant_mv_launch_for(variant, m, p.rows, true);
            cfg.grid_dim.2 = splits as u32;
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
                    Some(splits),
                )
            };
            check(launched, "matmul_invariant_fp8");
        }
    }
}

/// The invariant GEMM's splits of K for n features and k columns, from the shape alone:
/// doubled (up to `INV_MAX_SPLITS`) while the one-tile variant's blocks (16 features
/// each) stay within `INV_BUSY_BLOCKS` and each warp keeps two 32-column chunks a split.
fn invariant_splits(n: usize, k: usize) -> usize {
    let (blocks, chunks) = (n.div_ceil(16), k.div_ceil(32));
    let mut splits = 1;
    while splits < INV_MAX_SPLITS
        && blocks * 2 * splits <= INV_BUSY_BLOCKS
        && chunks >= 16 * 2 * splits
    {
        splits *= 2;
    }
    splits
}

/// See `invariant_splits`.
const INV_MAX_SPLITS: usize = 16;
const INV_BUSY_BLOCKS: usize = 256;

/// The invariant tensor-core GEMM's variant for m rows and n features, and its launch:
/// eight-row tiles a block, as many as the rows fill (a row's sums do not depend on which);
/// past 32 rows, 64 features a block, so the activations are read N/64 times rather than
/// N/16 (a feature's sums are the same), where that still leaves a block an SM
/// (Qwen3-0.6B's 2 048-wide q at 64 rows lost 8 % on 64 blocks).
/// Without the staged variants' shared memory (`staged` false), 16 rows a block at most.
fn invariant_mv_launch(m: usize, n: usize, fp8: bool, staged: bool) -> (usize, LaunchConfig) {
    let wide_blocks = n.div_ceil(64) * m.div_ceil(32);
    let variant = if m <= 8 {
        0
    } else if m <= 16 || !staged {
        1
    } else if m <= 32 || wide_blocks < 128 {
        2
    } else {
        3
    };
    invariant_mv_launch_for(variant, m, n, fp8)
}

/// Variant `variant`'s grid over m rows and n features, and its shared stages.
fn invariant_mv_launch_for(variant: usize, m: usize, n: usize, fp8: bool) -> (usize, LaunchConfig) {
    let (rows_per_block, features_per_block) = INV_VARIANT_TILES[variant];
    // The row blocks of a feature block next to each other, so that they run together and
    // its weights come from DRAM once (at 64 rows, 32 a block, each GEMM's weights were read
    // twice).
    let cfg = LaunchConfig {
        grid_dim: (
            (m as u32).div_ceil(rows_per_block),
            (n as u32).div_ceil(features_per_block),
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: invariant_mv_smem_bytes(variant, fp8) as u32,
    };
    (variant, cfg)
}

/// Rows and features a block of each variant (`invariant_mma.cu`'s NT · 8 and FG · 16).
const INV_VARIANT_TILES: [(u32, u32); 4] = [(8, 16), (16, 16), (32, 16), (32, 64)];
/// Each warp's shared stages in `invariant_mv_pipe` (its S), by variant; the first holds
/// its chunks in registers instead.
const INV_STAGES: [usize; 4] = [0, 0, 3, 3];

/// Whether a block may have the staged variants' shared memory (dynamic, and the static
/// `red` of `inv_store`: 8 warps × 16 features × the block's rows, f32) under the device's
/// opt-in limit `smem_optin` bytes.
pub fn invariant_staged_fits(smem_optin: usize) -> bool {
    (0..INV_VARIANT_TILES.len()).all(|v| {
        let red = 8 * 16 * INV_VARIANT_TILES[v].0 as usize * 4;
        invariant_mv_smem_bytes(v, false).max(invariant_mv_smem_bytes(v, true)) + red <= smem_optin
    })
}

/// Dynamic shared memory of variant `variant` (`InvStage` in `invariant_mma.cu`): S stages
/// a warp, 8 warps, each stage a chunk's weight rows (64 bytes bf16, 32 FP8) and its X rows
/// (144 bytes: 128 of f32 and 16 of padding).
pub(super) fn invariant_mv_smem_bytes(variant: usize, fp8: bool) -> usize {
    let (rows, features) = INV_VARIANT_TILES[variant];
    let weight_row = if fp8 { 32 } else { 64 };
    INV_STAGES[variant] * 8 * (features as usize * weight_row + rows as usize * 144)
}
