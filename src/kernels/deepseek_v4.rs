//! DeepSeek-V4's own operations as one narrow trait over a backend (candle's pattern: the
//! model writes its forward pass once, each device implements the ops). The CPU backend
//! implements them in `cpu/deepseek_v4/` (the f32 numeric reference), CUDA in
//! `cuda/deepseek_v4/` over `kernels-cuda/deepseek_v4.cu`; the GEMMs, norms and row
//! gathers are `Backend`'s own.
//!
//! Every op works on a whole step: rows are the step's tokens, each tagged by `StepMeta`
//! with its sequence and position, so one launch covers every sequence.

// The ops take a kernel's operands one by one: bundling them would only move the argument
// lists into struct literals at every call.
#![allow(clippy::too_many_arguments)]

use crate::kernels::entry_format::EntryFormat;
use std::ops::Range;

use super::Backend;

/// Per-sequence metadata fields (`deepseek_v4.cu`'s `SEQ_FIELDS`): state slot, position of
/// the chunk's first token, its first row, its length, where the slot's history starts,
/// where its replay of cached positions ends, the offset of its block table.
pub const SEQ_FIELDS: usize = 8;
pub const S_SLOT: usize = 0;
pub const S_POS0: usize = 1;
pub const S_ROW0: usize = 2;
pub const S_LEN: usize = 3;
pub const S_START: usize = 4;
pub const S_REPLAY: usize = 5;
pub const S_TABLE: usize = 6;

/// An indexer selection's filler past a row's last entry (−1 as the kernels' `int`), and
/// an emitted-entry list's padding (`dsv4_entry_finish` skips it: a recorded step's list
/// has a fixed length whatever the step closes).
pub const NO_ENTRY: u32 = u32::MAX;

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// A step's metadata where the ops read it: per row `[sequence, position]`, per sequence
/// its `SEQ_FIELDS`, and the block tables they point into.
pub struct StepMeta<B: DsV4Kernels + ?Sized> {
    pub rows: B::Ids,
    pub seqs: B::Ids,
    pub tables: B::Ids,
    pub num_rows: usize,
    pub num_seqs: usize,
    /// The longest chunk of the step.
    pub max_len: usize,
}

/// One compressor's state for one layer (seed §8.1): per state slot the open window (raw
/// kv and gate rows by position in the window) and, when windows overlap, the last closed
/// window's first-half (Ca) rows; per block the entries it emitted.
pub struct Compressor<B: Backend + ?Sized> {
    pub rate: usize,
    /// Width of a projected row: `2 · dim` when windows overlap, else `dim`.
    pub width: usize,
    /// Width of an emitted entry.
    pub dim: usize,
    pub overlap: bool,
    pub entries_per_block: usize,
    /// How `entries` stores an entry: f32 as computed, or packed (`EntryFormat`) into
    /// `row_len` f32 words of bytes.
    pub format: EntryFormat,
    /// f32 words of `entries` an entry takes.
    pub row_len: usize,
    /// Packed formats: the step's emitted entries (entry index, f32 values) until
    /// `dsv4_entry_finish` norms, ropes and packs them.
    pub staged: Vec<(u32, Vec<f32>)>,
    pub buf_kv: B::Buf,
    pub buf_gate: B::Buf,
    pub prev_kv: B::Buf,
    pub prev_gate: B::Buf,
    pub entries: B::Buf,
}

impl<B: Backend + ?Sized> Compressor<B> {
    /// Floats of one slot's window state in `buf_kv`/`buf_gate` and in `prev_*`.
    pub fn slot_floats(&self) -> (usize, usize) {
        let prev = if self.overlap {
            self.rate * self.dim
        } else {
            0
        };
        (self.rate * self.width, prev)
    }

    pub fn block_floats(&self) -> usize {
        self.entries_per_block * self.row_len
    }
}

/// The indexer's pick for each row (entry indices, `NO_ENTRY` past the last) and its width.
pub type Selection<'a, B> = (&'a <B as DsV4Kernels>::Ids, usize);

/// Where a layer's attention reads its keys.
pub struct AttentionKeys<'a, B: DsV4Kernels + ?Sized> {
    /// The step's own K=V rows.
    pub kv: &'a B::Buf,
    /// Per slot the last `ring_len` K=V rows, at `position % ring_len`.
    pub ring: &'a B::Buf,
    pub ring_len: usize,
    /// How the ring stores a row (`EntryFormat::words(head_dim)` f32 words each).
    pub ring_format: EntryFormat,
    pub window: usize,
    /// The layer's compressed entries and the indexer's selection (`None`: every closed
    /// window).
    pub compressed: Option<(&'a Compressor<B>, Option<Selection<'a, B>>)>,
    pub block_size: usize,
}

