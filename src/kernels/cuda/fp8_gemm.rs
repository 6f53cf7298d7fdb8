//! FP8 GEMMs on Hopper's FP8 tensor cores, through cuBLASLt, for batches past the GEMV's
//! 8 rows (prefill, wide decode): the weights stay the e4m3 bytes the checkpoint ships, the
//! activations are quantized to e4m3 at run time (`fp8_act.cu`), and cuBLASLt applies both
//! scales — per channel × per token, or DeepSeek's 128×128 weight blocks × 128-column
//! activation groups (cuBLAS 12.9's block scaling on Hopper). Other layouts take the
//! dequantize-then-bf16 path.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result;
use cudarc::cublaslt::sys::{
    self as lt, cublasComputeType_t, cublasLtMatmulDescAttributes_t as Attr,
    cublasLtMatmulMatrixScale_t as ScaleMode, cudaDataType,
};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::weights::{DevicePart, PackedFormat};
use super::{CudaBackend, CudaMatrix, check};
use crate::sync::Mutex;

/// How a part's scales pair with the activations' in cuBLASLt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Scaling {
    /// A scale per weight row and per token (`OUTER_VEC_32F` both sides).
    PerChannel,
    /// 128×128 weight blocks and 128-column activation groups.
    Blocks128,
}

impl Scaling {
    /// The scaling a part can run with at width `cols`, if any. Block scales must be in
    /// cuBLASLt's K-major grid with a column stride that is a multiple of 4, which the
    /// checkpoint's row-major grid is when `cols` is a multiple of 512 (whole groups).
    fn of(part: &DevicePart, cols: usize) -> Option<Scaling> {
        let PackedFormat::Fp8 {
            block_rows,
            block_cols,
        } = part.format
        else {
            return None;
        };
        let shapes_fit = cols.is_multiple_of(16)
            && part.rows.is_multiple_of(4)
            && part.first_row.is_multiple_of(4);
        match (block_rows, block_cols) {
            (1, c) if c >= cols && shapes_fit => Some(Scaling::PerChannel),
            (128, 128) if shapes_fit && cols.is_multiple_of(512) => Some(Scaling::Blocks128),
            _ => None,
        }
    }

    /// `fp8_act.cu`'s `group` for the activations.
    fn group(self) -> i32 {
        match self {
            Scaling::PerChannel => 0,
            Scaling::Blocks128 => 128,
        }
    }

    fn modes(self) -> (ScaleMode, ScaleMode) {
        match self {
            Scaling::PerChannel => (
                ScaleMode::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                ScaleMode::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
            ),
            Scaling::Blocks128 => (
                ScaleMode::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                ScaleMode::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
            ),
        }
    }
}

/// One GEMM shape's descriptors and the algorithm cuBLASLt chose for it.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

/// (weight rows, padded tokens, K, output stride, scaling).
type PlanKey = (usize, usize, usize, usize, Scaling);

/// The cuBLASLt handle and its plans, made on the first FP8 GEMM. `None` plans are shapes
/// cuBLASLt has no algorithm for (those take the dequantize path).
pub(super) struct Fp8Lt {
    handle: lt::cublasLtHandle_t,
    plans: Mutex<HashMap<PlanKey, Option<Plan>>>,
}

// SAFETY: the handle and descriptors are only used under `plans`' lock, and every matmul
// goes to the backend's one stream.
unsafe impl Send for Fp8Lt {}
unsafe impl Sync for Fp8Lt {}

impl Drop for Fp8Lt {
    fn drop(&mut self) {
        let plans = std::mem::take(&mut *self.plans.lock().unwrap_or_else(|e| e.into_inner()));
        // SAFETY: nothing uses these after the backend is dropped.
        unsafe {
            for plan in plans.into_values().flatten() {
                let _ = result::destroy_matrix_layout(plan.a);
                let _ = result::destroy_matrix_layout(plan.b);
                let _ = result::destroy_matrix_layout(plan.d);
                let _ = result::destroy_matmul_desc(plan.desc);
            }
            let _ = result::destroy_handle(self.handle);
        }
    }
}

/// e4m3 activations, their scales and an output for token counts cuBLASLt cannot take
/// as they are; grown on demand.
pub(super) struct Fp8Activations {
    xq: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    padded_out: CudaSlice<f32>,
}

fn lt_check<T>(r: Result<T, result::CublasError>, what: &str) -> T {
    check(r, what)
}

impl Fp8Lt {
    fn new() -> Self {
        Fp8Lt {
            handle: lt_check(result::create_handle(), "cublasLtCreate"),
            plans: Mutex::new(HashMap::new()),
        }
    }

