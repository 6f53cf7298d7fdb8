//! The CUDA backend (`--device cuda`): the `Backend` seam on one GPU (its operations in
//! `backend.rs`). Weights live in bf16, activations in f32, the paged KV cache in bf16 (f32
//! in the batch-invariant mode); GEMMs of up to 4 rows go through troupe's GEMV, wider ones
//! through cuBLAS (bf16 operands, f32 accumulate and output), everything else through
//! troupe's own kernels in `kernels-cuda/`.
//!
//! One stream per backend, owned by the rank worker's thread; cudarc's per-buffer event
//! tracking is off (the stream orders everything).

mod attention;
mod backend;
mod captured;
mod deepseek_v4;
mod fp8_gemm;
mod gemv;
mod graph;
mod graph_launcher;
mod host_calls;
mod invariant;
mod kv_blocks;
mod kv_cache;
mod matmul;
mod mem_pool;
mod module;
pub(crate) mod nccl;
mod picks;
mod recorded;
mod rows;
mod weights;

use crate::sync::Shared as Arc;
use crate::sync::{Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use half::bf16;

pub use deepseek_v4::{
    ATT_MAX_HEAD_DIM, DEEPSEEK_V4_SOURCE, DsV4Program, INDEX_MAX_HEAD_DIM, INDEX_SMEM_BYTES,
    check_shape as check_dsv4_shape,
};
use graph::{Graphs, Meta, Phase};
pub use invariant::invariant_staged_fits;
pub use kv_cache::CudaKvCache;
use module::Kernels;
pub use module::{
    GEMV_ROWS, LLAMA_SOURCE, compile, compile_cubin, gpu_free_bytes, kernel_image, open_device,
    pci_address,
};
pub use nccl::NcclJoin;
use picks::{MAX_PICKS, PickPool};
use recorded::OwnModule;
pub use weights::{CudaMatrix, PackedFormat, Store};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA kernels failed to build: {0}")]
    Compile(String),
    #[error("CUDA: {0}")]
    Runtime(String),
}

/// Per-step metadata uploads kept for reuse: every layer passes the same positions, slots
/// and block tables, so a step uploads each once instead of once per layer.
const UPLOAD_CACHE_ENTRIES: usize = 8;

/// Host contents and their device copy, oldest first.
type UploadCache = Vec<(Vec<u32>, Arc<CudaSlice<u32>>)>;

/// A step's metadata on the device: its address, and the buffer holding it when the upload
/// cache owns one (a graph step's lives in the graph arena).
struct Uploaded {
    ptr: u64,
    _keep: Option<Arc<CudaSlice<u32>>>,
}

/// cuBLAS's workspace, given up front so that no GEMM allocates during a graph capture.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