/// Which rank of an expert-parallel group computes each routed (expert, token) product:
/// `table` holds per expert its replica count then `replicas` ranks, and a token goes to
/// replica `token % count` (`ExpertShard::owner_table`).
pub struct ExpertOwners<'a, B: DsV4Kernels + ?Sized> {
    pub table: &'a B::Ids,
    pub replicas: usize,
    pub rank: usize,
}

/// A layer's routed experts, each `[gate, up, down]`.
pub type ExpertMatrices<'a, B> = [[&'a <B as Backend>::Matrix; 3]];

/// The dimensions a device's DeepSeek-V4 kernels may bound.
#[derive(Debug, Clone, Copy)]
pub struct DsV4Shape {
    pub hc_mult: usize,
    pub num_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub head_dim: usize,
    pub index_width: usize,
    pub index_head_dim: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DsV4KernelError {
    #[error("DeepSeek-V4 on {device}: {name} = {value}, the kernels handle at most {most}")]
    Shape {
        device: &'static str,
        name: &'static str,
        value: usize,
        most: usize,
    },
    #[error("DeepSeek-V4 on {device}: {name} = {value}, the kernels need a multiple of {of}")]
    NotMultiple {
        device: &'static str,
        name: &'static str,
        value: usize,
        of: usize,
    },
    #[error("DeepSeek-V4 kernels on {device}: {reason}")]
    Unavailable {
        device: &'static str,
        reason: String,
    },
}

/// DeepSeek-V4's operations beyond `Backend`'s (seed §5): mHC, its partial RoPE, the
/// compressors, the lightning indexer, attention with sinks over window and entries, and
/// the MoE's routing and combine.
pub trait DsV4Kernels: Backend {
    /// u32 indices on the device (token ids, metadata, selections, routing).
    type Ids: Send + Sync;
    /// A layer's routed experts as one launch reads them (CUDA: tables of their weights'
    /// device addresses), made once at load.
    type ExpertTable: Send + Sync;
    /// A matrix in equal row blocks, each projecting its own rows of the input (the grouped
    /// output projection), as the backend keeps it; the matrices holding it (whose bytes
    /// are the weights') through `AsRef`.
    type RowGroups: Send + Sync + AsRef<[Self::Matrix]>;

    /// Host work a recorded step can hold (`host_calls.rs`), where the backend has it.
    fn host_calls(&self) -> Option<&dyn super::host_calls::HostCalls<Self::Buf, Self::Ids>>;

    /// Readies the kernels (built on first use) for a model of `shape`, or says which
    /// dimension they cannot take.
    fn dsv4_prepare(&self, shape: &DsV4Shape) -> Result<(), DsV4KernelError>;

    fn upload_ids(&self, ids: &[u32]) -> Self::Ids;
    fn alloc_ids(&self, len: usize) -> Self::Ids;
    fn download_ids(&self, ids: &Self::Ids, len: usize) -> Vec<u32>;
    /// `ids[..data.len()] = data` (`ids` holds at least that many).
    fn write_ids(&self, ids: &mut Self::Ids, data: &[u32]);
    /// Every value of `ids` set to 0, in the step's order on the device.
    fn zero_ids(&self, ids: &mut Self::Ids);
    /// A buffer of `len` values that the next op writes whole before anything reads it.
    fn scratch(&self, len: usize) -> Self::Buf;
    /// `buf[at]` on the host (a state slot's snapshot).
    fn read_floats(&self, buf: &Self::Buf, at: Range<usize>) -> Vec<f32>;
    fn write_floats(&self, buf: &mut Self::Buf, offset: usize, values: &[f32]);
    /// `dst[offset..] = src[at]`, in the step's order on the device (a saved state's copy
    /// in or out).
    fn copy_floats(&self, src: &Self::Buf, at: Range<usize>, dst: &mut Self::Buf, offset: usize);
    /// `m`'s rows in `parts` equal blocks (the grouped output projection's).
    fn row_groups(&self, m: Self::Matrix, parts: usize) -> Self::RowGroups;

