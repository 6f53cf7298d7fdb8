//! Weight matrices on the GPU: bf16 (uploaded as the checkpoint stores them, converted
//! once on the host, or made on the device for `--dummy-weights`), or packed — FP8 e4m3
//! with its scale grid, GGML Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks as the file stores
//! them — in parts of consecutive rows (a Q4_K_M file's stacked q/k/v mixes formats).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::{CudaBackend, check, grid_for};
use crate::kernels::fp4::{MXFP4_GROUP, Mxfp4Matrix};
use crate::kernels::fp8::Fp8Matrix;
use crate::kernels::quant::GgmlType;
use crate::kernels::{HostData, HostMatrix};

pub struct CudaMatrix {
    pub rows: usize,
    pub cols: usize,
    pub store: Store,
}

pub enum Store {
    Bf16(CudaSlice<bf16>),
    Packed(Vec<DevicePart>),
}

/// Rows `first_row .. first_row + rows` of a packed matrix.
pub struct DevicePart {
    pub first_row: usize,
    pub rows: usize,
    pub format: PackedFormat,
    pub bytes: CudaSlice<u8>,
    /// FP8's scale grid (one unused value for GGML, whose scales live in its blocks).
    pub scales: CudaSlice<f32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    Fp8 {
        block_rows: usize,
        block_cols: usize,
    },
    Ggml(GgmlType),
    /// MXFP4 in 17-byte blocks (`packed.cu`'s TROUPE_MXFP4): an E8M0 exponent, 16 bytes of
    /// E2M1 pairs.
    Mxfp4,
}

impl PackedFormat {
    /// The kernels' `fmt` argument: 0 for FP8, else the GGML type id.
    pub fn code(self) -> i32 {
        match self {
            PackedFormat::Fp8 { .. } => 0,
            // packed.cu's GGML_* ids (ggml's own type numbers).
            PackedFormat::Ggml(t) => match t {
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 => 3,
                GgmlType::Q8_0 => 8,
                GgmlType::Q4K => 12,
                GgmlType::Q6K => 14,
                other => unreachable!("{other:?} is not kept packed on the device"),
            },
            PackedFormat::Mxfp4 => 100,
        }
    }
    pub fn blocks(self) -> (i32, i32) {
        match self {
            PackedFormat::Fp8 {
                block_rows,
                block_cols,
            } => (block_rows as i32, block_cols as i32),
            PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => (1, 1),
        }
    }
    /// Whether `packed.cu`'s GEMV reads this format at width `cols`: 16-byte FP8 loads lie
    /// in one scale block; GGML rows are whole groups of 32.
    pub fn has_gemv(self, cols: usize) -> bool {
        match self {
            PackedFormat::Fp8 { block_cols, .. } => {
                cols.is_multiple_of(16) && (block_cols.is_multiple_of(16) || block_cols >= cols)
            }
            PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => cols.is_multiple_of(32),
        }
    }
    /// Whether a tensor-core GEMV reads this format at width `cols`: FP8 in 64-wide steps
    /// of K, each inside one scale block; Q4_K and Q4_1 in whole blocks.
    pub fn has_mma_gemv(self, cols: usize) -> bool {
        match self {
            PackedFormat::Fp8 { block_cols, .. } => {
                cols.is_multiple_of(64) && (block_cols.is_multiple_of(64) || block_cols >= cols)
            }
            PackedFormat::Ggml(GgmlType::Q4K) => cols.is_multiple_of(256),
            PackedFormat::Ggml(GgmlType::Q4_1) => cols.is_multiple_of(32),
            PackedFormat::Ggml(_) => false,
            PackedFormat::Mxfp4 => false,
        }
    }
    pub fn name(self, cols: usize) -> String {
        match self {
            PackedFormat::Fp8 {
                block_rows: 1,
                block_cols,
            } if block_cols >= cols => "FP8 e4m3 per channel".into(),
            PackedFormat::Fp8 {
                block_rows,
                block_cols,
            } => format!("FP8 e4m3 {block_rows}×{block_cols}"),
            PackedFormat::Ggml(t) => format!("{t:?}"),
            PackedFormat::Mxfp4 => "MXFP4".into(),
        }
    }
}