    /// The plan for `key`, made (and its algorithm chosen) on first use.
    /// The plan for `key`, made (and its algorithm chosen) on first use; `scales` are the
    /// (weight, activation) scale pointers of this call.
    fn plan<R>(
        &self,
        key: PlanKey,
        workspace_bytes: usize,
        scales: (u64, u64),
        run: impl FnOnce(&Plan) -> R,
    ) -> Option<R> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = plans
            .entry(key)
            .or_insert_with(|| self.make_plan(key, workspace_bytes, scales));
        plan.as_ref().map(|plan| {
            set_scales(plan.desc, scales);
            run(plan)
        })
    }

    fn make_plan(&self, key: PlanKey, workspace_bytes: usize, scales: (u64, u64)) -> Option<Plan> {
        let (rows, tokens, k, ldd, scaling) = key;
        let set = |desc, attr: Attr, value: &dyn AsBytes| {
            // SAFETY: `value` is the attribute's type, as cublasLt.h declares it.
            lt_check(
                unsafe { result::set_matmul_desc_attribute(desc, attr, value.ptr(), value.len()) },
                "cublasLtMatmulDescSetAttribute",
            )
        };
        let desc = lt_check(
            result::create_matmul_desc(
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cudaDataType::CUDA_R_32F,
            ),
            "cublasLtMatmulDescCreate",
        );
        let (a_mode, b_mode) = scaling.modes();
        set(
            desc,
            Attr::CUBLASLT_MATMUL_DESC_TRANSA,
            &(cublasOperation_t::CUBLAS_OP_T as i32),
        );
        set(
            desc,
            Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            &(a_mode as i32),
        );
        set(
            desc,
            Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            &(b_mode as i32),
        );
        // The heuristic refuses vector scale modes without their pointers.
        set_scales(desc, scales);
        // Row-major out[tokens, rows] = x[tokens, k] · wᵀ is column-major D = Wᵀ · X with
        // W stored k × rows: the "TN" layout FP8 kernels require.
        let layout = |ty, r: usize, c: usize, ld: usize| {
            lt_check(
                result::create_matrix_layout(ty, r as u64, c as u64, ld as i64),
                "cublasLtMatrixLayoutCreate",
            )
        };
        let a = layout(cudaDataType::CUDA_R_8F_E4M3, k, rows, k);
        let b = layout(cudaDataType::CUDA_R_8F_E4M3, k, tokens, k);
        let d = layout(cudaDataType::CUDA_R_32F, rows, tokens, ldd);
        let pref = lt_check(
            result::create_matmul_pref(),
            "cublasLtMatmulPreferenceCreate",
        );
        // SAFETY: the attribute is a size_t.
        lt_check(
            unsafe {
                result::set_matmul_pref_attribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&workspace_bytes as *const usize).cast(),
                    std::mem::size_of::<usize>(),
                )
            },
            "cublasLtMatmulPreferenceSetAttribute",
        );
        // SAFETY: every descriptor is live.
        let heuristic =
            unsafe { result::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref) };
        // SAFETY: made above, used by nothing else.
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        match heuristic {
            Ok(h) => Some(Plan {
                desc,
                a,
                b,
                d,
                algo: h.algo,
            }),
            Err(e) => {
                tracing::warn!(
                    rows,
                    tokens,
                    k,
                    ?scaling,
                    "cuBLASLt has no FP8 GEMM for this shape ({e:?}); dequantizing to bf16 instead"
                );
                // SAFETY: made above, used by nothing else.
                unsafe {
                    let _ = result::destroy_matrix_layout(a);
                    let _ = result::destroy_matrix_layout(b);
                    let _ = result::destroy_matrix_layout(d);
                    let _ = result::destroy_matmul_desc(desc);
                }
                None
            }
        }
    }
}

