//! Bringing CUDA up without panicking, and the kernels of `kernels-cuda/`: compiled with
//! NVRTC to machine code (CUBIN) for the device's architecture on first use, and cached on
//! disk keyed by a hash of the source, the architecture and the driver version.

use crate::sync::Shared as Arc;
use std::path::PathBuf;

use super::kv_cache::KvEntry;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};
use sha2::{Digest, Sha256};

use super::CudaError;
use crate::kernels::quant::GgmlType;

/// `llama.cu` and the files that use its helpers, as one NVRTC program.
pub const LLAMA_SOURCE: &str = concat!(
    include_str!("../../../kernels-cuda/llama.cu"),
    include_str!("../../../kernels-cuda/split_attention.cu"),
    include_str!("../../../kernels-cuda/mma_tile.cu"),
    include_str!("../../../kernels-cuda/decode_attention.cu"),
    include_str!("../../../kernels-cuda/prefill_attention.cu"),
    include_str!("../../../kernels-cuda/gemv.cu"),
    include_str!("../../../kernels-cuda/packed.cu"),
    include_str!("../../../kernels-cuda/fp8_act.cu"),
    include_str!("../../../kernels-cuda/fp8_mma.cu"),
    include_str!("../../../kernels-cuda/q4k_mma.cu"),
    include_str!("../../../kernels-cuda/invariant_mma.cu"),
    include_str!("../../../kernels-cuda/sample.cu"),
    include_str!("../../../kernels-cuda/host_flags.cu"),
    include_str!("../../../kernels-cuda/vision.cu"),
);

/// Head dims `segment_attention_mma` is compiled for (`vision.cu`'s entries); other heads
/// take the f32 kernel.
pub const SEGMENT_MMA_HEAD_DIMS: [usize; 5] = [16, 32, 64, 80, 128];

/// Rows `gemv` is compiled for (wider batches go to cuBLAS), and the output columns each of
/// its blocks computes.
pub const GEMV_ROWS: [usize; 3] = [1, 2, 4];
pub const GEMV_COLS: [usize; 3] = [2, 2, 4];
/// Threads of a `gemv_narrow` block (`GEMV_NARROW_WARPS` warps).
pub const GEMV_NARROW_THREADS: usize = 512;
/// Rows the tensor-core FP8 GEMV takes (one mma's n).
pub const FP8_MMA_ROWS: usize = 8;
/// Shared memory the tensor-core FP8 GEMV may stage x in as f16 (`fp8_mma.cu`'s
/// `TC_STAGE_BYTES`): rows · cols · 2 bytes at most.
pub const FP8_STAGE_BYTES: usize = 40960;
/// Output columns of each block of the FP8 GEMV (`packed.cu`), for `GEMV_ROWS`.
pub const FP8_GEMV_COLS: [usize; 3] = [4, 4, 4];

/// The context of GPU `ordinal`, or why there is none: libraries missing, no device, an
/// old driver. cudarc panics when a library is missing, so presence is checked first.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    // SAFETY: these only try to dlopen the libraries.
    let (driver, nvrtc, cublas, cublaslt) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
            cudarc::cublaslt::sys::is_culib_present(),
        )
    };
    for (present, name) in [
        (driver, "libcuda"),
        (nvrtc, "libnvrtc"),
        (cublas, "libcublas"),
        (cublaslt, "libcublasLt"),
    ] {
        if !present {
            return Err(CudaError::Unavailable(format!(
                "{name} was not found (set LD_LIBRARY_PATH to the CUDA 13 libraries)"
            )));
        }
    }
    cudarc::driver::result::init().map_err(|e| CudaError::Unavailable(format!("cuInit: {e}")))?;
    let mut version: std::ffi::c_int = 0;
    // SAFETY: writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| CudaError::Unavailable(format!("driver version: {e}")))?;
    if version < 13000 {
        return Err(CudaError::Unavailable(format!(
            "the driver supports CUDA {}.{}; troupe needs 13.0 or newer",
            version / 1000,
            version % 1000 / 10
        )));
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::Unavailable(e.to_string()))?;
    if ordinal as i32 >= count {
        return Err(CudaError::Unavailable(format!(
            "GPU {ordinal} requested; {count} present"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::Unavailable(e.to_string()))?;
    super::mem_pool::keep_freed_memory(&ctx)?;
    Ok(ctx)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("TROUPE_HOME")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("troupe")))
        .unwrap_or_else(|| PathBuf::from(".troupe"))
        .join("cuda-kernels")
}