    /// `ids[t]` replaced by entry `picked[t]` of the last `pick_rows` picks where that is
    /// not `NOT_PICKED` (one entry per token): rows continuing the last step read its
    /// tokens where they were picked (only where the backend has `device_picks`).
    fn dsv4_take_picks(&self, ids: &mut Self::Ids, picked: &[u32]);
    /// `out[t] = table[ids[t]]` for the first `tokens` ids, `table` f32 rows `dim` wide.
    fn dsv4_embed(
        &self,
        table: &Self::Buf,
        dim: usize,
        ids: &Self::Ids,
        tokens: usize,
        out: &mut Self::Buf,
    );
    /// `x [tokens, hidden]` copied into each of `n` streams `[tokens, n, hidden]`.
    fn dsv4_expand(
        &self,
        streams: &mut Self::Buf,
        x: &Self::Buf,
        tokens: usize,
        n: usize,
        hidden: usize,
    );
    /// mHC's mixing weights from `mixes [tokens, (2+n)·n]`: `post [tokens, n]`, `comb
    /// [tokens, n, n]` (Sinkhorn-projected) and the `pre`-weighted collapse of the streams.
    fn dsv4_mhc_mix(
        &self,
        mixes: &Self::Buf,
        streams: &Self::Buf,
        base: &Self::Buf,
        scale: &Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
        collapsed: &mut Self::Buf,
        tokens: usize,
        n: usize,
        hidden: usize,
        iters: usize,
        hc_eps: f32,
    );
    /// `streams[k] ← post[k] · out + Σ_j comb[j][k] · streams[j]`, per token.
    fn dsv4_mhc_merge(
        &self,
        streams: &mut Self::Buf,
        post: &Self::Buf,
        comb: &Self::Buf,
        out: &Self::Buf,
        tokens: usize,
        n: usize,
        hidden: usize,
    );
    /// The final collapse (`pre` weights from `mixes [tokens, n]` only).
    fn dsv4_mhc_head(
        &self,
        mixes: &Self::Buf,
        streams: &Self::Buf,
        base: &Self::Buf,
        scale: &Self::Buf,
        out: &mut Self::Buf,
        tokens: usize,
        n: usize,
        hidden: usize,
        hc_eps: f32,
    );
    /// `x [a, b, width]` → `y [b, a, width]`.
    fn dsv4_swap(&self, y: &mut Self::Buf, x: &Self::Buf, a: usize, b: usize, width: usize);
    /// `out [parts, rows, block rows]`: block g of `w` times rows g·rows .. (g + 1)·rows
    /// of `x [parts · rows, cols]` (the grouped output projection's groups over their rows).
    fn dsv4_gemm_row_groups(
        &self,
        x: &Self::Buf,
        w: &Self::RowGroups,
        rows: usize,
        out: &mut Self::Buf,
    );
    /// The grouped output projection on the step's layout: `out [rows, groups, n]`, group
    /// g of each row of `x [rows, groups, cols]` times block g (`n` rows) of `w`; without
    /// a kernel for it, `grouped_projection_by_swaps`.
    fn dsv4_grouped_projection(
        &self,
        x: &Self::Buf,
        w: &Self::RowGroups,
        shape: GroupedShape,
        out: &mut Self::Buf,
    );