/// The (A = weight, B = activation) scale pointers of `desc`.
fn set_scales(desc: lt::cublasLtMatmulDesc_t, (weights, activations): (u64, u64)) {
    for (attr, ptr) in [
        (Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, weights),
        (Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, activations),
    ] {
        // SAFETY: the attribute is a device pointer.
        lt_check(
            unsafe {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    (&ptr as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            },
            "cublasLtMatmulDescSetAttribute",
        );
    }
}

/// A descriptor attribute's bytes.
trait AsBytes {
    fn ptr(&self) -> *const c_void;
    fn len(&self) -> usize;
}

impl<T: Copy> AsBytes for T {
    fn ptr(&self) -> *const c_void {
        (self as *const T).cast()
    }
    fn len(&self) -> usize {
        std::mem::size_of::<T>()
    }
}

impl CudaBackend {
    /// `out[m, w.rows] = x[m, w.cols] · wᵀ` on FP8 tensor cores, a cuBLASLt matmul per
    /// part; false, having launched nothing, where a part's layout or shape has none.
    pub(super) fn fp8_gemm(
        &self,
        x: u64,
        m: usize,
        w: &CudaMatrix,
        parts: &[DevicePart],
        out: u64,
    ) -> bool {
        let k = w.cols;
        if !self.fp8_gemm {
            return false;
        }
        let Some(scalings) = parts
            .iter()
            .map(|p| Scaling::of(p, k))
            .collect::<Option<Vec<_>>>()
        else {
            return false;
        };
        if !w.rows.is_multiple_of(4) {
            return false;
        }
        let lt = self.fp8_lt.get_or_init(Fp8Lt::new);
        // cuBLASLt's scale layouts need N (tokens) a multiple of 4: padding rows are zeros,
        // and their outputs land in a scratch when `out` has no room for them.
        let tokens = m.next_multiple_of(4);
        let groups = k.div_ceil(128);
        let mut acts = self.fp8_activations(tokens * k, tokens * groups, tokens * w.rows);
        let acts = acts.as_mut().expect("allocated above");
        let (ws_ptr, ws_bytes) = self.cublas_workspace();
        let d_base = if tokens == m {
            out
        } else {
            acts.padded_out.device_ptr_mut(&self.stream).0
        };
        let mut quantized = None;
        for (p, &scaling) in parts.iter().zip(&scalings) {
            if quantized != Some(scaling) {
                self.quantize_activations(x, m, tokens, k, scaling, acts);
                quantized = Some(scaling);
            }
            let key = (p.rows, tokens, k, w.rows, scaling);
            let (xq, _gx) = acts.xq.device_ptr(&self.stream);
            let (xs, _gs) = acts.scales.device_ptr(&self.stream);
            let (wq, _gw) = p.bytes.device_ptr(&self.stream);
            let (ws, _gws) = p.scales.device_ptr(&self.stream);
            let d = d_base + 4 * p.first_row as u64;
            let ran = lt.plan(key, ws_bytes, (ws, xs), |plan| {
                let (alpha, beta) = (1.0f32, 0.0f32);
                // SAFETY: the part holds rows·k bytes and its scale grid; xq tokens·k bytes
                // and their scales; d has room for tokens rows of stride w.rows; the
                // workspace is the backend's, on this stream.
                lt_check(
                    unsafe {
                        result::matmul(
                            lt.handle,
                            plan.desc,
                            (&alpha as *const f32).cast(),
                            (&beta as *const f32).cast(),
                            wq as *const c_void,
                            plan.a,
                            xq as *const c_void,
                            plan.b,
                            d as *const c_void,
                            plan.d,
                            d as *mut c_void,
                            plan.d,
                            &plan.algo,
                            ws_ptr as *mut c_void,
                            ws_bytes,
                            self.stream.cu_stream() as _,
                        )
                    },
                    "cublasLtMatmul",
                );
            });
            if ran.is_none() {
                // Only the first part can fail this way before anything is written: plans
                // are per shape, and a GEMM's parts are tried in order.
                assert!(
                    std::ptr::eq(p, &parts[0]),
                    "cuBLASLt took one part of a GEMM and refused another"
                );
                return false;
            }
        }
        if tokens != m {
            let bytes = m * w.rows * 4;
            // SAFETY: both regions hold m·w.rows f32 on this device.
            check(
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        out,
                        d_base,
                        bytes,
                        self.stream.cu_stream(),
                    )
                },
                "fp8 gemm copy",
            );
        }
        true
    }

    fn quantize_activations(
        &self,
        x: u64,
        m: usize,
        tokens: usize,
        k: usize,
        scaling: Scaling,
        acts: &mut Fp8Activations,
    ) {
        let (mi, ti, ki, group) = (m as i32, tokens as i32, k as i32, scaling.group());
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds m·k f32; xq tokens·k bytes; scales tokens·⌈k/128⌉ f32.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.quantize_fp8_act)
                    .arg(&mut acts.xq)
                    .arg(&mut acts.scales)
                    .arg(&x)
                    .arg(&mi)
                    .arg(&ti)
                    .arg(&ki)
                    .arg(&group)
                    .launch(cfg)
            },
            "quantize fp8 activations",
        );
    }

    /// The FP8 activation buffers, each at least as long as asked.
    fn fp8_activations(
        &self,
        bytes: usize,
        scales: usize,
        out: usize,
    ) -> crate::sync::MutexGuard<'_, Option<Fp8Activations>> {
        let mut acts = self.fp8_acts.lock().unwrap_or_else(|e| e.into_inner());
        let fits = acts.as_ref().is_some_and(|a| {
            a.xq.len() >= bytes && a.scales.len() >= scales && a.padded_out.len() >= out
        });
        if !fits {
            self.moved();
            let grow = |n: usize| n.next_power_of_two().max(1);
            *acts = None;
            *acts = Some(Fp8Activations {
                xq: check(self.stream.alloc_zeros::<u8>(grow(bytes)), "alloc"),
                scales: check(self.stream.alloc_zeros::<f32>(grow(scales)), "alloc"),
                padded_out: check(self.stream.alloc_zeros::<f32>(grow(out)), "alloc"),
            });
        }
        acts
    }
}
