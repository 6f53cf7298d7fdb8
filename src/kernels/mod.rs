//! The backend seam: everything the model's forward pass asks of a device, and nothing
//! more. CPU implements it here; CUDA (`kernels-cuda`) and Ascend (`kernels-ascend`)
//! implement the same methods.
//!
//! Activations are row-major `[num_tokens, width]` buffers. Per-step metadata (token
//! positions, KV slots, block tables) arrives as host slices; a device backend uploads it
//! once per step.

pub mod collective;
pub mod composed;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_off.rs"]
pub mod cuda;
pub mod deepseek_v4;
mod device;
pub mod entry_format;
pub mod fp4;
pub mod fp8;
mod host;
pub mod host_calls;
pub mod paged_kv;
pub mod quant;

pub use device::Device;
#[cfg(not(feature = "cuda"))]
pub(crate) use device::NO_CUDA;
pub use host::{HostData, HostMatrix, random_weight};
pub use paged_kv::{KvCacheShape, KvDtype, SeqAttention};

/// Host memory a backend keeps page-locked while it lives (`Backend::pin_host`).
pub type HostPin = Box<dyn std::any::Any + Send + Sync>;

pub trait Backend: Send + Sync {
    /// Activations, norms' weights and biases: a flat f32 buffer on the device.
    type Buf: Send + Sync;
    /// A weight matrix `[rows, cols]` on the device, in whatever layout is fastest there.
    type Matrix: Send + Sync;
    /// The paged KV cache of all layers.
    type KvCache: Send + Sync;

    fn name(&self) -> &'static str;
    /// The hardware this backend runs on, as specific as it can tell (for keying
    /// measurements such as the decode latency curve).
    fn device_name(&self) -> String;
    /// This rank's collective for its tensor-parallel group, from what the supervisor
    /// handed out (a backend refuses a kind it cannot use, naming it).
    fn join_group(
        &self,
        join: crate::kernels::collective::GroupJoin,
    ) -> Result<
        Box<dyn crate::kernels::collective::Collective<Self>>,
        crate::kernels::collective::GroupError,
    >
    where
        Self: Sized;
    fn upload_matrix(&self, m: HostMatrix) -> Self::Matrix;
    /// `[rows, cols]` GGML blocks read in place from host memory (a host-resident expert
    /// streamed to the device for one step): `upload_matrix` without the owned copy.
    fn upload_blocks(
        &self,
        rows: usize,
        cols: usize,
        ggml_type: quant::GgmlType,
        blocks: &[u8],
    ) -> Self::Matrix;
    /// Page-locks `region` of host memory for the device's copies until the guard drops
    /// (the guard must drop before the memory does); `None` where the memory is the
    /// backend's own (the CPU's) or the driver refused.
    fn pin_host(&self, region: &[u8]) -> Option<HostPin>;
    /// `--quantization`: how the loader hands this backend dense layer projections.
    fn quantization(&self) -> Option<fp8::Quantization>;
    /// Bytes `m` takes on the device, and what its weights run in (for the model card).
    fn matrix_footprint(&self, m: &Self::Matrix) -> (usize, String);
    fn upload(&self, data: &[f32]) -> Self::Buf;
    /// A zeroed buffer of `len` floats.
    fn alloc(&self, len: usize) -> Self::Buf;
    fn alloc_kv_cache(&self, shape: KvCacheShape) -> Self::KvCache;
    fn download(&self, buf: &Self::Buf, len: usize) -> Vec<f32>;
    /// Host values written into `buf` from element `offset` (an image encoder's rows
    /// over their placeholder tokens' embeddings).
    fn write_at(&self, buf: &mut Self::Buf, offset: usize, data: &[f32]);