/// The device code of `source` for compute capability `cc`, as a CUBIN (machine code, so
/// loading it costs the driver no JIT): from the disk cache, or NVRTC.
pub fn kernel_image(source: &str, cc: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    let mut driver: std::ffi::c_int = 0;
    // SAFETY: writes one int.
    let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let key = Sha256::digest(format!("{arch}\n{driver}\n{source}").as_bytes());
    let hex: String = key.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let path = cache_dir().join(format!("{hex}.cubin"));
    if let Ok(image) = std::fs::read(&path) {
        return Ok(image);
    }
    let image = compile_cubin(source, &arch)?;
    // A cache that cannot be written only costs the next start a compile.
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, &image).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(image)
}

fn nvrtc_present() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "libnvrtc.so.13 was not found (pip install nvidia-cuda-nvrtc, or the CUDA toolkit)"
                .into(),
        ));
    }
    Ok(())
}

/// NVRTC's options for troupe's kernels on `arch`. Not --use_fast_math: expf and division
/// stay IEEE, closer to the CPU backend.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}

/// A CUBIN of `source` for a real architecture (`sm_90`), straight from NVRTC (which
/// assembles in-process: no GPU needed).
pub fn compile_cubin(source: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    nvrtc_present()?;
    let nvrtc = |e: cudarc::nvrtc::result::NvrtcError| CudaError::Compile(format!("NVRTC: {e:?}"));
    let src = std::ffi::CString::new(source)
        .map_err(|_| CudaError::Compile("kernel source holds a NUL byte".into()))?;
    let prog = result::create_program(&src, Some(c"llama.cu")).map_err(nvrtc)?;
    // SAFETY: `prog` is a live program until destroyed below; buffers are sized by NVRTC.
    unsafe {
        let compiled = result::compile_program(prog, &nvrtc_options(arch));
        let out = match compiled {
            Err(_) => {
                let log = result::get_program_log(prog).map_err(nvrtc)?;
                let log = std::ffi::CStr::from_ptr(log.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                Err(CudaError::Compile(log))
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(nvrtc)?;
                let mut image = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast())
                    .result()
                    .map_err(nvrtc)?;
                Ok(image)
            }
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// PTX of `source` for `arch` (`compute_90`), straight from NVRTC.
pub fn compile(source: &str, arch: &str) -> Result<String, CudaError> {
    nvrtc_present()?;
    let opts = CompileOptions {
        options: nvrtc_options(arch),
        name: Some("llama.cu".into()),
        ..Default::default()
    };
    Ok(cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| CudaError::Compile(compile_log(e)))?
        .to_src())
}

fn compile_log(e: cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

pub struct Kernels {
    /// Held so the functions' module outlives them whatever cudarc does internally.
    _module: Arc<CudaModule>,
    pub f32_to_bf16: CudaFunction,
    pub embedding: CudaFunction,
    pub add_bias: CudaFunction,
    pub rms_norm: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub add: CudaFunction,
    pub rope: CudaFunction,
    pub silu_mul: CudaFunction,
    pub copy_columns: CudaFunction,
    pub gather_rows: CudaFunction,
    pub segment_attention: CudaFunction,
    /// `segment_attention_mma` (tensor cores) per head_dim (`SEGMENT_MMA_HEAD_DIMS`).
    pub segment_attention_mma: Vec<(usize, CudaFunction)>,
    pub gelu: CudaFunction,
    pub apply_verified: CudaFunction,
    pub kv_write: ByKvType,
    pub qkv_rope_cache: ByKvType,
    pub matmul_invariant: CudaFunction,
    /// The invariant GEMM's splits of K added in order.
    pub matmul_invariant_splits: CudaFunction,
    /// The tensor-core invariant GEMM (`invariant_mma.cu`): 1, 2 and 4 eight-row tiles a
    /// block over 16 features, then 4 tiles over 64 features.
    pub matmul_invariant_mv: [CudaFunction; 4],
    /// The same four reading e4m3 weights with their block scales (`invariant_mma.cu`).
    pub matmul_invariant_fp8_mv: [CudaFunction; 4],
    /// Whether the device gives a block the shared memory of the staged variants (2 and 3:
    /// ~220 KB, Hopper's); where not (an A100 has 163 KB), batches past 16 rows take the
    /// 16-row variant, whose sums are the same.
    pub invariant_staged: bool,
    /// Greedy picks and the CPU sampler's draw for rows without processors.
    pub sample: CudaFunction,
    pub random_bf16: CudaFunction,
    pub attention_split: ByKvType,
    pub attention_combine: CudaFunction,
    /// `attention_decode_mma` (tensor cores, up to 8 query heads per KV head) per head_dim
    /// (64, 128): over a bf16 cache, and over an fp8 one.
    pub attention_decode_mma: Vec<(usize, CudaFunction, CudaFunction)>,
    /// `gemv` compiled for up to `GEMV_ROWS[i]` rows, `GEMV_COLS[i]` columns a block.
    pub gemv: Vec<(usize, usize, CudaFunction)>,
    /// The same, writing silu(gate) · up of a stacked [gate; up] projection.
    pub gemv_silu: Vec<(usize, usize, CudaFunction)>,
    /// The same over equal row blocks of one matrix, each with its own rows of x (grid y:
    /// the block), as DeepSeek-V4's grouped output projection takes them.
    pub gemv_groups: Vec<(usize, usize, CudaFunction)>,
    /// `gemv` for narrow matrices: a column a block of `GEMV_NARROW_THREADS`.
    pub gemv_narrow: Vec<(usize, usize, CudaFunction)>,
    /// The device's multiprocessors: a GEMV with fewer blocks takes `gemv_narrow`.
    pub num_sms: usize,
    /// `packed.cu`'s GEMVs over GGML blocks and FP8, for up to `GEMV_ROWS[i]` rows (FP8:
    /// `GEMV_COLS[i]` columns a block; GGML: one).
    pub gemv_ggml: Vec<(usize, usize, CudaFunction)>,
    pub gemv_fp8: Vec<(usize, usize, CudaFunction)>,
    /// The FP8 GEMV on tensor cores (`gemv_fp8_mma`), up to `FP8_MMA_ROWS` rows.
    pub gemv_fp8_mma: CudaFunction,
    /// The same with x staged in shared memory, where it fits (`FP8_STAGE_BYTES`).
    pub gemv_fp8_mma_staged: CudaFunction,
    /// The staged one with a warp's own 16 rows over all of K (short K, many rows).
    pub gemv_fp8_mma_rows: CudaFunction,
    /// The Q4_K GEMV on tensor cores (`gemv_q4k_mma`), x staged: up to `FP8_MMA_ROWS` rows.
    pub gemv_q4k_mma: CudaFunction,
    /// The Q4_1 GEMV on tensor cores (`gemv_q4_1_mma`), x staged: up to `FP8_MMA_ROWS` rows.
    pub gemv_q4_1_mma: CudaFunction,
    /// Its MLP twin over a stacked [gate; up] (`gemv_fp8_mma_silu`, staged): silu(gate) · up.
    pub gemv_fp8_mma_silu: CudaFunction,
    pub dequant_bf16: CudaFunction,
    pub embedding_packed: CudaFunction,
    pub quantize_fp8_rows: CudaFunction,
    pub random_mxfp4: CudaFunction,
    /// GGUF MXFP4 blocks to troupe's pair order, in place (streamed host experts).
    pub mxfp4_ggml_to_pairs: CudaFunction,
    /// Activations to e4m3 for cuBLASLt's FP8 GEMM (`fp8_act.cu`).
    pub quantize_fp8_act: CudaFunction,
    /// A host call's two points on the stream (`host_flags.cu`).
    pub host_flag_raise: CudaFunction,
    pub host_flag_wait: CudaFunction,
    /// `flash_prefill` (tensor cores) per head_dim (64, 128): over a bf16 cache, and over
    /// an fp8 one.
    pub flash_prefill: Vec<(usize, CudaFunction, CudaFunction)>,
}

/// A kernel's instances for an f32, a bf16 and an fp8 KV cache (the fp8 one takes the
/// scales too).
pub struct ByKvType {
    pub f32: CudaFunction,
    pub bf16: CudaFunction,
    pub fp8: CudaFunction,
}

impl ByKvType {
    pub fn get(&self, entry: KvEntry) -> &CudaFunction {
        match entry {
            KvEntry::F32 => &self.f32,
            KvEntry::Bf16 => &self.bf16,
            KvEntry::Fp8 => &self.fp8,
        }
    }
}

/// Dynamic shared memory of `attention_decode_mma` (the kernel's `DM_SMEM_BYTES`), in bytes:
/// three stages of 64 keys and values, rows padded by 16 bytes; for an fp8 cache one such
/// tile and three stages of codes and scales.
pub fn decode_mma_smem_bytes(head_dim: usize, fp8: bool) -> usize {
    let tile = 2 * 64 * (head_dim + 8) * 2;
    if fp8 {
        tile + 3 * 2 * 64 * (head_dim + 4)
    } else {
        3 * tile
    }
}

/// Query heads per KV head that `attention_decode_mma` handles (its `DM_MAX_GROUP`).
pub const DECODE_MMA_MAX_GROUP: usize = 8;

/// Lets `func` use `smem_bytes` of dynamic shared memory: above 48 KiB, static and dynamic
/// together, it must opt in, so any kernel with dynamic shared memory does.
pub(super) fn opt_in_smem(
    func: &CudaFunction,
    smem_bytes: usize,
    name: &str,
) -> Result<(), CudaError> {
    if smem_bytes > 0 {
        func.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes as i32,
        )
        .map_err(|e| CudaError::Compile(format!("{name} shared memory: {e}")))?;
    }
    Ok(())
}

/// The invariant GEMM's four variants (`invariant_mma.cu`) named `{prefix}_{v}_kernel`, each
/// opted in to its shared stages where the device has them (`staged`).
fn invariant_variants(
    f: &impl Fn(&str) -> Result<CudaFunction, CudaError>,
    prefix: &str,
    fp8: bool,
    staged: bool,
) -> Result<[CudaFunction; 4], CudaError> {
    let load = |variant: usize, v: &str| -> Result<CudaFunction, CudaError> {
        let func = f(&format!("{prefix}_{v}_kernel"))?;
        if staged {
            let smem_bytes = super::invariant::invariant_mv_smem_bytes(variant, fp8);
            opt_in_smem(&func, smem_bytes, prefix)?;
        }
        Ok(func)
    };
    Ok([
        load(0, "mv1")?,
        load(1, "mv2")?,
        load(2, "mv4")?,
        load(3, "wide")?,
    ])
}

impl Kernels {
    /// The tensor-core decode attention kernel for this head_dim and group, if there is one.
    pub fn decode_mma(&self, head_dim: usize, group: usize, fp8: bool) -> Option<&CudaFunction> {
        if group == 0 || group > DECODE_MMA_MAX_GROUP {
            return None;
        }
        let (_, bf16, fp8_fn) = self.attention_decode_mma.iter().find(|k| k.0 == head_dim)?;
        Some(if fp8 { fp8_fn } else { bf16 })
    }

    /// The GEMV kernel for `rows` rows (the smallest compiled for at least that many) and
    /// the output columns of each of its blocks.
    pub fn gemv_for(&self, rows: usize) -> Option<(&CudaFunction, usize)> {
        Self::by_rows(&self.gemv, rows)
    }

    /// The packed GEMV (`fp8` or GGML) for `rows` rows, and the columns of each block.
    pub fn packed_gemv_for(&self, fp8: bool, rows: usize) -> Option<(&CudaFunction, usize)> {
        Self::by_rows(if fp8 { &self.gemv_fp8 } else { &self.gemv_ggml }, rows)
    }

    /// The tensor-core GEMV over GGML type `t` with x staged, where there is one.
    pub fn ggml_mma_gemv(&self, t: GgmlType) -> Option<&CudaFunction> {
        match t {
            GgmlType::Q4K => Some(&self.gemv_q4k_mma),
            GgmlType::Q4_1 => Some(&self.gemv_q4_1_mma),
            _ => None,
        }
    }

    /// `gemv_for`'s twin for narrow matrices (`gemv_narrow`: one column a block).
    pub fn gemv_narrow_for(&self, rows: usize) -> Option<(&CudaFunction, usize)> {
        Self::by_rows(&self.gemv_narrow, rows)
    }

    /// `gemv_for`'s twin over row blocks (`gemv_groups`).
    pub fn gemv_groups_for(&self, rows: usize) -> Option<(&CudaFunction, usize)> {
        Self::by_rows(&self.gemv_groups, rows)
    }

    /// `gemv_for`'s fused-activation twin (`gemv_silu`).
    pub fn gemv_silu_for(&self, rows: usize) -> Option<(&CudaFunction, usize)> {
        Self::by_rows(&self.gemv_silu, rows)
    }

    fn by_rows(
        kernels: &[(usize, usize, CudaFunction)],
        rows: usize,
    ) -> Option<(&CudaFunction, usize)> {
        kernels
            .iter()
            .find(|(m, _, _)| *m >= rows)
            .map(|(_, cols, f)| (f, *cols))
    }

    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let cc = ctx
            .compute_capability()
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        let image = kernel_image(LLAMA_SOURCE, cc)?;
        let module = ctx
            .load_module(Ptx::from_binary(image))
            .map_err(|e| CudaError::Compile(format!("loading the kernels: {e}")))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::Compile(format!("kernel `{name}`: {e}")))
        };
        // Both instances of a kernel; `smem_bytes` of dynamic shared memory opted in.
        let by_kv = |name: &str, smem_bytes: usize| -> Result<ByKvType, CudaError> {
            let load = |suffix: &str| -> Result<CudaFunction, CudaError> {
                let func = f(&format!("{name}_{suffix}_kernel"))?;
                opt_in_smem(&func, smem_bytes, name)?;
                Ok(func)
            };
            Ok(ByKvType {
                f32: load("f32")?,
                bf16: load("bf16")?,
                fp8: load("fp8")?,
            })
        };
        let smem_optin = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| CudaError::Unavailable(e.to_string()))? as usize;
        let staged = super::invariant::invariant_staged_fits(smem_optin);
        Ok(Kernels {
            kv_write: by_kv("kv_write", 0)?,
            qkv_rope_cache: by_kv("qkv_rope_cache", 0)?,
            attention_split: by_kv("attention_split", 0)?,
            flash_prefill: [64, 128]
                .into_iter()
                .map(|hd| {
                    let bf16 = f(&format!("flash_prefill_{hd}_kernel"))?;
                    Ok((hd, bf16, f(&format!("flash_prefill_fp8_{hd}_kernel"))?))
                })
                .collect::<Result<_, CudaError>>()?,
            attention_decode_mma: [64, 128]
                .into_iter()
                .map(|hd| {
                    let load = |name: String, fp8: bool| {
                        let func = f(&name)?;
                        opt_in_smem(&func, decode_mma_smem_bytes(hd, fp8), "attention_decode_mma")?;
                        Ok::<_, CudaError>(func)
                    };
                    let bf16 = load(format!("attention_decode_mma_{hd}_kernel"), false)?;
                    Ok((hd, bf16, load(format!("attention_decode_mma_fp8_{hd}_kernel"), true)?))
                })
                .collect::<Result<_, CudaError>>()?,

            f32_to_bf16: f("f32_to_bf16_kernel")?,
            embedding: f("embedding_kernel")?,
            add_bias: f("add_bias_kernel")?,
            rms_norm: f("rms_norm_kernel")?,
            add_rms_norm: f("add_rms_norm_kernel")?,
            add: f("add_kernel")?,
            rope: f("rope_kernel")?,
            silu_mul: f("silu_mul_kernel")?,
            copy_columns: f("copy_columns_kernel")?,
            gather_rows: f("gather_rows_kernel")?,
            segment_attention: f("segment_attention_kernel")?,
            segment_attention_mma: SEGMENT_MMA_HEAD_DIMS
                .into_iter()
                .map(|hd| Ok((hd, f(&format!("segment_attention_mma_{hd}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gelu: f("gelu_kernel")?,
            apply_verified: f("apply_verified_kernel")?,
            matmul_invariant: f("matmul_invariant_kernel")?,
            matmul_invariant_splits: f("matmul_invariant_splits_kernel")?,
            matmul_invariant_mv: invariant_variants(&f, "matmul_invariant", false, staged)?,
            matmul_invariant_fp8_mv: invariant_variants(&f, "matmul_invariant_fp8", true, staged)?,
            invariant_staged: staged,
            sample: f("sample_kernel")?,
            random_bf16: f("random_bf16_kernel")?,
            attention_combine: f("attention_combine_kernel")?,
            gemv: GEMV_ROWS
                .iter()
                .zip(GEMV_COLS)
                .map(|(&m, cols)| Ok((m, cols, f(&format!("gemv_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gemv_silu: GEMV_ROWS
                .iter()
                .zip(GEMV_COLS)
                .map(|(&m, cols)| Ok((m, cols, f(&format!("gemv_silu_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gemv_groups: GEMV_ROWS
                .iter()
                .zip(GEMV_COLS)
                .map(|(&m, cols)| Ok((m, cols, f(&format!("gemv_groups_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gemv_narrow: GEMV_ROWS
                .iter()
                .map(|&m| Ok((m, 1, f(&format!("gemv_narrow_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            num_sms: ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                )
                .map_err(|e| CudaError::Unavailable(e.to_string()))? as usize,
            gemv_ggml: GEMV_ROWS
                .iter()
                .map(|&m| Ok((m, 1, f(&format!("gemv_ggml_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gemv_fp8: GEMV_ROWS
                .iter()
                .zip(FP8_GEMV_COLS)
                .map(|(&m, cols)| Ok((m, cols, f(&format!("gemv_fp8_{m}_kernel"))?)))
                .collect::<Result<_, CudaError>>()?,
            gemv_fp8_mma: f("gemv_fp8_mma_kernel")?,
            gemv_fp8_mma_staged: f("gemv_fp8_mma_staged_kernel")?,
            gemv_fp8_mma_rows: f("gemv_fp8_mma_rows_kernel")?,
            gemv_fp8_mma_silu: f("gemv_fp8_mma_silu_kernel")?,
            gemv_q4k_mma: f("gemv_q4k_mma_kernel")?,
            gemv_q4_1_mma: f("gemv_q4_1_mma_kernel")?,
            dequant_bf16: f("dequant_bf16_kernel")?,
            embedding_packed: f("embedding_packed_kernel")?,
            quantize_fp8_rows: f("quantize_fp8_rows_kernel")?,
            random_mxfp4: f("random_mxfp4_kernel")?,
            mxfp4_ggml_to_pairs: f("mxfp4_ggml_to_pairs_kernel")?,
            quantize_fp8_act: f("quantize_fp8_act_kernel")?,
            host_flag_raise: f("host_flag_raise_kernel")?,
            host_flag_wait: f("host_flag_wait_kernel")?,
            _module: module,
        })
    }
}

/// GPU `ordinal`'s PCI address as sysfs names it (`0000:3b:00.0`), or `None` when the
/// driver cannot tell (no library, no such device).
pub fn pci_address(ordinal: usize) -> Option<String> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    cudarc::driver::result::init().ok()?;
    let dev = cudarc::driver::result::device::get(ordinal as std::ffi::c_int).ok()?;
    use cudarc::driver::sys::CUdevice_attribute as A;
    // SAFETY: `dev` came from `device::get`.
    let attr = |a| unsafe { cudarc::driver::result::device::get_attribute(dev, a) }.ok();
    let domain = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.0"))
}

/// GPU `ordinal`'s free memory in bytes.
pub fn gpu_free_bytes(ordinal: usize) -> Result<usize, String> {
    let ctx = open_device(ordinal).map_err(|e| e.to_string())?;
    let (free, _) = ctx.mem_get_info().map_err(|e| e.to_string())?;
    Ok(free)
}
