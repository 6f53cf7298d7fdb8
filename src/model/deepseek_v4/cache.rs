//! DeepSeek-V4's cache (seed §8.1): what stays a fixed size per sequence lives in a state
//! slot (the sliding-window ring of shared K=V, each compressor's partial window, the
//! CSA overlap state); what grows with the context lives in paged blocks (compressed KV
//! entries, the indexer's compressed keys), one entry per `rate` source tokens, so a
//! block of `block_size` source tokens holds `block_size / rate` entries of a layer.

use super::config::{AttentionKind, DsV4Config};
use crate::kernels::KvDtype;
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::{Compressor, DsV4Kernels};
use crate::kernels::entry_format::EntryFormat;

/// How the cache stores its rows (`--kv-cache-dtype`): the compressors' main entries,
/// the indexer's keys, and the sliding-window ring's K=V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct CacheFormats {
    pub main: EntryFormat,
    pub index: EntryFormat,
    pub ring: EntryFormat,
}

impl CacheFormats {
    /// `--kv-cache-dtype`'s layout: auto keeps f32; fp8 and fp4 are the seed's (main
    /// entries so, MXFP4 indexer keys, an FP8 ring); bf16 stores everything in bf16.
    pub fn for_dtype(dtype: KvDtype) -> Self {
        let (main, index, ring) = match dtype {
            KvDtype::Auto => (EntryFormat::F32, EntryFormat::F32, EntryFormat::F32),
            KvDtype::Bf16 => (EntryFormat::Bf16, EntryFormat::Bf16, EntryFormat::Bf16),
            KvDtype::Fp8 => (EntryFormat::Fp8, EntryFormat::Mxfp4, EntryFormat::Fp8),
            KvDtype::Fp4 => (EntryFormat::Fp4, EntryFormat::Mxfp4, EntryFormat::Fp8),
        };
        CacheFormats { main, index, ring }
    }

    /// Why `cfg`'s entries cannot be stored so, if they cannot.
    pub fn problem(&self, cfg: &DsV4Config) -> Option<String> {
        self.main
            .problem(cfg.head_dim)
            .or_else(|| self.ring.problem(cfg.head_dim))
            .or_else(|| self.index.problem(cfg.index_head_dim))
    }
}

#[allow(clippy::too_many_arguments)]
fn compressor<B: DsV4Kernels>(
    b: &B,
    rate: usize,
    dim: usize,
    overlap: bool,
    format: EntryFormat,
    num_slots: usize,
    num_blocks: usize,
    block_size: usize,
) -> Compressor<B> {
    let width = if overlap { 2 * dim } else { dim };
    let prev = if overlap { rate * dim } else { 0 };
    let entries_per_block = block_size / rate;
    let row_len = format.words(dim);
    Compressor {
        rate,
        width,
        dim,
        overlap,
        entries_per_block,
        format,
        row_len,
        staged: Vec::new(),
        buf_kv: b.alloc(num_slots * rate * width),
        buf_gate: b.alloc(num_slots * rate * width),
        prev_kv: b.alloc(num_slots * prev),
        prev_gate: b.alloc(num_slots * prev),
        entries: b.alloc(num_blocks * entries_per_block * row_len),
    }
}

/// A compressor's buffers that hold per-slot state, with their floats per slot.
fn slot_buffers<B: DsV4Kernels>(c: &Compressor<B>) -> [(&B::Buf, usize); 4] {
    let (window, prev) = c.slot_floats();
    [
        (&c.buf_kv, window),
        (&c.buf_gate, window),
        (&c.prev_kv, prev),
        (&c.prev_gate, prev),
    ]
}

/// A slot's history: it begins at `state_start`; positions before `replay_until` are
/// prefix-cache hits being replayed (their entries are in shared blocks already).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotSpan {
    pub state_start: usize,
    pub replay_until: usize,
}

pub struct LayerCache<B: DsV4Kernels = CpuBackend> {
    /// Per slot the last `window - 1` K=V rows, at `position % (window - 1)`.
    pub ring: B::Buf,
    pub compressor: Option<Compressor<B>>,
    pub indexer: Option<Compressor<B>>,
}

pub struct DsV4Cache<B: DsV4Kernels = CpuBackend> {
    pub block_size: usize,
    pub num_blocks: usize,
    ring_len: usize,
    head_dim: usize,
    ring_format: EntryFormat,
    pub layers: Vec<LayerCache<B>>,
    /// Per slot: where its history begins and how far it reaches.
    spans: Vec<SlotSpan>,
    slot_tokens: Vec<usize>,
    /// Per slot: its state before its last verify row (drafts), to rewind to when drafts
    /// are rejected.
    snapshots: Vec<Option<SlotSnapshot>>,
    /// Recorded decode steps' buffers, made by the first such step.
    pub(super) decode: Option<Box<super::arena::DecodeArena<B>>>,
}

