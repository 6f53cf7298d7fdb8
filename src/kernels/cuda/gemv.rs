//! Launches of `gemv.cu`'s bf16 GEMVs: one matrix (its narrow variant where a block a few
//! columns would leave SMs idle), or the equal row blocks of one matrix in one launch.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::module::GEMV_NARROW_THREADS;
use super::{CudaBackend, check};

impl CudaBackend {
    /// `out [m, n] = x [m, k] · wᵀ` for the bf16 `w_ptr` by a GEMV, where one takes `m`
    /// rows and K; false, having launched nothing, otherwise.
    pub(super) fn gemv_bf16(
        &self,
        x: u64,
        m: usize,
        n: usize,
        k: usize,
        w_ptr: u64,
        out: u64,
    ) -> bool {
        let Some((kernel, cols)) = self.kernels.gemv_for(m).filter(|_| k.is_multiple_of(8)) else {
            return false;
        };
        match self.kernels.gemv_narrow_for(m) {
            Some((narrow, _)) if n.div_ceil(cols) < self.kernels.num_sms => {
                let threads = GEMV_NARROW_THREADS;
                self.launch_gemv_threads(narrow, (n, 1), threads, x, m, (w_ptr, n, k), out);
            }
            _ => self.launch_gemv(kernel, (n.div_ceil(cols), 1), x, m, (w_ptr, n, k), out),
        }
        true
    }

    /// `out [groups, m, n]`: row block g (n rows) of the bf16 `[groups · n, k]` matrix at
    /// `w_ptr` times rows g·m .. (g + 1)·m of `x [groups · m, k]`. One grouped GEMV launch
    /// for a decode batch's few rows (a launch a block of DeepSeek-V4's `wo_a` read 8.4 MB
    /// in 5 µs: 1.7 TB/s, mostly ramp); otherwise `gemm_bf16` a block.
    ///
    /// # Safety
    /// `x` addresses groups·m·k f32, `w_ptr` groups·n·k bf16 and `out` groups·m·n f32.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_row_groups_bf16(
        &self,
        x: u64,
        m: usize,
        groups: usize,
        n: usize,
        k: usize,
        w_ptr: u64,
        out: u64,
    ) {
        if self.batch_invariant && k.is_multiple_of(8) {
            // SAFETY: the caller's contract.
            unsafe { self.invariant_bf16_groups(x, (m, n, k), groups, w_ptr, out) };
            return;
        }
        if self.batch_invariant {
            // The invariant GEMM a group at a time (`gemm_bf16` takes its FMA kernel here).
            for g in 0..groups {
                let (x_g, w_g, out_g) = (
                    x + (g * m * k * 4) as u64,
                    w_ptr + (g * n * k * 2) as u64,
                    out + (g * m * n * 4) as u64,
                );
                // SAFETY: block g's ranges lie inside the caller's (the contract above).
                unsafe { self.gemm_bf16(x_g, m, n, k, w_g, out_g, None) };
            }
            return;
        }
        let grouped = (!self.batch_invariant && k.is_multiple_of(8))
            .then(|| self.kernels.gemv_groups_for(m))
            .flatten();
        if let Some((kernel, cols)) = grouped {
            self.launch_gemv(kernel, (n.div_ceil(cols), groups), x, m, (w_ptr, n, k), out);
            return;
        }
        // SAFETY: the caller's contract.
        unsafe { self.gemm_bf16_groups(x, (m, n, k), (groups, false), w_ptr, out) };
    }

    /// One `gemv.cu` kernel over `x[num_rows, cols]` and the bf16 `(w, rows, cols)`, in
    /// `num_blocks` blocks (times `groups` for `gemv_groups`) of 256 threads.
    pub(super) fn launch_gemv(
        &self,
        kernel: &CudaFunction,
        blocks: (usize, usize),
        x: u64,
        num_rows: usize,
        w: (u64, usize, usize),
        out: u64,
    ) {
        self.launch_gemv_threads(kernel, blocks, 256, x, num_rows, w, out);
    }

    /// `launch_gemv` with `threads` a block.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv_threads(
        &self,
        kernel: &CudaFunction,
        (num_blocks, groups): (usize, usize),
        threads: usize,
        x: u64,
        num_rows: usize,
        (w, rows, cols): (u64, usize, usize),
        out: u64,
    ) {
        let (mi, ni, ki) = (num_rows as i32, rows as i32, cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (num_blocks as u32, groups as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds num_rows·w.cols elements and out what the kernel writes for those
        // rows (num_rows·w.rows, or half of that for the activation); w.cols is a multiple
        // of 8, so every row starts 16-byte aligned.
        check(
            unsafe {
                self.stream
                    .launch_builder(kernel)
                    .arg(&out)
                    .arg(&x)
                    .arg(&w)
                    .arg(&mi)
                    .arg(&ni)
                    .arg(&ki)
                    .launch(cfg)
            },
            "gemv",
        );
    }
}