pub struct CudaBackend {
    /// GEMMs through `matmul_invariant_kernel` (f32 activations, fixed reduction order)
    /// instead of cuBLAS: a row's logits do not depend on its batch.
    pub batch_invariant: bool,
    /// `--quantization fp8`: dense layer projections quantized per channel on the device.
    pub quantization: Option<crate::kernels::fp8::Quantization>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    /// Activations in bf16 for the GEMMs; grown on demand.
    scratch: Mutex<Option<CudaSlice<bf16>>>,
    /// The f32 buffer (address, length) whose bf16 copy `scratch` holds, written by the
    /// kernel that produced it (`matmul.rs`: `bf16_twin`).
    twin: Mutex<Option<(u64, usize)>>,
    /// Recent uploads, newest last; entries are never written after upload.
    uploads: Mutex<UploadCache>,
    /// Decode steps recorded as CUDA graphs (off with `--enforce-eager`).
    cuda_graphs: bool,
    graphs: Mutex<Graphs>,
    /// Whole steps recorded as CUDA graphs (`StepRecorder`; off with `--enforce-eager`).
    captured: Mutex<captured::CapturedSteps>,
    /// Host work inside steps (`HostCalls`): its staging and its flags.
    host_calls: Mutex<host_calls::HostCallState>,
    /// Where steps holding host calls are launched from (`graph_launcher.rs`).
    graph_launcher: OnceLock<graph_launcher::GraphLauncher>,
    /// Whether steps may hold host calls: the runner's choice (on unless
    /// `TROUPE_HOST_CALLS=0`); off for a backend made alone.
    pub host_calls_in_steps: bool,
    /// Split-K attention partials (output, then max and sum); grown on demand.
    attention_parts: Mutex<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    cublas_workspace_buf: CudaSlice<u8>,
    /// The last picks (ids, logprobs) by pick index.
    picks: Mutex<(CudaSlice<u32>, CudaSlice<f32>)>,
    pick_slots: PickPool,
    /// The last picks' ids copied to the host as soon as they are made (`read_picks`): a
    /// rank that needs them before the next step's picks (a grammar's next mask) waits for
    /// them alone, not for the step launched since.
    early_picks: Mutex<picks::EarlyPicks>,
    /// Sampled rows' order keys and weights, a vocabulary each (`sample_kernel`).
    sample_scratch: Mutex<Option<(CudaSlice<u32>, CudaSlice<f32>)>>,
    /// Packed weights dequantized to bf16 for a wide batch's GEMM; sized at upload.
    weight_scratch: Mutex<Option<CudaSlice<bf16>>>,
    /// The invariant GEMM's partial sums of K's splits (`with_splits`); grown on an eager
    /// step, so a captured step neither allocates nor frees it.
    split_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// DeepSeek-V4's program, built when a DeepSeek-V4 model first asks for it.
    dsv4: OnceLock<DsV4Program>,
    /// cuBLASLt for FP8 GEMMs, opened by the first one; off with TROUPE_FP8_GEMM=0, which
    /// dequantizes FP8 weights for cuBLAS as before, to measure what it buys.
    fp8_gemm: bool,
    fp8_lt: OnceLock<fp8_gemm::Fp8Lt>,
    fp8_acts: Mutex<Option<fp8_gemm::Fp8Activations>>,
}

const THREADS: u32 = 256;

