//! Kernels over plain rows, outside the paged cache: rows gathered, and an image
//! encoder's (`kernels-cuda/vision.cu`) attention without a mask inside segments of rows
//! (on tensor cores for the head dims `SEGMENT_MMA_HEAD_DIMS` names, else in f32) and erf
//! GELU.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::graph::Meta;
use super::{CudaBackend, check, grid_for};

/// Threads of a `segment_attention_kernel` block: SEG_WARPS warps.
const SEGMENT_THREADS: u32 = 128;
/// Rows of one head a block takes (SEG_BLOCK_ROWS), and the keys of a tile (SEG_KEYS).
const SEGMENT_BLOCK_ROWS: usize = 16;
const SEGMENT_KEYS: usize = 32;
/// Rows of one head a `segment_attention_mma` block takes (FA_ROWS), 16 a warp.
const SEGMENT_MMA_ROWS: usize = 64;
/// The widest head the kernel holds (four dims a lane), within 48 KiB of shared memory.
const MAX_HEAD_DIM: usize = 128;

impl CudaBackend {
    pub(super) fn launch_gather_rows(
        &self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[usize],
        out: &mut CudaSlice<f32>,
    ) {
        let rows_u32: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let rows_d = self.upload_u32(Meta::Rows, &rows_u32);
        if self.replaying() {
            return;
        }
        let (w, n) = (width as i32, rows.len() as i32);
        // SAFETY: every row index is inside x; out holds rows.len()·width.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.gather_rows)
                    .arg(out)
                    .arg(x)
                    .arg(&rows_d.ptr)
                    .arg(&w)
                    .arg(&n)
                    .launch(grid_for(rows.len() * width))
            },
            "gather_rows",
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_segment_attention(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        bounds: &[usize],
        num_heads: usize,
        head_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        assert!(head_dim <= MAX_HEAD_DIM, "a head of {head_dim} dims");
        let rows = bounds.last().copied().unwrap_or(0);
        // Each row's segment, as the kernel reads it.
        let seg: Vec<u32> = bounds
            .windows(2)
            .flat_map(|w| (w[0]..w[1]).flat_map(move |_| [w[0] as u32, w[1] as u32]))
            .collect();
        let seg = self.upload_u32(Meta::Rows, &seg);
        if self.replaying() || rows == 0 {
            return;
        }
        let (r, h, hd) = (rows as i32, num_heads as i32, head_dim as i32);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mma = (self.kernels.segment_attention_mma.iter()).find(|(d, _)| *d == head_dim);
        if let Some((_, kernel)) = mma {
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(SEGMENT_MMA_ROWS) as u32, num_heads as u32, 1),
                block_dim: (SEGMENT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: q, k, v and out hold rows · heads · head_dim; seg two entries a row.
            check(
                unsafe {
                    self.stream
                        .launch_builder(kernel)
                        .arg(out)
                        .arg(q)
                        .arg(k)
                        .arg(v)
                        .arg(&seg.ptr)
                        .arg(&r)
                        .arg(&h)
                        .arg(&scale)
                        .launch(cfg)
                },
                "segment_attention_mma",
            );
            return;
        }
        let smem_floats =
            SEGMENT_KEYS * (head_dim + 1) + (SEGMENT_KEYS + SEGMENT_BLOCK_ROWS) * head_dim;
        let cfg = LaunchConfig {
            grid_dim: (
                rows.div_ceil(SEGMENT_BLOCK_ROWS) as u32,
                num_heads as u32,
                1,
            ),
            block_dim: (SEGMENT_THREADS, 1, 1),
            shared_mem_bytes: (smem_floats * 4) as u32,
        };
        // SAFETY: q, k, v and out hold rows · heads · head_dim; seg two entries a row.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.segment_attention)
                    .arg(out)
                    .arg(q)
                    .arg(k)
                    .arg(v)
                    .arg(&seg.ptr)
                    .arg(&r)
                    .arg(&h)
                    .arg(&hd)
                    .arg(&scale)
                    .launch(cfg)
            },
            "segment_attention",
        );
    }

    pub(super) fn launch_gelu(&self, x: &mut CudaSlice<f32>, len: usize) {
        if self.replaying() || len == 0 {
            return;
        }
        let n = len as i64;
        // SAFETY: x holds len elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.gelu)
                    .arg(x)
                    .arg(&n)
                    .launch(grid_for(len))
            },
            "gelu",
        );
    }
}