    /// DeepSeek's interleaved partial RoPE on `heads` rows of `dim` per step row, at the
    /// row's position (`sign` −1 undoes it); `freqs` holds one frequency a pair.
    fn dsv4_rope(
        &self,
        x: &mut Self::Buf,
        meta: &StepMeta<Self>,
        heads: usize,
        dim: usize,
        freqs: &Self::Buf,
        sign: f32,
    );
    /// Feeds the step's projected `kv` and `gate` rows to one compressor and writes the raw
    /// entries of the windows they close (`dsv4_entry_finish` norms and rotates them).
    fn dsv4_compress_feed(
        &self,
        c: &mut Compressor<Self>,
        kv: &Self::Buf,
        gate: &Self::Buf,
        position_bias: &Self::Buf,
        meta: &StepMeta<Self>,
        block_size: usize,
    );
    /// RMS norm and RoPE of the `count` entries `emits` lists (entry index, position).
    fn dsv4_entry_finish(
        &self,
        c: &mut Compressor<Self>,
        emits: &Self::Ids,
        count: usize,
        norm: &Self::Buf,
        eps: f32,
        freqs: &Self::Buf,
    );
    /// The lightning indexer: each row's `k` best visible entries of `keys` by
    /// `Σ_h w_h · relu(q_h · k)`, as torch's `topk` keeps them, in entry order.
    fn dsv4_index_select(
        &self,
        sel: &mut Self::Ids,
        q: &Self::Buf,
        head_weights: &Self::Buf,
        keys: &Compressor<Self>,
        meta: &StepMeta<Self>,
        block_size: usize,
        heads: usize,
        max_visible: usize,
        k: usize,
    );
    /// Attention with a learned sink per head over each row's window and entries (its
    /// head_dim bounded by `dsv4_prepare`).
    fn dsv4_attention(
        &self,
        out: &mut Self::Buf,
        q: &Self::Buf,
        keys: &AttentionKeys<'_, Self>,
        sinks: &Self::Buf,
        meta: &StepMeta<Self>,
        heads: usize,
        head_dim: usize,
    );
    /// Each sequence's last `ring_len` K=V rows into its slot's ring, stored as `format`.
    fn dsv4_ring_write(
        &self,
        ring: &mut Self::Buf,
        kv: &Self::Buf,
        meta: &StepMeta<Self>,
        format: EntryFormat,
        ring_len: usize,
        head_dim: usize,
    );
    /// Router logits → each token's `k` experts (`chosen`) and weights: a frozen table per
    /// token id (`tid2eid`) or the top-k of the biased scores, weighted by the normalised
    /// unbiased scores times `scaling`.
    fn dsv4_moe_route(
        &self,
        chosen: &mut Self::Ids,
        weights: &mut Self::Buf,
        logits: &Self::Buf,
        token_ids: &Self::Ids,
        tid2eid: Option<&Self::Ids>,
        bias: Option<&Self::Buf>,
        scoring: Scoring,
        tokens: usize,
        num_experts: usize,
        k: usize,
        scaling: f32,
    );
    /// `experts` as `dsv4_routed_experts` takes them, or why the kernels cannot.
    fn dsv4_expert_table(
        &self,
        experts: &ExpertMatrices<'_, Self>,
    ) -> Result<Self::ExpertTable, DsV4KernelError>;
    /// Every (token, slot) pair's routed product on `x [tokens, hidden]`, on the device
    /// from `chosen` to `ys` (no read-back): `ys[token·k + slot] = down(swiglu(gate·x,
    /// up·x))` of expert `chosen[token·k + slot]` (`swiglu` as `dsv4_swiglu`), a zero row
    /// where `owners` gives the pair to another rank. Adds each pair to `counts[counts_at +
    /// expert]`, the per-expert load EPLB places experts by.
    fn dsv4_routed_experts(
        &self,
        ys: &mut Self::Buf,
        x: &Self::Buf,
        chosen: &Self::Ids,
        experts: &ExpertMatrices<'_, Self>,
        table: &Self::ExpertTable,
        owners: Option<&ExpertOwners<'_, Self>>,
        counts: &mut Self::Ids,
        counts_at: usize,
        tokens: usize,
        k: usize,
        limit: f32,
    );
    /// `h = silu(min(gate, limit)) · clamp(up, ±limit)`.
    fn dsv4_swiglu(
        &self,
        h: &mut Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
        n: usize,
        limit: f32,
    );
    /// `out[t] += Σ_slot weights[t, slot] · ys[t·k + slot]`, the slots taken in increasing
    /// expert id (`chosen [tokens, k]`).
    fn dsv4_moe_combine(
        &self,
        out: &mut Self::Buf,
        ys: &Self::Buf,
        chosen: &Self::Ids,
        weights: &Self::Buf,
        tokens: usize,
        k: usize,
        hidden: usize,
    );
}

/// `dsv4_grouped_projection`'s sizes: `x [rows, groups, cols]` → `out [rows, groups, n]`.
#[derive(Debug, Clone, Copy)]
pub struct GroupedShape {
    pub rows: usize,
    pub groups: usize,
    pub cols: usize,
    pub n: usize,
}

/// `dsv4_grouped_projection` as the groups' blocks: `x` swapped to `[groups, rows, cols]`,
/// `dsv4_gemm_row_groups`, swapped back.
pub fn grouped_projection_by_swaps<B: DsV4Kernels + ?Sized>(
    b: &B,
    x: &B::Buf,
    w: &B::RowGroups,
    GroupedShape {
        rows,
        groups,
        cols,
        n,
    }: GroupedShape,
    out: &mut B::Buf,
) {
    let mut by_group = b.scratch(rows * groups * cols);
    b.dsv4_swap(&mut by_group, x, rows, groups, cols);
    let mut projected = b.scratch(groups * rows * n);
    b.dsv4_gemm_row_groups(&by_group, w, rows, &mut projected);
    b.dsv4_swap(out, &projected, groups, rows, n);
}