    /// `out[t] = table[ids[t]]`, except where `picked` (empty, or one entry per token) is
    /// not `NOT_PICKED`: there the id is entry `picked[t]` of the last `pick_rows` picks,
    /// read where they lie (ZOS without a host round trip; `device_picks`).
    fn embedding(&self, table: &Self::Matrix, ids: &[u32], picked: &[u32], out: &mut Self::Buf);
    /// `out[num_rows, w.rows] = x[num_rows, w.cols] · wᵀ (+ bias)`.
    fn matmul(
        &self,
        x: &Self::Buf,
        num_rows: usize,
        w: &Self::Matrix,
        bias: Option<&Self::Buf>,
        out: &mut Self::Buf,
    );
    /// Row-wise RMSNorm of `x[num_rows, dim]` scaled by `weight[dim]`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Self::Buf,
    );
    /// `rms_norm` whose `out` the next GEMM takes as its input, nothing writing it between:
    /// a backend may leave that GEMM its operand in the GEMM's own format as well.
    fn rms_norm_into_gemm(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Self::Buf,
    );
    /// `residual += x` then `out = rms_norm(residual)`: the residual add fused into the norm.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        residual: &mut Self::Buf,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Self::Buf,
    );
    /// `residual += x`.
    fn add(&self, residual: &mut Self::Buf, x: &Self::Buf, len: usize);
    /// Rotary embedding (half-split / NeoX layout) of `x[num_tokens, num_heads, head_dim]`
    /// in place; `cos_sin` holds `[max_pos, head_dim]` as cos halves then sin halves.
    fn rope(
        &self,
        x: &mut Self::Buf,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &Self::Buf,
    );
    /// Rows of `gate_up` are `[gate (width) | up (width)]`; `out[r] = silu(gate) * up`.
    fn silu_mul(&self, gate_up: &Self::Buf, num_rows: usize, width: usize, out: &mut Self::Buf);
    /// The MLP's activation `out[num_rows, width] = silu(gate) · up` of the stacked
    /// projection `x · wᵀ = [gate (width) | up (width)]`, `gate_up` the product's scratch:
    /// `matmul` then `silu_mul`, unless the backend fuses them.
    fn gate_up_silu(
        &self,
        x: &Self::Buf,
        num_rows: usize,
        w: &Self::Matrix,
        width: usize,
        gate_up: &mut Self::Buf,
        out: &mut Self::Buf,
    );
    /// `dst[r, 0..width] = src[r, col_start..col_start + width]` for `r < num_rows`.
    fn copy_columns(
        &self,
        src: &Self::Buf,
        src_width: usize,
        col_start: usize,
        width: usize,
        num_rows: usize,
        dst: &mut Self::Buf,
    );
    /// Writes token `t`'s K and V (`[num_tokens, kv_dim]`) into cache slot `slots[t]`.
    fn kv_write(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        slots: &[u32],
    );
    /// The stacked projection `qkv[num_tokens, (heads + 2·kv_heads)·head_dim]` into q
    /// (`q_out`, rotated, normalised per head when `qk_norm` gives the q and k norms) and
    /// into `layer` of the cache at `slots` (k normalised and rotated, v as is): what
    /// `copy_columns`, `rms_norm`, `rope` and `kv_write` do one by one (`qkv_by_parts`),
    /// fused where the backend has a kernel for these heads. Returns false, having done
    /// nothing, where it has none: the caller runs `qkv_by_parts` with its own scratch.
    #[allow(clippy::too_many_arguments)]
    fn qkv_into_cache(
        &self,
        qkv: &Self::Buf,
        heads: QkvHeads,
        qk_norm: Option<(&Self::Buf, &Self::Buf, f32)>,
        positions: &[u32],
        cos_sin: &Self::Buf,
        cache: &mut Self::KvCache,
        layer: usize,
        slots: &[u32],
        q_out: &mut Self::Buf,
    ) -> bool;
    /// Blocks `blocks` of every layer's K and V as the cache stores them (codes and
    /// scales where it quantizes), back to back, each the same number of bytes: what a
    /// prefix store keeps. `None` where the cache's layout cannot be read as blocks.
    fn read_kv_blocks(&self, cache: &Self::KvCache, blocks: &[u32]) -> Option<Vec<u8>>;
    /// Fills each `(block, bytes)` from `read_kv_blocks`' bytes of a cache of the same
    /// layout; false where some bytes are not one such block.
    fn write_kv_blocks(&self, cache: &mut Self::KvCache, blocks: &[(u32, &[u8])]) -> bool;
    /// Causal attention of each sequence's query tokens over its paged context.
    /// `q` is `[num_tokens, num_heads * head_dim]`, `out` the same shape.
    fn paged_attention(
        &self,
        q: &Self::Buf,
        cache: &Self::KvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut Self::Buf,
    );
    /// Attention without a mask inside segments (an image encoder's windows): row `r` of
    /// `q`, `k`, `v` (`[num_rows, num_heads · head_dim]`) attends to the rows of its
    /// segment, `bounds` the segments' row offsets from 0 up to `num_rows`; scaled by
    /// `1 / sqrt(head_dim)`.
    #[allow(clippy::too_many_arguments)]
    fn segment_attention(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        bounds: &[usize],
        num_heads: usize,
        head_dim: usize,
        out: &mut Self::Buf,
    );
    /// `x = gelu(x)` (the error-function form) over its first `len` values.
    fn gelu(&self, x: &mut Self::Buf, len: usize);
    /// Copies rows `rows[i]` of `x[_, width]` to row `i` of `out`.
    fn gather_rows(&self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf);
    /// Picks a token for each of `rows` of `[_, vocab]` logits where they lie: per row the
    /// token and its log-probability exactly as `Sampler::sample_row` would choose them for
    /// a row without processors (greedy: the first index of the maximum). The copy to the
    /// host is in flight when this returns; the picks also stay on the device for the next
    /// step's `embedding` until the next call.
    fn pick_rows(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        rows: &[PickRow<'_>],
    ) -> Pending<Vec<(u32, f32)>>;
    /// Picks kept on the device between steps, where the backend keeps them (`None`: every
    /// pick goes to the host as `pick_rows` makes it, and the caller passes ids).
    fn device_picks(&self) -> Option<&dyn DevicePicks>;
    /// A point on the device's timeline after the work launched so far (a CUDA event
    /// with timing), or `None` where the backend has no timeline of its own.
    fn timeline_mark(&self) -> Option<DeviceMark>;
    /// Rows of `[_, vocab]` logits, copied to the host back to back.
    fn download_rows(&self, logits: &Self::Buf, vocab: usize, rows: &[usize]) -> Vec<f32>;
    /// The greedy token of each listed row (the first index of its largest logit) and its
    /// log-probability, waited for; the last picks (`pick_rows`) stay as they are. A draft
    /// model's drafts: on a device only the picks cross to the host.
    fn greedy_rows(&self, logits: &Self::Buf, vocab: usize, rows: &[usize]) -> Vec<(u32, f32)>;

    /// Recorded decode steps (CUDA graphs), where the backend records them.
    fn graphs(&self) -> Option<&dyn StepGraphs>;
    /// Whole steps recorded once and replayed (CUDA graphs), where the backend records
    /// them.
    fn recorder(&self) -> Option<&dyn StepRecorder>;
}