fn grid_for(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block a row for the row norms (llama.cu's `rms_norm_row`): a thread for each 16 bytes
/// of the row, so that the row is read in one round of loads.
fn per_norm_row(rows: usize, dim: usize) -> LaunchConfig {
    let threads = if dim.is_multiple_of(4) {
        (dim / 4).next_multiple_of(32).clamp(32, 1024) as u32
    } else {
        THREADS
    };
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Device failures inside a step have no caller to return to: the rank worker dies and
/// its supervisor restarts it.
fn check<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what} failed: {e:?}"))
}

impl CudaBackend {
    pub fn new(
        ordinal: usize,
        batch_invariant: bool,
        cuda_graphs: bool,
    ) -> Result<Self, CudaError> {
        let ctx = open_device(ordinal)?;
        // SAFETY: set before any buffer exists; this backend orders its one stream itself.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::Runtime(e.to_string()))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Runtime(e.to_string()))?;
        let kernels = Kernels::load(&ctx)?;
        let runtime = |e: cudarc::driver::DriverError| CudaError::Runtime(e.to_string());
        let workspace = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
            .map_err(runtime)?;
        {
            let (ptr, _guard) = workspace.device_ptr(&stream);
            // SAFETY: the workspace outlives the handle (both live in the backend).
            let status = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut _,
                    CUBLAS_WORKSPACE_BYTES,
                )
            };
            if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::Runtime(format!(
                    "cublasSetWorkspace: {status:?}"
                )));
            }
        }
        // Programmatic edges need Hopper's griddepcontrol; TROUPE_PDL=0 keeps full
        // dependencies, to measure what they buy.
        let pdl = ctx.compute_capability().map_err(runtime)?.0 >= 9
            && std::env::var("TROUPE_PDL").as_deref() != Ok("0");
        let programmatic = if pdl {
            Some(OwnModule::of(&kernels.embedding).map_err(runtime)?)
        } else {
            None
        };
        Ok(CudaBackend {
            batch_invariant,
            quantization: None,
            uploads: Mutex::new(Vec::new()),
            cuda_graphs,
            graphs: Mutex::new(Graphs::new(programmatic)),
            captured: Mutex::new(captured::CapturedSteps::default()),
            host_calls: Mutex::new(host_calls::HostCallState::default()),
            graph_launcher: OnceLock::new(),
            host_calls_in_steps: false,
            attention_parts: Mutex::new(None),
            cublas_workspace_buf: workspace,
            picks: Mutex::new((
                stream.alloc_zeros::<u32>(MAX_PICKS).map_err(runtime)?,
                stream.alloc_zeros::<f32>(MAX_PICKS).map_err(runtime)?,
            )),
            pick_slots: PickPool::default(),
            early_picks: Mutex::new(picks::EarlyPicks::new(&ctx).map_err(runtime)?),
            sample_scratch: Mutex::new(None),
            dsv4: OnceLock::new(),
            fp8_gemm: std::env::var("TROUPE_FP8_GEMM").as_deref() != Ok("0"),
            fp8_lt: OnceLock::new(),
            fp8_acts: Mutex::new(None),
            ctx,
            stream,
            blas,
            kernels,
            scratch: Mutex::new(None),
            weight_scratch: Mutex::new(None),
            split_scratch: Mutex::new(None),
            twin: Mutex::new(None),
        })
    }

    /// cuBLAS's workspace (address, bytes), shared with cuBLASLt: both run on the one stream.
    fn cublas_workspace(&self) -> (u64, usize) {
        (
            self.cublas_workspace_buf.device_ptr(&self.stream).0,
            CUBLAS_WORKSPACE_BYTES,
        )
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((0, 0))
    }

    pub fn synchronize(&self) {
        check(self.stream.synchronize(), "synchronize");
    }

    fn graphs(&self) -> crate::sync::MutexGuard<'_, Graphs> {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The phase of the step being run: eager, or one of a graph step's.
    fn phase(&self) -> Phase {
        self.graphs().phase
    }

    /// Whether launches are skipped: a replayed step only stages its metadata.
    fn replaying(&self) -> bool {
        matches!(self.phase(), Phase::Replay(_))
    }

    /// A buffer that recorded graphs may use was reallocated.
    fn moved(&self) {
        self.graphs().invalidate();
        self.captured().forget();
    }

    /// How many whole steps ran as a replay of a recorded graph (`StepRecorder`).
    pub fn replayed_steps(&self) -> u64 {
        self.captured().replays
    }

    fn captured(&self) -> crate::sync::MutexGuard<'_, captured::CapturedSteps> {
        self.captured.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The KV cache's entry type: bf16 (half the bytes a decode step reads), except in the
    /// batch-invariant mode, which keeps f32 to match the CPU reference.
    pub fn kv_bf16(&self) -> bool {
        !self.batch_invariant
    }

    fn upload_u32(&self, kind: Meta, data: &[u32]) -> Uploaded {
        {
            let mut graphs = self.graphs();
            if graphs.phase != Phase::Eager {
                let ptr = graphs.upload(&self.stream, kind, data);
                return Uploaded { ptr, _keep: None };
            }
        }
        let mut cache = self.uploads.lock().unwrap_or_else(|e| e.into_inner());
        let dev = if let Some(i) = cache.iter().position(|(host, _)| host.as_slice() == data) {
            let entry = cache.remove(i);
            let dev = entry.1.clone();
            cache.push(entry);
            dev
        } else {
            // An empty upload still needs an address.
            let dev = Arc::new(if data.is_empty() {
                check(self.stream.alloc_zeros::<u32>(1), "upload")
            } else {
                check(self.stream.clone_htod(data), "upload")
            });
            if cache.len() >= UPLOAD_CACHE_ENTRIES {
                cache.remove(0);
            }
            cache.push((data.to_vec(), dev.clone()));
            dev
        };
        let ptr = dev.device_ptr(&self.stream).0;
        Uploaded {
            ptr,
            _keep: Some(dev),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Runs before the model's and the cache's buffers are freed (`OnBackend` declares
        // the backend first), so their frees are not swallowed by an open capture.
        self.graphs().abandon_capture(&self.stream);
        self.captured().abandon_capture(&self.stream);
    }
}