/// A slot's state at `position` and the tokens of the verify row that followed.
pub struct SlotSnapshot {
    pub position: usize,
    pub token_ids: Vec<u32>,
    state: Vec<f32>,
}

impl DsV4Cache<CpuBackend> {
    pub fn new(cfg: &DsV4Config, num_slots: usize, num_blocks: usize, block_size: usize) -> Self {
        Self::on(
            &CpuBackend::default(),
            cfg,
            num_slots,
            num_blocks,
            block_size,
        )
    }

    /// Bytes of one state slot and of one block, for sizing the pools.
    pub fn bytes_per_slot(cfg: &DsV4Config) -> usize {
        Self::bytes_per_slot_in(cfg, CacheFormats::default())
    }

    /// `bytes_per_slot` with the ring stored as `formats` says.
    pub fn bytes_per_slot_in(cfg: &DsV4Config, formats: CacheFormats) -> usize {
        let c = Self::on_in(&CpuBackend::default(), cfg, formats, 1, 0, lcm_rates(cfg));
        c.layers
            .iter()
            .map(|l| {
                c.ring_floats()
                    + l.compressor
                        .iter()
                        .chain(l.indexer.iter())
                        .map(|c| {
                            let (window, prev) = c.slot_floats();
                            2 * (window + prev)
                        })
                        .sum::<usize>()
            })
            .sum::<usize>()
            * 4
    }

    pub fn bytes_per_block(cfg: &DsV4Config, block_size: usize) -> usize {
        Self::bytes_per_block_in(cfg, block_size, CacheFormats::default())
    }

    /// `bytes_per_block` with entries stored as `formats` says.
    pub fn bytes_per_block_in(cfg: &DsV4Config, block_size: usize, formats: CacheFormats) -> usize {
        let c = Self::on_in(&CpuBackend::default(), cfg, formats, 0, 1, block_size);
        c.layers
            .iter()
            .flat_map(|l| l.compressor.iter().chain(l.indexer.iter()))
            .map(|c| c.block_floats())
            .sum::<usize>()
            * 4
    }

    /// `snapshot_on` the CPU.
    pub fn snapshot(&mut self, slot: usize, token_ids: &[u32]) {
        self.snapshot_on(&CpuBackend::default(), slot, token_ids);
    }

    /// `rewind_on` the CPU.
    pub fn rewind(&mut self, slot: usize) -> Option<SlotSnapshot> {
        self.rewind_on(&CpuBackend::default(), slot)
    }
}

impl<B: DsV4Kernels> DsV4Cache<B> {
    pub fn on(
        b: &B,
        cfg: &DsV4Config,
        num_slots: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        Self::on_in(
            b,
            cfg,
            CacheFormats::default(),
            num_slots,
            num_blocks,
            block_size,
        )
    }