/// `m` as 17-byte blocks: each group's exponent, then its 16 bytes of pairs.
fn mxfp4_blocks(m: &Mxfp4Matrix) -> Vec<u8> {
    let half = MXFP4_GROUP / 2;
    m.exponents
        .iter()
        .zip(m.bytes.chunks_exact(half))
        .flat_map(|(&e, pairs)| std::iter::once(e).chain(pairs.iter().copied()))
        .collect()
}

/// GGML formats with device kernels; others are dequantized to bf16 at upload.
fn device_ggml(t: GgmlType) -> bool {
    matches!(
        t,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K
    )
}

impl CudaMatrix {
    /// The bf16 weights, where the matrix is stored so.
    pub fn bf16(&self) -> Option<&CudaSlice<bf16>> {
        match &self.store {
            Store::Bf16(w) => Some(w),
            Store::Packed(_) => None,
        }
    }

    /// Bytes on the device and the format name(s), `+`-joined for mixed parts.
    pub fn footprint(&self) -> (usize, String) {
        match &self.store {
            Store::Bf16(_) => (self.rows * self.cols * 2, "bf16".into()),
            Store::Packed(parts) => {
                let mut names: Vec<String> = Vec::new();
                let mut bytes = 0;
                for p in parts {
                    bytes += p.bytes.len() + 4 * p.scales.len();
                    let name = p.format.name(self.cols);
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
                (bytes, names.join("+"))
            }
        }
    }
}

impl CudaBackend {
    pub(super) fn upload_weights(&self, m: HostMatrix) -> CudaMatrix {
        let (rows, cols) = (m.rows, m.cols);
        let packable = |d: &HostData| match d {
            HostData::Fp8(_) | HostData::Mxfp4(_) => true,
            HostData::Quantized { ggml_type, .. } => device_ggml(*ggml_type),
            _ => false,
        };
        let store = match m.data {
            HostData::Quantized {
                ggml_type: GgmlType::MXFP4,
                bytes,
            } => Store::Packed(vec![self.mxfp4_from_ggml(rows, &bytes)]),
            HostData::Random {
                seed,
                mean,
                half_width,
            } => Store::Bf16(self.random_bf16(rows * cols, seed, mean, half_width)),
            HostData::RandomMxfp4 { seed } => {
                Store::Packed(vec![self.random_mxfp4(rows, cols, seed)])
            }
            HostData::ToFp8 { dense, .. } => {
                Store::Packed(vec![self.quantize_fp8(*dense, rows, cols)])
            }
            data @ (HostData::Fp8(_) | HostData::Mxfp4(_) | HostData::Quantized { .. })
                if packable(&data) =>
            {
                Store::Packed(vec![self.upload_part(0, rows, cols, data)])
            }
            HostData::Stacked(parts) if parts.iter().all(|p| packable(&p.data)) => {
                let mut first_row = 0;
                let parts = parts
                    .into_iter()
                    .map(|p| {
                        first_row += p.rows;
                        self.upload_part(first_row - p.rows, p.rows, cols, p.data)
                    })
                    .collect();
                Store::Packed(parts)
            }
            HostData::Bf16(v) => Store::Bf16(check(self.stream.clone_htod(&v), "weight upload")),
            other => {
                let host: Vec<bf16> = other
                    .into_f32(rows * cols)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                Store::Bf16(check(self.stream.clone_htod(&host), "weight upload"))
            }
        };
        let matrix = CudaMatrix { rows, cols, store };
        if matches!(matrix.store, Store::Packed(_)) {
            // Sized now, while no graph is being recorded: a wider batch's GEMM dequantizes
            // into it.
            drop(self.weight_scratch(rows * cols));
        }
        matrix
    }

    fn upload_part(
        &self,
        first_row: usize,
        rows: usize,
        cols: usize,
        data: HostData,
    ) -> DevicePart {
        let (format, bytes, scales) = match data {
            HostData::Fp8(Fp8Matrix {
                bytes,
                scales,
                block_rows,
                block_cols,
                ..
            }) => (
                PackedFormat::Fp8 {
                    block_rows,
                    block_cols,
                },
                bytes,
                scales,
            ),
            HostData::Quantized { ggml_type, bytes } => {
                (PackedFormat::Ggml(ggml_type), bytes, vec![0.0])
            }
            HostData::Mxfp4(m) => (PackedFormat::Mxfp4, mxfp4_blocks(&m), vec![0.0]),
            _ => unreachable!("only packed parts are uploaded as parts"),
        };
        debug_assert!(cols > 0);
        DevicePart {
            first_row,
            rows,
            format,
            bytes: check(self.stream.clone_htod(&bytes), "weight upload"),
            scales: check(self.stream.clone_htod(&scales), "weight upload"),
        }
    }

