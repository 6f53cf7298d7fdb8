//! The CUDA backend (`--device cuda`): the `Backend` seam on one GPU. Weights live in bf16,
//! activations and the paged KV cache in f32; GEMMs go through cuBLAS (bf16 operands, f32
//! accumulate and output), everything else through troupe's own kernels in `kernels-cuda/`.
//!
//! One stream per backend, owned by the rank worker's thread; cudarc's per-buffer event
//! tracking is off (the stream orders everything).

mod attention;
mod graph;
mod kv_cache;
mod matmul;
mod module;
mod nccl;
mod picks;
mod recorded;
mod weights;

use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use graph::{Graphs, Meta, Phase};
pub use kv_cache::CudaKvCache;
use module::Kernels;
pub use module::{
    GEMV_ROWS, GQA_GROUPS, GQA_HEAD_DIMS, LLAMA_SOURCE, compile, compile_cubin, kernel_image,
    open_device,
};
pub use nccl::NcclJoin;
use picks::{MAX_PICKS, PickPool};
use recorded::OwnModule;
pub use weights::CudaMatrix;

use super::{Backend, HostMatrix, KvCacheShape, SeqAttention};

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
    /// Split-K attention partials (output, then max and sum); grown on demand.
    attention_parts: Mutex<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    _cublas_workspace: CudaSlice<u8>,
    /// The last picks (ids, logprobs) by pick index.
    picks: Mutex<(CudaSlice<u32>, CudaSlice<f32>)>,
    pick_slots: PickPool,
    /// Sampled rows' order keys and weights, a vocabulary each (`sample_kernel`).
    sample_scratch: Mutex<Option<(CudaSlice<u32>, CudaSlice<f32>)>>,
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
            uploads: Mutex::new(Vec::new()),
            cuda_graphs,
            graphs: Mutex::new(Graphs::new(programmatic)),
            attention_parts: Mutex::new(None),
            _cublas_workspace: workspace,
            picks: Mutex::new((
                stream.alloc_zeros::<u32>(MAX_PICKS).map_err(runtime)?,
                stream.alloc_zeros::<f32>(MAX_PICKS).map_err(runtime)?,
            )),
            pick_slots: Arc::new(Mutex::new(Vec::new())),
            sample_scratch: Mutex::new(None),
            ctx,
            stream,
            blas,
            kernels,
            scratch: Mutex::new(None),
            twin: Mutex::new(None),
        })
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((0, 0))
    }

    pub fn synchronize(&self) {
        check(self.stream.synchronize(), "synchronize");
    }

    fn graphs(&self) -> std::sync::MutexGuard<'_, Graphs> {
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
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Matrix = CudaMatrix;
    type KvCache = CudaKvCache;

    fn join_group(
        &self,
        join: crate::parallel::GroupJoin,
    ) -> Result<Box<dyn crate::parallel::Collective<Self>>, String> {
        match join {
            crate::parallel::GroupJoin::Nccl(join) => Ok(Box::new(self.join_nccl(join)?)),
            crate::parallel::GroupJoin::Channels(_) => {
                Err("a CUDA rank joins its group through NCCL, not in-process channels".into())
            }
        }
    }
    fn device_name(&self) -> String {
        let gpu = self
            .ctx
            .name()
            .unwrap_or_else(|e| format!("unnamed GPU ({e})"));
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: writes one int.
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        format!("cuda {gpu}, driver {driver}, graphs {}", self.cuda_graphs)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload_matrix(&self, m: HostMatrix) -> CudaMatrix {
        self.upload_weights(m)
    }

    fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        check(self.stream.clone_htod(data), "upload")
    }

    fn alloc(&self, len: usize) -> CudaSlice<f32> {
        check(self.stream.alloc_zeros::<f32>(len.max(1)), "alloc")
    }

    fn alloc_kv_cache(&self, shape: KvCacheShape) -> CudaKvCache {
        self.new_kv_cache(shape)
    }

    fn download(&self, buf: &CudaSlice<f32>, len: usize) -> Vec<f32> {
        let mut out = vec![0f32; len];
        check(
            self.stream.memcpy_dtoh(&buf.slice(0..len), &mut out),
            "download",
        );
        out
    }

    fn embedding(&self, table: &CudaMatrix, ids: &[u32], picked: &[u32], out: &mut CudaSlice<f32>) {
        let ids_d = self.upload_u32(Meta::Ids, ids);
        let picked_d = (!picked.is_empty()).then(|| self.upload_u32(Meta::Picked, picked));
        if self.replaying() {
            return;
        }
        let picked_ptr = picked_d.as_ref().map_or(0u64, |p| p.ptr);
        let picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let dim = table.cols as i32;
        // SAFETY: ids < table.rows (checked by the scheduler), picked indices < MAX_PICKS,
        // out holds ids.len() rows.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.embedding)
                    .arg(out)
                    .arg(&table.w)
                    .arg(&ids_d.ptr)
                    .arg(&picked_ptr)
                    .arg(&picks.0)
                    .arg(&dim)
                    // Wide blocks: a batch-1 step's one row is a few rounds of loads.
                    .launch(LaunchConfig {
                        block_dim: (1024, 1, 1),
                        ..per_row(ids.len())
                    })
            },
            "embedding",
        );
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        self.gemm(x, num_rows, w, bias, out);
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let d = dim as i32;
        // SAFETY: x and out hold num_rows·dim elements, weight dim.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.rms_norm)
                    .arg(out)
                    .arg(x)
                    .arg(weight)
                    .arg(&eps)
                    .arg(&d)
                    .arg(&0u64)
                    .launch(per_norm_row(num_rows, dim))
            },
            "rms_norm",
        );
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let d = dim as i32;
        // Its output is the next GEMM's operand: the bf16 copy saves that GEMM a launch.
        let twin = self.bf16_twin(out, num_rows * dim);
        // SAFETY: residual, x and out hold num_rows·dim elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.add_rms_norm)
                    .arg(residual)
                    .arg(x)
                    .arg(weight)
                    .arg(&eps)
                    .arg(&d)
                    .arg(&mut *out)
                    .arg(&twin)
                    .launch(per_norm_row(num_rows, dim))
            },
            "add_rms_norm",
        );
    }

    fn add(&self, residual: &mut CudaSlice<f32>, x: &CudaSlice<f32>, len: usize) {
        if self.replaying() {
            return;
        }
        let n = len as i64;
        // SAFETY: both hold len elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.add)
                    .arg(residual)
                    .arg(x)
                    .arg(&n)
                    .launch(grid_for(len))
            },
            "add",
        );
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &CudaSlice<f32>,
    ) {
        let pos = self.upload_u32(Meta::Positions, positions);
        if self.replaying() {
            return;
        }
        let (h, hd) = (num_heads as i32, head_dim as i32);
        // SAFETY: x holds positions.len() rows of num_heads·head_dim; cos_sin covers them.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.rope)
                    .arg(x)
                    .arg(&pos.ptr)
                    .arg(&h)
                    .arg(&hd)
                    .arg(cos_sin)
                    .launch(per_row(positions.len()))
            },
            "rope",
        );
    }

    fn silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        num_rows: usize,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let (r, w) = (num_rows as i32, width as i32);
        let twin = self.bf16_twin(out, num_rows * width);
        // SAFETY: gate_up holds rows·2·width, out rows·width.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.silu_mul)
                    .arg(&mut *out)
                    .arg(gate_up)
                    .arg(&r)
                    .arg(&w)
                    .arg(&twin)
                    .launch(grid_for(num_rows * width))
            },
            "silu_mul",
        );
    }

    fn gate_up_silu(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        width: usize,
        gate_up: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        if !self.gemv_silu(x, num_rows, w, width, out) {
            self.gemm(x, num_rows, w, None, gate_up);
            self.silu_mul(gate_up, num_rows, width, out);
        }
    }

    fn copy_columns(
        &self,
        src: &CudaSlice<f32>,
        src_width: usize,
        col_start: usize,
        width: usize,
        num_rows: usize,
        dst: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let (sw, cs, w, r) = (
            src_width as i32,
            col_start as i32,
            width as i32,
            num_rows as i32,
        );
        // SAFETY: src holds rows·src_width, dst rows·width.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.copy_columns)
                    .arg(dst)
                    .arg(src)
                    .arg(&sw)
                    .arg(&cs)
                    .arg(&w)
                    .arg(&r)
                    .launch(grid_for(num_rows * width))
            },
            "copy_columns",
        );
    }

    fn kv_write(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) {
        self.write_kv(cache, layer, k, v, slots);
    }

    fn qkv_into_cache(
        &self,
        qkv: &CudaSlice<f32>,
        heads: crate::kernels::QkvHeads,
        qk_norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        positions: &[u32],
        cos_sin: &CudaSlice<f32>,
        cache: &mut CudaKvCache,
        layer: usize,
        slots: &[u32],
        q_out: &mut CudaSlice<f32>,
    ) -> bool {
        self.split_qkv_into_cache(
            qkv, heads, qk_norm, positions, cos_sin, cache, layer, slots, q_out,
        )
    }

    fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.attention(q, cache, layer, seqs, num_heads, out);
    }

    fn pick_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[crate::kernels::PickRow<'_>],
    ) -> crate::kernels::Pending<Vec<(u32, f32)>> {
        self.device_picks(logits, vocab, rows)
    }

    fn picks_stay_on_device(&self) -> bool {
        true
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn timeline_mark(&self) -> Option<crate::kernels::DeviceMark> {
        // Not while a graph is being captured: an event recorded then belongs to the graph.
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = self.stream.record_event(Some(flags)).ok()?;
        Some(crate::kernels::DeviceMark::new(EventMark(event)))
    }

    fn download_rows(&self, logits: &CudaSlice<f32>, vocab: usize, rows: &[usize]) -> Vec<f32> {
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            return self.download(logits, rows.len() * vocab);
        }
        let mut packed = self.alloc(rows.len() * vocab);
        self.gather_rows(logits, vocab, rows, &mut packed);
        self.download(&packed, rows.len() * vocab)
    }

    fn graph_rows(&self, num_rows: usize) -> Option<usize> {
        if self.cuda_graphs {
            graph::padded_rows(num_rows)
        } else {
            None
        }
    }

    fn begin_graph_step(&self, rows: usize, max_blocks_per_seq: usize) {
        self.graphs()
            .begin(&self.ctx, &self.stream, rows, max_blocks_per_seq);
    }

    fn end_graph_step(&self) {
        self.graphs().end(&self.stream);
    }

    fn buffers_moved(&self) {
        self.moved();
    }

    fn gather_rows(
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
}

/// A timing event on the backend's stream.
struct EventMark(cudarc::driver::CudaEvent);

impl crate::kernels::TimelineMark for EventMark {
    fn secs_until(&self, later: &dyn crate::kernels::TimelineMark) -> Option<f64> {
        let later = later.as_any().downcast_ref::<EventMark>()?;
        self.0
            .elapsed_ms(&later.0)
            .ok()
            .map(|ms| f64::from(ms.max(0.0)) / 1e3)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