/// Picks that stay on the device (`Backend::device_picks`): the next step's `embedding`
/// reads them where they lie (ZOS without a host round trip), and `pick_rows` takes sampled
/// rows too, not only greedy ones (sampling beside the logits saves their copy to the host).
pub trait DevicePicks {
    /// Tokens `first..first + count` of the last `pick_rows` picks, once they are made
    /// (waits for the device).
    fn read_picks(&self, first: usize, count: usize) -> Vec<u32>;
}

/// A backend's recorded steps of short rows (CUDA graphs): decode rows, and verify rows
/// whose every token is a logit row.
pub trait StepGraphs {
    /// The token count a step of `num_tokens` tokens in `num_seqs` rows of at most
    /// `max_row_tokens` runs at, padded with one-token rows; `None`: no graph for it.
    fn padded_tokens(&self, num_tokens: usize, num_seqs: usize) -> Option<usize>;
    /// The most tokens a row of a recorded step may hold.
    fn max_row_tokens(&self) -> usize;
    /// The token counts steps are recorded at, ascending.
    fn token_counts(&self) -> &'static [usize];
    /// Brackets the forward pass of a step padded to `padded_tokens`' count (through
    /// `GraphStep`, which ends it). Padding rows have KV slot `PAD_SLOT` and see no keys;
    /// nothing else reads them.
    fn begin_step(&self, tokens: usize, max_blocks_per_seq: usize);
    fn end_step(&self);
    /// The caller reallocated buffers it passes to the backend: recorded steps are stale.
    fn buffers_moved(&self);
    /// Within a step begun by `begin_step`: has the device amend the step's metadata for
    /// `rows` (`VerifiedRow`) before its launches, and returns true; false when this step
    /// runs eagerly (its first at a size), and the caller must resolve them itself.
    fn stage_verified(&self, rows: &[StagedVerified<'_>], block_size: usize) -> bool;
}

/// A row whose first token and positions come from a verify row of the step before (greedy,
/// or seeded and drawn by the device), whose picks stay on the device: that row kept the
/// drafts equal to its picks and drew the pick after them. This row was planned as if it
/// kept every draft; it takes the pick it drew and moves back by the drafts it rejected.
#[derive(Debug, Clone, Copy)]
pub struct VerifiedRow<'a> {
    /// The row's index in the step.
    pub row: usize,
    /// The verify row's first pick among the last picks (one per draft and one after).
    pub first_pick: u32,
    /// The drafts that row verified.
    pub drafts: &'a [u32],
}

/// A `VerifiedRow` where the step's metadata holds it: its tokens and its block table.
#[derive(Debug, Clone, Copy)]
pub struct StagedVerified<'a> {
    pub verified: VerifiedRow<'a>,
    pub token_start: usize,
    pub num_tokens: usize,
    /// Where its block table starts among the step's concatenated tables.
    pub table_offset: usize,
}