    /// `upload_blocks`: GGUF's MXFP4 copied straight from `blocks` (a DMA where
    /// `pin` pinned them) and put in troupe's pair order on the device; other formats as
    /// `upload_weights` takes them.
    pub(super) fn upload_host_blocks(
        &self,
        rows: usize,
        cols: usize,
        ggml_type: GgmlType,
        blocks: &[u8],
    ) -> CudaMatrix {
        if ggml_type != GgmlType::MXFP4 {
            return self.upload_weights(HostMatrix {
                rows,
                cols,
                data: HostData::Quantized {
                    ggml_type,
                    bytes: blocks.to_vec(),
                },
            });
        }
        let part = self.mxfp4_from_ggml(rows, blocks);
        CudaMatrix {
            rows,
            cols,
            store: Store::Packed(vec![part]),
        }
    }

    fn mxfp4_from_ggml(&self, rows: usize, blocks: &[u8]) -> DevicePart {
        let groups = blocks.len() / 17;
        // SAFETY: every byte is written by the copy below before any kernel reads it.
        let mut bytes = check(
            unsafe { self.stream.alloc::<u8>(blocks.len().max(1)) },
            "streamed experts",
        );
        {
            let (at, _written) = bytes.device_ptr_mut(&self.stream);
            // SAFETY: the destination holds blocks.len() bytes; the source is host memory
            // the caller keeps until the step's kernels ran (host experts live on).
            check(
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(at, blocks, self.stream.cu_stream())
                },
                "streamed experts",
            );
        }
        let n = groups as i64;
        // SAFETY: bytes holds groups · 17 bytes.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.mxfp4_ggml_to_pairs)
                    .arg(&mut bytes)
                    .arg(&n)
                    .launch(grid_for(groups))
            },
            "mxfp4 pair order",
        );
        DevicePart {
            first_row: 0,
            rows,
            format: PackedFormat::Mxfp4,
            bytes,
            scales: check(self.stream.alloc_zeros::<f32>(1), "streamed experts"),
        }
    }

    /// `pin_host`: `region` registered with the driver (page-locked) until the guard drops.
    pub(super) fn pin(&self, region: &[u8]) -> Option<crate::kernels::HostPin> {
        self.ctx.bind_to_thread().ok()?;
        let at = region.as_ptr() as *mut std::ffi::c_void;
        // SAFETY: the region is live host memory; the guard unregisters it before the
        // caller frees it (`Backend::pin_host`'s contract).
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(at, region.len(), 0) };
        (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then(|| {
            Box::new(Pinned {
                ctx: self.ctx.clone(),
                at: at as usize,
            }) as crate::kernels::HostPin
        })
    }

    fn random_mxfp4(&self, rows: usize, cols: usize, seed: u64) -> DevicePart {
        let groups = rows * cols / MXFP4_GROUP;
        let mut bytes = check(
            self.stream.alloc_zeros::<u8>((groups * 17).max(1)),
            "weights",
        );
        let (n, exponent) = (groups as i64, crate::kernels::fp4::DUMMY_EXPONENT as i32);
        // SAFETY: bytes holds groups · 17 bytes.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.random_mxfp4)
                    .arg(&mut bytes)
                    .arg(&n)
                    .arg(&seed)
                    .arg(&exponent)
                    .launch(grid_for(groups))
            },
            "random mxfp4",
        );
        DevicePart {
            first_row: 0,
            rows,
            format: PackedFormat::Mxfp4,
            bytes,
            scales: check(self.stream.clone_htod(&[0f32]), "weight upload"),
        }
    }

    fn random_bf16(&self, n: usize, seed: u64, mean: f32, half_width: f32) -> CudaSlice<bf16> {
        let mut w = check(self.stream.alloc_zeros::<bf16>(n.max(1)), "weights");
        let n64 = n as i64;
        // SAFETY: w holds n elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.random_bf16)
                    .arg(&mut w)
                    .arg(&n64)
                    .arg(&seed)
                    .arg(&mean)
                    .arg(&half_width)
                    .launch(grid_for(n))
            },
            "random weights",
        );
        w
    }

    /// `--quantization fp8` on the device: the dense values placed there (random ones made
    /// there) and quantized per row by `quantize_fp8_rows`, as the CPU's
    /// `Fp8Matrix::quantize_rows` does.
    fn quantize_fp8(&self, dense: HostData, rows: usize, cols: usize) -> DevicePart {
        let mut bytes = check(
            self.stream.alloc_zeros::<u8>((rows * cols).max(1)),
            "weights",
        );
        let mut scales = check(self.stream.alloc_zeros::<f32>(rows.max(1)), "weights");
        let (f32_src, bf16_src) = match dense {
            HostData::Random {
                seed,
                mean,
                half_width,
            } => (
                None,
                Some(self.random_bf16(rows * cols, seed, mean, half_width)),
            ),
            HostData::Bf16(v) => (None, Some(check(self.stream.clone_htod(&v), "upload"))),
            other => (
                Some(check(
                    self.stream.clone_htod(&other.into_f32(rows * cols)),
                    "upload",
                )),
                None,
            ),
        };
        let ptr = |s: Option<u64>| s.unwrap_or(0);
        let f32_ptr = ptr(f32_src.as_ref().map(|s| s.device_ptr(&self.stream).0));
        let bf16_ptr = ptr(bf16_src.as_ref().map(|s| s.device_ptr(&self.stream).0));
        let k = cols as i32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the source holds rows·cols values, bytes rows·cols and scales rows.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.quantize_fp8_rows)
                    .arg(&mut bytes)
                    .arg(&mut scales)
                    .arg(&f32_ptr)
                    .arg(&bf16_ptr)
                    .arg(&k)
                    .launch(cfg)
            },
            "quantize fp8",
        );
        DevicePart {
            first_row: 0,
            rows,
            format: PackedFormat::Fp8 {
                block_rows: 1,
                block_cols: cols.max(1),
            },
            bytes,
            scales,
        }
    }

    /// The packed matrix `m` dequantized to bf16 into `out` (at least rows·cols long).
    pub(super) fn dequantize_into(&self, m: &CudaMatrix, out: u64) {
        let Store::Packed(parts) = &m.store else {
            return;
        };
        for p in parts {
            let (block_rows, block_cols) = p.format.blocks();
            let (fmt, first, rows, k) = (
                p.format.code(),
                p.first_row as i32,
                p.rows as i32,
                m.cols as i32,
            );
            let threads = match p.format {
                PackedFormat::Fp8 { .. } => p.rows * m.cols,
                PackedFormat::Ggml(_) | PackedFormat::Mxfp4 => p.rows * m.cols / 32,
            };
            // SAFETY: out holds m.rows·m.cols bf16; the part's bytes and scales are its own.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.dequant_bf16)
                        .arg(&out)
                        .arg(&p.bytes)
                        .arg(&p.scales)
                        .arg(&fmt)
                        .arg(&block_rows)
                        .arg(&block_cols)
                        .arg(&first)
                        .arg(&rows)
                        .arg(&k)
                        .launch(grid_for(threads))
                },
                "dequantize",
            );
        }
    }

    /// A bf16 copy of `m` (DeepSeek-V4's row splits work on bf16 matrices).
    pub(super) fn bf16_copy(&self, m: &CudaMatrix) -> CudaSlice<bf16> {
        let n = m.rows * m.cols;
        let mut out = check(self.stream.alloc_zeros::<bf16>(n.max(1)), "weights");
        match &m.store {
            Store::Bf16(w) => check(self.stream.memcpy_dtod(w, &mut out), "copy"),
            Store::Packed(_) => {
                let ptr = out.device_ptr(&self.stream).0;
                self.dequantize_into(m, ptr);
            }
        }
        out
    }
}

/// Host memory registered with the driver (`CudaBackend::pin`).
struct Pinned {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    at: usize,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `at` was registered by `pin` and is still live (the guard drops first).
            let _ = unsafe {
                cudarc::driver::sys::cuMemHostUnregister(self.at as *mut std::ffi::c_void)
            };
        }
    }
}
