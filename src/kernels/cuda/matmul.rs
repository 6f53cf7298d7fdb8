//! GEMMs on the GPU: for a decode batch of a few rows troupe's GEMV (a pass over the bf16
//! weights, f32 activations as they are); otherwise cuBLAS (bf16 operands converted from the
//! f32 activations, f32 accumulate and output); in the batch-invariant mode troupe's
//! fixed-tile kernel.

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::module::{FP8_MMA_ROWS, FP8_STAGE_BYTES};
use super::weights::{DevicePart, PackedFormat, Store};

/// Values a thread of `f32_to_bf16_kernel` converts (TO_BF16_PER_THREAD).
const TO_BF16_PER_THREAD: usize = 8;
/// Weight rows a block of `gemv_fp8_mma` covers (one mma's m).
const MMA_BLOCK_ROWS: usize = 16;
/// Threads of a `gemv_fp8_mma` block (its `TC_WARPS` warps).
const MMA_THREADS: u32 = 256;
/// Weight rows a block of `gemv_fp8_mma_rows` covers (16 a warp).
const MMA_ROWS_BLOCK_ROWS: usize = 128;
/// Where `gemv_fp8_mma_rows` takes over: K this short at most (a warp's 16 rows whole,
/// K / 64 steps), and rows enough for a block an SM.
const MMA_ROWS_MAX_K: usize = 4096;
const MMA_ROWS_MIN_ROWS: usize = 16384;
use super::{CudaBackend, CudaMatrix, check, grid_for};