    /// `on`, its entries stored as `formats` says.
    pub fn on_in(
        b: &B,
        cfg: &DsV4Config,
        formats: CacheFormats,
        num_slots: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        // The engine refuses such a layout by name before any cache is made.
        if let Some(problem) = formats.problem(cfg) {
            panic!("{problem}");
        }
        let ring_len = cfg.sliding_window - 1;
        let hd = cfg.head_dim;
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let csa = cfg.attention[l] == AttentionKind::CompressedSparse;
                LayerCache {
                    ring: b.alloc(num_slots * ring_len * formats.ring.words(hd)),
                    compressor: cfg.rate(l).map(|rate| {
                        let f = formats.main;
                        compressor(b, rate, hd, csa, f, num_slots, num_blocks, block_size)
                    }),
                    indexer: csa.then(|| {
                        compressor(
                            b,
                            cfg.csa_rate,
                            cfg.index_head_dim,
                            true,
                            formats.index,
                            num_slots,
                            num_blocks,
                            block_size,
                        )
                    }),
                }
            })
            .collect();
        DsV4Cache {
            block_size,
            num_blocks,
            ring_len,
            head_dim: hd,
            ring_format: formats.ring,
            layers,
            spans: vec![SlotSpan::default(); num_slots],
            slot_tokens: vec![0; num_slots],
            snapshots: (0..num_slots).map(|_| None).collect(),
            decode: None,
        }
    }

    /// Blocks `blocks`' entries (per block, every layer's compressor then indexer) as
    /// bytes, for a prefix store: `bytes_per_block_in` bytes a block.
    pub fn read_blocks_on(&self, b: &B, blocks: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &block in blocks {
            for c in self.compressors() {
                let n = c.block_floats();
                let at = block as usize * n;
                let words = b.read_floats(&c.entries, at..at + n);
                out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
            }
        }
        out
    }

    /// Fills each `(block, bytes)` from `read_blocks_on`'s bytes; false (nothing written)
    /// where a block is outside the pool or its bytes are not one block's.
    pub fn write_blocks_on(&mut self, b: &B, blocks: &[(u32, &[u8])]) -> bool {
        let per_block: usize = self.compressors().map(|c| 4 * c.block_floats()).sum();
        let fits = |(block, bytes): &(u32, &[u8])| {
            (*block as usize) < self.num_blocks && bytes.len() == per_block
        };
        if !blocks.iter().all(fits) {
            return false;
        }
        for &(block, bytes) in blocks {
            let mut rest = bytes;
            for l in &mut self.layers {
                for c in l.compressor.iter_mut().chain(l.indexer.iter_mut()) {
                    let n = c.block_floats();
                    let (mine, after) = rest.split_at(4 * n);
                    let words: Vec<f32> = mine
                        .chunks_exact(4)
                        .map(|w| f32::from_le_bytes(w.try_into().expect("4 bytes")))
                        .collect();
                    b.write_floats(&mut c.entries, block as usize * n, &words);
                    rest = after;
                }
            }
        }
        true
    }

    fn compressors(&self) -> impl Iterator<Item = &Compressor<B>> {
        self.layers
            .iter()
            .flat_map(|l| l.compressor.iter().chain(l.indexer.iter()))
    }

    /// Keeps the slot's state before a verify row of `token_ids` at `slot_tokens`.
    pub fn snapshot_on(&mut self, b: &B, slot: usize, token_ids: &[u32]) {
        let ring_floats = self.ring_floats();
        let mut state = Vec::new();
        for l in &self.layers {
            state.extend(b.read_floats(&l.ring, slot * ring_floats..(slot + 1) * ring_floats));
            for c in l.compressor.iter().chain(l.indexer.iter()) {
                for (buf, floats) in slot_buffers(c) {
                    state.extend(b.read_floats(buf, slot * floats..(slot + 1) * floats));
                }
            }
        }
        self.snapshots[slot] = Some(SlotSnapshot {
            position: self.slot_tokens[slot],
            token_ids: token_ids.to_vec(),
            state,
        });
    }

    /// Puts the slot back to its last snapshot and hands out that snapshot (its verify
    /// row's tokens are to be run again up to where they were accepted).
    pub fn rewind_on(&mut self, b: &B, slot: usize) -> Option<SlotSnapshot> {
        let snap = self.snapshots[slot].take()?;
        let ring_floats = self.ring_floats();
        let mut rest: &[f32] = &snap.state;
        let mut put = |buf: &mut B::Buf, floats: usize| {
            let (values, after) = rest.split_at(floats);
            b.write_floats(buf, slot * floats, values);
            rest = after;
        };
        for l in &mut self.layers {
            put(&mut l.ring, ring_floats);
            for c in l.compressor.iter_mut().chain(l.indexer.iter_mut()) {
                let (window, prev) = c.slot_floats();
                put(&mut c.buf_kv, window);
                put(&mut c.buf_gate, window);
                put(&mut c.prev_kv, prev);
                put(&mut c.prev_gate, prev);
            }
        }
        self.slot_tokens[slot] = snap.position;
        Some(snap)
    }

    pub fn clear_snapshot(&mut self, slot: usize) {
        self.snapshots[slot] = None;
    }

    pub fn snapshot_span(&self, slot: usize) -> Option<(usize, usize)> {
        self.snapshots[slot]
            .as_ref()
            .map(|s| (s.position, s.position + s.token_ids.len()))
    }

    /// Whether a recorded decode step has run over this cache (its arena exists).
    pub fn holds_decode_arena(&self) -> bool {
        self.decode.is_some()
    }

    pub fn num_slots(&self) -> usize {
        self.slot_tokens.len()
    }

    pub fn slot_tokens(&self, slot: usize) -> usize {
        self.slot_tokens[slot]
    }

    pub fn set_slot_tokens(&mut self, slot: usize, num_tokens: usize) {
        self.slot_tokens[slot] = num_tokens;
    }

    pub fn span(&self, slot: usize) -> SlotSpan {
        self.spans[slot]
    }

    /// The slot starts a new history (a new sequence, a recompute, a replay).
    pub fn restart(&mut self, slot: usize, span: SlotSpan) {
        self.spans[slot] = span;
        self.slot_tokens[slot] = span.state_start;
        self.snapshots[slot] = None;
    }

    /// The slot continues a history `span` at `position` (its state was put there whole:
    /// a saved state).
    pub fn resume(&mut self, slot: usize, span: SlotSpan, position: usize) {
        self.spans[slot] = span;
        self.slot_tokens[slot] = position;
        self.snapshots[slot] = None;
    }

    pub fn ring_len(&self) -> usize {
        self.ring_len
    }

    pub fn ring_format(&self) -> EntryFormat {
        self.ring_format
    }

    /// f32 words of one slot's ring (packed rows take fewer).
    pub fn ring_floats(&self) -> usize {
        self.ring_len * self.ring_format.words(self.head_dim)
    }
}

pub use super::config::lcm_rates;