/// Steps whose launches are recorded once and replayed whole: unlike `StepGraphs`, the
/// host does not run a replayed step's code at all, so everything it reads must already
/// be on the device at fixed addresses, and it must not copy to or from the host, wait,
/// or depend on host values that change between steps of one key.
pub trait StepRecorder {
    /// Runs `body` as the step recorded under `key`: eagerly the first time (lazy
    /// initialization and buffer growth happen then), recorded the second, and replayed
    /// from then on without calling `body`.
    fn run_recorded(&self, key: u64, body: &mut dyn FnMut());
    /// Drops every recorded step: a buffer the caller's steps read moved.
    fn forget_recorded(&self);
}

/// A decode step's forward pass being recorded (or replayed) at a graph's batch size;
/// dropping it ends the step, on every path out of the forward pass.
pub struct GraphStep<'a> {
    graphs: &'a dyn StepGraphs,
}

impl<'a> GraphStep<'a> {
    pub fn begin(graphs: &'a dyn StepGraphs, tokens: usize, max_blocks_per_seq: usize) -> Self {
        graphs.begin_step(tokens, max_blocks_per_seq);
        GraphStep { graphs }
    }
}

impl Drop for GraphStep<'_> {
    fn drop(&mut self) {
        self.graphs.end_step();
    }
}

/// Attention's head layout, for `Backend::qkv_into_cache`.
#[derive(Debug, Clone, Copy)]
pub struct QkvHeads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// A row for `Backend::pick_rows`: its index in the logits, the request's parameters (no
/// processors apply: no bias, bans, penalties or top logprobs; a grammar only as `mask`)
/// and the position that, with the seed, fixes the draw.
#[derive(Debug, Clone, Copy)]
pub struct PickRow<'a> {
    pub row: usize,
    pub params: &'a crate::sampling::SamplingParams,
    pub position: u64,
    /// A row continuing a verify row whose outcome only the device knows: its index
    /// among the rows `StepGraphs::stage_verified` took (`MovedBack::OnDevice`).
    /// `position` is as planned; the draw's moves back by the drafts that row rejected,
    /// as the device counted them.
    pub verified_row: Option<u32>,
    /// The draft a verify row proposed at this logit row, accepted by rejection sampling
    /// (`spec::verify::rejection_pick`): the pick is the draft or, where it is rejected, a
    /// draw from the row's distribution without it. `None`: the plain draw.
    pub draft: Option<u32>,
    /// A grammar's mask over the row (bit `id % 32` of word `id / 32` set where `id` is
    /// allowed, `SeqConstraint::allowed_bits`): the others draw as logits of −∞.
    pub mask: Option<&'a [u32]>,
}

/// How far a row continuing a verify row moved back by the drafts that row rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovedBack {
    /// By this many positions, counted on the host (it read the verify row's picks).
    Positions(usize),
    /// Counted on the device, as the given row of those `StepGraphs::stage_verified` took.
    OnDevice(u32),
}

/// The KV slot of a padding row: `kv_write` skips it.
pub const PAD_SLOT: u32 = u32::MAX;
/// A token whose id is in `ids`, not among the last greedy picks.
pub const NOT_PICKED: u32 = u32::MAX;
/// A device-to-host copy in flight: calling it waits until the data has landed.
pub type Pending<T> = Box<dyn FnOnce() -> T + Send>;

/// A point on a device's timeline. `secs_until(later)` is the device time between the
/// two once both are reached: between one step's last work and the next step's first,
/// the time the device sat idle.
pub struct DeviceMark(Box<dyn TimelineMark>);

pub trait TimelineMark: Send {
    fn secs_until(&self, later: &dyn TimelineMark) -> Option<f64>;
    fn as_any(&self) -> &dyn std::any::Any;
}

impl DeviceMark {
    pub fn new(mark: impl TimelineMark + 'static) -> Self {
        DeviceMark(Box::new(mark))
    }

    pub fn secs_until(&self, later: &DeviceMark) -> Option<f64> {
        self.0.secs_until(later.0.as_ref())
    }
}