impl CudaBackend {
    fn add_bias(
        &self,
        out: &mut CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        m: usize,
        n: usize,
    ) {
        let Some(bias) = bias else { return };
        let (rows, cols) = (m as i32, n as i32);
        // A thread per four columns (per column where n is not a multiple of 4), a row a y.
        let lanes = if n.is_multiple_of(4) { n / 4 } else { n };
        let mut config = grid_for(lanes);
        config.grid_dim.1 = m.clamp(1, 65_535) as u32;
        // SAFETY: out holds m·n elements, bias n; 16-byte aligned rows where n % 4 == 0.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.add_bias)
                    .arg(out)
                    .arg(bias)
                    .arg(&rows)
                    .arg(&cols)
                    .launch(config)
            },
            "bias",
        );
    }

    /// The bf16 scratch, at least `n` long.
    fn bf16_scratch(&self, n: usize) -> crate::sync::MutexGuard<'_, Option<CudaSlice<bf16>>> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < n) {
            self.moved();
            *scratch = Some(check(
                self.stream.alloc_zeros::<bf16>(n.next_power_of_two()),
                "alloc",
            ));
        }
        scratch
    }

    /// The dequantized-weight scratch, at least `n` long.
    pub(super) fn weight_scratch(
        &self,
        n: usize,
    ) -> crate::sync::MutexGuard<'_, Option<CudaSlice<bf16>>> {
        let mut scratch = self
            .weight_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < n) {
            self.moved();
            *scratch = None;
            *scratch = Some(check(self.stream.alloc_zeros::<bf16>(n.max(1)), "alloc"));
        }
        scratch
    }

    /// Where the kernel about to write the first `n` values of `source` also writes their
    /// bf16 copy: the scratch, recorded as holding it, so that the next GEMM of `source`
    /// skips its conversion launch (`bf16_operand`). 0 — no copy — in the batch-invariant
    /// mode, whose GEMMs never take bf16 operands.
    pub(super) fn bf16_twin(&self, source: &CudaSlice<f32>, n: usize) -> u64 {
        if self.batch_invariant {
            return 0;
        }
        let scratch = self.bf16_scratch(n);
        let (ptr, _guard) = scratch
            .as_ref()
            .expect("allocated above")
            .device_ptr(&self.stream);
        *self.twin.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((source.device_ptr(&self.stream).0, n));
        ptr
    }

    /// `x`'s first `n` values in bf16, in the scratch: already there when the kernel that
    /// wrote `x` left its copy (`twin`, taken from `bf16_twin` by the GEMM), else converted
    /// now.
    fn bf16_operand(
        &self,
        x: u64,
        n: usize,
        twin: Option<(u64, usize)>,
    ) -> crate::sync::MutexGuard<'_, Option<CudaSlice<bf16>>> {
        if twin == Some((x, n)) {
            return self.bf16_scratch(n);
        }
        self.to_bf16(x, n)
    }

    pub(in crate::kernels::cuda) fn to_bf16(
        &self,
        x: u64,
        n: usize,
    ) -> crate::sync::MutexGuard<'_, Option<CudaSlice<bf16>>> {
        // The scratch is overwritten: whatever copy it held is gone.
        *self.twin.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let mut scratch = self.bf16_scratch(n);
        let out = scratch.as_mut().expect("allocated above");
        let n64 = n as i64;
        // SAFETY: `out` holds at least n elements; `x` at least n.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.f32_to_bf16)
                    .arg(out)
                    .arg(&x)
                    .arg(&n64)
                    .launch(grid_for(n.div_ceil(TO_BF16_PER_THREAD)))
            },
            "f32_to_bf16",
        );
        scratch
    }

    pub(super) fn gemm(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
    ) {
        let x_ptr = x.device_ptr(&self.stream).0;
        let out_ptr = out.device_ptr_mut(&self.stream).0;
        // SAFETY: the caller's x holds num_rows·w.cols elements and out num_rows·w.rows.
        unsafe { self.gemm_ptr(x_ptr, num_rows, w, out_ptr) };
        self.add_bias(out, bias, num_rows, w.rows);
    }

    /// `out[num_rows, w.rows] = x[num_rows, w.cols] · wᵀ` on device addresses, so that a
    /// GEMM can run on a range of rows inside a buffer (one expert's rows).
    ///
    /// # Safety
    /// `x` must address num_rows·w.cols f32 values and `out` num_rows·w.rows, on this
    /// backend's device, 16-byte aligned.
    pub(super) unsafe fn gemm_ptr(&self, x: u64, num_rows: usize, w: &CudaMatrix, out: u64) {
        let (m, n, k) = (num_rows, w.rows, w.cols);
        if m == 0 {
            return;
        }
        // Every GEMM takes the recorded copy, used or not: a copy lives for one GEMM.
        let twin = self.twin.lock().unwrap_or_else(|e| e.into_inner()).take();
        let parts = match &w.store {
            Store::Bf16(wb) => {
                let w_ptr = wb.device_ptr(&self.stream).0;
                // SAFETY: the caller's contract; w_ptr holds n·k bf16.
                unsafe { self.gemm_bf16(x, m, n, k, w_ptr, out, twin) };
                return;
            }
            Store::Packed(parts) => parts,
        };
        if !self.batch_invariant
            && (self.packed_gemv(x, m, w, parts, out) || self.fp8_gemm(x, m, w, parts, out))
        {
            return;
        }
        if self.batch_invariant && self.invariant_fp8(x, m, w, parts, out) {
            return;
        }
        let scratch = self.weight_scratch(n * k);
        let w_ptr = scratch
            .as_ref()
            .expect("allocated above")
            .device_ptr(&self.stream)
            .0;
        self.dequantize_into(w, w_ptr);
        // SAFETY: the caller's contract; the scratch holds the n·k dequantized weights.
        unsafe { self.gemm_bf16(x, m, n, k, w_ptr, out, twin) };
    }

    /// One FP8 part through `kernel` (a GEMV, or the invariant GEMM with its `splits` of K
    /// as one more argument), writing its rows' columns of `y` (row stride `ldy`).
    ///
    /// # Safety
    /// `x` addresses m·k f32 and `y` m rows (splits·m with splits) of `ldy` f32 from the
    /// part's first column, on this device; `cfg` suits `kernel`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn launch_fp8_part(
        &self,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        (y, ldy): (u64, usize),
        x: u64,
        p: &DevicePart,
        (block_rows, block_cols): (usize, usize),
        (m, k): (usize, usize),
        splits: Option<usize>,
    ) -> Result<Option<(CudaEvent, CudaEvent)>, cudarc::driver::DriverError> {
        let (ldy, mi, ni, ki) = (ldy as i32, m as i32, p.rows as i32, k as i32);
        let si = splits.map(|s| s as i32);
        let (br, bc) = (block_rows as i32, block_cols as i32);
        // SAFETY: the caller's contract; the part's bytes and scales are its own.
        let mut launch = self.stream.launch_builder(kernel);
        launch
            .arg(&y)
            .arg(&ldy)
            .arg(&x)
            .arg(&p.bytes)
            .arg(&p.scales)
            .arg(&br)
            .arg(&bc)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki);
        if let Some(si) = &si {
            launch.arg(si);
        }
        unsafe { launch.launch(cfg) }
    }

    /// `packed.cu`'s GEMVs, a launch per part writing its rows' columns of `out`; false,
    /// having launched nothing, where a part's format or the batch has none.
    fn packed_gemv(
        &self,
        x: u64,
        m: usize,
        w: &CudaMatrix,
        parts: &[DevicePart],
        out: u64,
    ) -> bool {
        let launch = |threads: u32, blocks: usize, smem: usize| LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // Each part's kernel and its launch.
        let kernels: Option<Vec<_>> = parts
            .iter()
            .map(|p| {
                // Tensor cores first (up to 8 rows): their loads stay in flight while they
                // compute, where the f32 GEMV streamed FP8 at 0.54 of the roofline.
                let staged = m * w.cols * 2 <= FP8_STAGE_BYTES;
                let smem = if staged { m * w.cols * 2 } else { 0 };
                let rows = w.cols <= MMA_ROWS_MAX_K && p.rows >= MMA_ROWS_MIN_ROWS;
                let kernel = match p.format {
                    PackedFormat::Fp8 { .. } if staged && rows => {
                        Some((&self.kernels.gemv_fp8_mma_rows, MMA_ROWS_BLOCK_ROWS))
                    }
                    PackedFormat::Fp8 { .. } if staged => {
                        Some((&self.kernels.gemv_fp8_mma_staged, MMA_BLOCK_ROWS))
                    }
                    PackedFormat::Fp8 { .. } => Some((&self.kernels.gemv_fp8_mma, MMA_BLOCK_ROWS)),
                    // Staged only: a Q4_K or Q4_1 step needs x from four places.
                    PackedFormat::Ggml(t) if staged => {
                        self.kernels.ggml_mma_gemv(t).map(|k| (k, MMA_BLOCK_ROWS))
                    }
                    PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => None,
                };
                let mma = kernel
                    .filter(|_| p.format.has_mma_gemv(w.cols) && m <= FP8_MMA_ROWS)
                    .map(|(k, rows)| (k, launch(MMA_THREADS, p.rows.div_ceil(rows), smem)));
                mma.or_else(|| {
                    let fp8 = matches!(p.format, PackedFormat::Fp8 { .. });
                    let (k, cols) = self
                        .kernels
                        .packed_gemv_for(fp8, m)
                        .filter(|_| p.format.has_gemv(w.cols))?;
                    // The FP8 GEMV takes `cols` rows a block; the GGML one a row.
                    Some((
                        k,
                        if fp8 {
                            launch(256, p.rows.div_ceil(cols), 0)
                        } else {
                            launch(128, p.rows, 0)
                        },
                    ))
                })
            })
            .collect();
        let Some(kernels) = kernels else {
            return false;
        };
        let (ldy, mi, ki) = (w.rows as i32, m as i32, w.cols as i32);
        for (p, (kernel, cfg)) in parts.iter().zip(kernels) {
            let y = out + 4 * p.first_row as u64;
            let ni = p.rows as i32;
            // SAFETY: x holds m·cols f32; y's rows (stride ldy) have room for the part's
            // columns; the part's bytes and scales are its own.
            let launched = unsafe {
                match p.format {
                    PackedFormat::Fp8 {
                        block_rows,
                        block_cols,
                    } => {
                        let block = (block_rows, block_cols);
                        self.launch_fp8_part(
                            kernel,
                            cfg,
                            (y, w.rows),
                            x,
                            p,
                            block,
                            (m, w.cols),
                            None,
                        )
                    }
                    PackedFormat::Ggml(t)
                        if self
                            .kernels
                            .ggml_mma_gemv(t)
                            .is_some_and(|k| std::ptr::eq(k, kernel)) =>
                    {
                        self.stream
                            .launch_builder(kernel)
                            .arg(&y)
                            .arg(&ldy)
                            .arg(&x)
                            .arg(&p.bytes)
                            .arg(&mi)
                            .arg(&ni)
                            .arg(&ki)
                            .launch(cfg)
                    }
                    PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => {
                        let fmt = p.format.code();
                        self.stream
                            .launch_builder(kernel)
                            .arg(&y)
                            .arg(&ldy)
                            .arg(&x)
                            .arg(&p.bytes)
                            .arg(&fmt)
                            .arg(&mi)
                            .arg(&ni)
                            .arg(&ki)
                            .launch(cfg)
                    }
                }
            };
            check(launched, "packed gemv");
        }
        true
    }

    /// `out[m, n] = x[m, k] · wᵀ` for bf16 weights at `w_ptr`: the batch-invariant kernel,
    /// the GEMV for a few rows, cuBLAS otherwise.
    ///
    /// # Safety
    /// `x` addresses m·k f32, `w_ptr` n·k bf16 and `out` m·n f32 on this device.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_bf16(
        &self,
        x: u64,
        m: usize,
        n: usize,
        k: usize,
        w_ptr: u64,
        out: u64,
        twin: Option<(u64, usize)>,
    ) {
        if self.batch_invariant {
            // SAFETY: the caller's contract.
            unsafe { self.invariant_bf16(x, (m, n, k), w_ptr, out) };
            return;
        }
        if self.gemv_bf16(x, m, n, k, w_ptr, out) {
            return;
        }
        let xb = self.bf16_operand(x, m * k, twin);
        let xb = xb.as_ref().expect("scratch allocated");
        let (x_ptr, _gx) = xb.device_ptr(&self.stream);
        // SAFETY: the scratch holds m·k bf16 values; the caller's contract for the rest.
        unsafe { self.cublas_bf16(x_ptr, (m, n, k), (1, false), w_ptr, out) };
    }

    /// `groups` GEMMs of `gemm_bf16`'s shape at once, block g of w (n·k bf16 a block, in a
    /// row) on group g of x into group g of out: the groups each a block of m rows in a row
    /// (`[groups, m, k]`), or `interleaved` within each row (`[m, groups, k]`, the step's
    /// own layout, so no swap is needed around it). One conversion and one batched launch
    /// rather than a pair a group.
    ///
    /// # Safety
    /// x must address groups·m·k f32 values, w_ptr groups·n·k bf16, out groups·m·n f32.
    pub(super) unsafe fn gemm_bf16_groups(
        &self,
        x: u64,
        (m, n, k): (usize, usize, usize),
        (groups, interleaved): (usize, bool),
        w_ptr: u64,
        out: u64,
    ) {
        let xb = self.to_bf16(x, groups * m * k);
        let xb = xb.as_ref().expect("scratch allocated");
        let (x_ptr, _gx) = xb.device_ptr(&self.stream);
        // SAFETY: the scratch holds groups·m·k bf16 values; the caller's contract.
        unsafe { self.cublas_bf16(x_ptr, (m, n, k), (groups, interleaved), w_ptr, out) };
    }

    /// Row-major `Y[m, n] = X[m, k] · W[n, k]ᵀ` (column-major `Yᵀ = Wᵀ · X`) on bf16 X and
    /// W, f32 Y, for each of `groups` blocks of the three (`gemm_bf16_groups`' layouts).
    ///
    /// # Safety
    /// The pointers cover groups·m·k, groups·n·k and groups·m·n elements.
    unsafe fn cublas_bf16(
        &self,
        x_bf16: u64,
        (m, n, k): (usize, usize, usize),
        (groups, interleaved): (usize, bool),
        w_ptr: u64,
        out: u64,
    ) {
        use cudarc::cublas::result::{gemm_ex, gemm_strided_batched_ex};
        use cudarc::cublas::sys::{
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t,
            cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T},
            cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F},
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (alpha, beta) = (
            &alpha as *const f32 as *const _,
            &beta as *const f32 as *const _,
        );
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        let (w, x, y) = (w_ptr as *const _, x_bf16 as *const _, out as *mut _);
        let handle = *self.blas.handle();
        // SAFETY: the caller's contract.
        let done = unsafe {
            if groups == 1 {
                gemm_ex(
                    handle,
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    alpha,
                    w,
                    CUDA_R_16BF,
                    ki,
                    x,
                    CUDA_R_16BF,
                    ki,
                    beta,
                    y,
                    CUDA_R_32F,
                    ni,
                    CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            } else {
                // Interleaved: a row holds every group's k (and n) values in turn.
                let ((ldx, sx), (ldy, sy)) = match interleaved {
                    true => ((groups * k, k), (groups * n, n)),
                    false => ((k, m * k), (n, m * n)),
                };
                let (ldx, ldy) = (ldx as i32, ldy as i32);
                let (sw, sx, sy) = ((n * k) as i64, sx as i64, sy as i64);
                gemm_strided_batched_ex(
                    handle,
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    alpha,
                    w,
                    CUDA_R_16BF,
                    ki,
                    sw,
                    x,
                    CUDA_R_16BF,
                    ldx,
                    sx,
                    beta,
                    y,
                    CUDA_R_32F,
                    ldy,
                    sy,
                    groups as i32,
                    CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        };
        check(done, "gemm");
    }

    /// The MLP activation straight from the GEMV (`gemv_silu`), where a small decode batch
    /// takes the GEMV path; false, having launched nothing, otherwise.
    pub(super) fn gemv_silu(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) -> bool {
        let fused = self
            .kernels
            .gemv_silu_for(num_rows)
            .filter(|_| !self.batch_invariant && w.cols.is_multiple_of(8) && w.rows == 2 * width);
        if let Store::Packed(parts) = &w.store {
            return w.rows == 2 * width && self.fp8_gemv_silu(x, num_rows, w, parts, out);
        }
        let (Some((kernel, cols)), Some(wb)) = (fused, w.bf16()) else {
            return false;
        };
        let w_ptr = wb.device_ptr(&self.stream).0;
        // Each block pairs cols / 2 gate columns with their up partners.
        let (x_ptr, out_ptr) = (
            x.device_ptr(&self.stream).0,
            out.device_ptr_mut(&self.stream).0,
        );
        self.launch_gemv(
            kernel,
            (width.div_ceil(cols / 2), 1),
            x_ptr,
            num_rows,
            (w_ptr, w.rows, w.cols),
            out_ptr,
        );
        true
    }

    /// `gemv_silu` for a stacked [gate; up] kept as one FP8 part: the tensor-core GEMV
    /// pairing each gate row with its up row.
    fn fp8_gemv_silu(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMatrix,
        parts: &[DevicePart],
        out: &mut CudaSlice<f32>,
    ) -> bool {
        let [part] = parts else {
            return false;
        };
        let PackedFormat::Fp8 {
            block_rows,
            block_cols,
        } = part.format
        else {
            return false;
        };
        if self.batch_invariant
            || m > FP8_MMA_ROWS
            || !part.format.has_mma_gemv(w.cols)
            || m * w.cols * 2 > FP8_STAGE_BYTES
        {
            return false;
        }
        let width = w.rows / 2;
        let (x_ptr, out_ptr) = (
            x.device_ptr(&self.stream).0,
            out.device_ptr_mut(&self.stream).0,
        );
        let cfg = LaunchConfig {
            grid_dim: (width.div_ceil(MMA_BLOCK_ROWS / 2) as u32, 1, 1),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: (m * w.cols * 2) as u32,
        };
        // SAFETY: x holds m·cols f32 and out m·width; the one part's bytes and scales hold
        // the whole [gate; up] matrix (its rows are w.rows).
        let launched = unsafe {
            self.launch_fp8_part(
                &self.kernels.gemv_fp8_mma_silu,
                cfg,
                (out_ptr, width),
                x_ptr,
                part,
                (block_rows, block_cols),
                (m, w.cols),
                None,
            )
        };
        check(launched, "fp8 gemv silu");
        true
    }
}
