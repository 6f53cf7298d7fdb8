//! DeepSeek-V4's cache (seed §8.1): what stays a fixed size per sequence lives in a state
//! slot (the sliding-window ring of shared K=V, each compressor's partial window, the
//! CSA overlap state); what grows with the context lives in paged blocks (compressed KV
//! entries, the indexer's compressed keys), one entry per `rate` source tokens, so a
//! block of `block_size` source tokens holds `block_size / rate` entries of a layer.

use super::config::{AttentionKind, DsV4Config};

/// One compressor's storage: per slot the open window (raw kv and gate rows by position
/// in the window) and, when windows overlap, the last closed window's first-half (Ca)
/// rows; per block its emitted entries.
pub struct CompressorCache {
    pub rate: usize,
    /// Width of a projected row: `2 · dim` when windows overlap, else `dim`.
    pub width: usize,
    /// Width of an emitted entry.
    pub dim: usize,
    pub overlap: bool,
    entries_per_block: usize,
    buf_kv: Vec<f32>,
    buf_gate: Vec<f32>,
    prev_kv: Vec<f32>,
    prev_gate: Vec<f32>,
    entries: Vec<f32>,
}

impl CompressorCache {
    fn new(
        rate: usize,
        dim: usize,
        overlap: bool,
        num_slots: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        let width = if overlap { 2 * dim } else { dim };
        let per_slot_prev = if overlap { rate * dim } else { 0 };
        let entries_per_block = block_size / rate;
        CompressorCache {
            rate,
            width,
            dim,
            overlap,
            entries_per_block,
            buf_kv: vec![0.0; num_slots * rate * width],
            buf_gate: vec![0.0; num_slots * rate * width],
            prev_kv: vec![0.0; num_slots * per_slot_prev],
            prev_gate: vec![0.0; num_slots * per_slot_prev],
            entries: vec![0.0; num_blocks * entries_per_block * dim],
        }
    }

    /// The slot's open window and overlap state, as a flat copy.
    fn save_slot(&self, slot: usize, into: &mut Vec<f32>) {
        let (b, p) = (
            self.rate * self.width,
            if self.overlap {
                self.rate * self.dim
            } else {
                0
            },
        );
        into.extend_from_slice(&self.buf_kv[slot * b..(slot + 1) * b]);
        into.extend_from_slice(&self.buf_gate[slot * b..(slot + 1) * b]);
        into.extend_from_slice(&self.prev_kv[slot * p..(slot + 1) * p]);
        into.extend_from_slice(&self.prev_gate[slot * p..(slot + 1) * p]);
    }

    /// Puts back what `save_slot` copied (from `from`'s front); returns the rest.
    fn load_slot<'a>(&mut self, slot: usize, from: &'a [f32]) -> &'a [f32] {
        let (b, p) = (
            self.rate * self.width,
            if self.overlap {
                self.rate * self.dim
            } else {
                0
            },
        );
        let (kv, rest) = from.split_at(b);
        let (gate, rest) = rest.split_at(b);
        let (pkv, rest) = rest.split_at(p);
        let (pgate, rest) = rest.split_at(p);
        self.buf_kv[slot * b..(slot + 1) * b].copy_from_slice(kv);
        self.buf_gate[slot * b..(slot + 1) * b].copy_from_slice(gate);
        self.prev_kv[slot * p..(slot + 1) * p].copy_from_slice(pkv);
        self.prev_gate[slot * p..(slot + 1) * p].copy_from_slice(pgate);
        rest
    }

    fn slot_floats(&self) -> usize {
        2 * self.rate * self.width
            + if self.overlap {
                2 * self.rate * self.dim
            } else {
                0
            }
    }

    fn block_floats(&self) -> usize {
        self.entries_per_block * self.dim
    }

    /// Index of entry `w` (covering source tokens `w·rate .. (w+1)·rate`) in `entries`.
    fn entry_offset(&self, block_table: &[u32], block_size: usize, w: usize) -> usize {
        let first_token = w * self.rate;
        let block = block_table[first_token / block_size] as usize;
        (block * self.entries_per_block + (first_token % block_size) / self.rate) * self.dim
    }

    pub fn entry(&self, block_table: &[u32], block_size: usize, w: usize) -> &[f32] {
        let at = self.entry_offset(block_table, block_size, w);
        &self.entries[at..at + self.dim]
    }

    /// Takes the projected `kv` and `gate` rows (`width` each) of the tokens at `pos0..`
    /// and emits one entry for every window they close: a per-channel softmax over the
    /// window's gate logits (+ position bias; with overlap, over the previous window's Ca
    /// half and this window's Cb half) weighting the kv rows, then `finish` (norm, RoPE).
    /// Windows ending at or before `span.replay_until` are cached already: only the state
    /// they leave behind is kept. A window starting at the slot's first position has no
    /// previous half.
    #[allow(clippy::too_many_arguments)]
    pub fn feed(
        &mut self,
        slot: usize,
        span: SlotSpan,
        pos0: usize,
        kv: &[f32],
        gate: &[f32],
        position_bias: &[f32],
        block_table: &[u32],
        block_size: usize,
        mut finish: impl FnMut(&mut [f32], usize),
    ) {
        let (rate, width, dim) = (self.rate, self.width, self.dim);
        let n = kv.len() / width;
        let buf = slot * rate * width;
        let prev = slot * rate * dim;
        let mut entry = vec![0.0f32; dim];
        let mut logits = vec![0.0f32; 2 * rate];
        for i in 0..n {
            let pos = pos0 + i;
            let s = pos % rate;
            let row = buf + s * width;
            self.buf_kv[row..row + width].copy_from_slice(&kv[i * width..(i + 1) * width]);
            self.buf_gate[row..row + width].copy_from_slice(&gate[i * width..(i + 1) * width]);
            if s != rate - 1 {
                continue;
            }
            let w = pos / rate;
            let cb = if self.overlap { dim } else { 0 };
            let has_prev = self.overlap && w * rate > span.state_start;
            let emit = (w + 1) * rate > span.replay_until;
            for (c, out) in entry.iter_mut().enumerate() {
                // Slot j < rate: the previous window's Ca (absent for the first window).
                let mut slots = 0;
                if has_prev {
                    for j in 0..rate {
                        logits[slots] = self.prev_gate[prev + j * dim + c];
                        slots += 1;
                    }
                }
                let first_cb = slots;
                for j in 0..rate {
                    logits[slots] =
                        self.buf_gate[buf + j * width + cb + c] + position_bias[j * width + cb + c];
                    slots += 1;
                }
                let max = logits[..slots]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for l in logits[..slots].iter_mut() {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                let mut acc = 0.0;
                for (j, l) in logits[..first_cb].iter().enumerate() {
                    acc += l / sum * self.prev_kv[prev + j * dim + c];
                }
                for j in 0..rate {
                    acc += logits[first_cb + j] / sum * self.buf_kv[buf + j * width + cb + c];
                }
                *out = acc;
            }
            if emit {
                finish(&mut entry, w * rate);
                let at = self.entry_offset(block_table, block_size, w);
                self.entries[at..at + dim].copy_from_slice(&entry);
            }
            if self.overlap {
                for j in 0..rate {
                    let (src, dst) = (buf + j * width, prev + j * dim);
                    self.prev_kv[dst..dst + dim].copy_from_slice(&self.buf_kv[src..src + dim]);
                    for c in 0..dim {
                        self.prev_gate[dst + c] =
                            self.buf_gate[src + c] + position_bias[j * width + c];
                    }
                }
            }
        }
    }
}

/// A slot's history: it begins at `state_start`; positions before `replay_until` are
/// prefix-cache hits being replayed (their entries are in shared blocks already).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotSpan {
    pub state_start: usize,
    pub replay_until: usize,
}

pub struct LayerCache {
    /// Per slot the last `window - 1` K=V rows, at `position % (window - 1)`.
    ring: Vec<f32>,
    pub compressor: Option<CompressorCache>,
    pub indexer: Option<CompressorCache>,
}

pub struct DsV4Cache {
    pub block_size: usize,
    pub num_blocks: usize,
    ring_len: usize,
    head_dim: usize,
    pub layers: Vec<LayerCache>,
    /// Per slot: where its history begins and how far it reaches.
    spans: Vec<SlotSpan>,
    slot_tokens: Vec<usize>,
    /// Per slot: its state before its last verify row (drafts), to rewind to when drafts
    /// are rejected.
    snapshots: Vec<Option<SlotSnapshot>>,
}

/// A slot's state at `position` and the tokens of the verify row that followed.
pub struct SlotSnapshot {
    pub position: usize,
    pub token_ids: Vec<u32>,
    state: Vec<f32>,
}

impl DsV4Cache {
    pub fn new(cfg: &DsV4Config, num_slots: usize, num_blocks: usize, block_size: usize) -> Self {
        let ring_len = cfg.sliding_window - 1;
        let hd = cfg.head_dim;
        let layers = (0..cfg.num_layers)
            .map(|l| LayerCache {
                ring: vec![0.0; num_slots * ring_len * hd],
                compressor: cfg.rate(l).map(|rate| {
                    let overlap = cfg.attention[l] == AttentionKind::CompressedSparse;
                    CompressorCache::new(rate, hd, overlap, num_slots, num_blocks, block_size)
                }),
                indexer: (cfg.attention[l] == AttentionKind::CompressedSparse).then(|| {
                    CompressorCache::new(
                        cfg.csa_rate,
                        cfg.index_head_dim,
                        true,
                        num_slots,
                        num_blocks,
                        block_size,
                    )
                }),
            })
            .collect();
        DsV4Cache {
            block_size,
            num_blocks,
            ring_len,
            head_dim: hd,
            layers,
            spans: vec![SlotSpan::default(); num_slots],
            slot_tokens: vec![0; num_slots],
            snapshots: (0..num_slots).map(|_| None).collect(),
        }
    }

    /// Keeps the slot's state before a verify row of `token_ids` at `slot_tokens`.
    pub fn snapshot(&mut self, slot: usize, token_ids: &[u32]) {
        let ring_floats = self.ring_len * self.head_dim;
        let mut state = Vec::new();
        for l in &self.layers {
            state.extend_from_slice(&l.ring[slot * ring_floats..(slot + 1) * ring_floats]);
            for c in l.compressor.iter().chain(l.indexer.iter()) {
                c.save_slot(slot, &mut state);
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
    pub fn rewind(&mut self, slot: usize) -> Option<SlotSnapshot> {
        let snap = self.snapshots[slot].take()?;
        let ring_floats = self.ring_len * self.head_dim;
        let mut rest: &[f32] = &snap.state;
        for l in &mut self.layers {
            let (ring, after) = rest.split_at(ring_floats);
            l.ring[slot * ring_floats..(slot + 1) * ring_floats].copy_from_slice(ring);
            rest = after;
            for c in l.compressor.iter_mut().chain(l.indexer.iter_mut()) {
                rest = c.load_slot(slot, rest);
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

    pub fn num_slots(&self) -> usize {
        self.slot_tokens.len()
    }

    /// Bytes of one state slot and of one block, for sizing the pools.
    pub fn bytes_per_slot(cfg: &DsV4Config) -> usize {
        Self::new(cfg, 1, 0, lcm_rates(cfg)).per_slot_floats() * 4
    }

    pub fn bytes_per_block(cfg: &DsV4Config, block_size: usize) -> usize {
        let c = Self::new(cfg, 0, 1, block_size);
        c.layers
            .iter()
            .flat_map(|l| l.compressor.iter().chain(l.indexer.iter()))
            .map(|c| c.block_floats())
            .sum::<usize>()
            * 4
    }

    fn per_slot_floats(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                self.ring_len * self.head_dim
                    + l.compressor
                        .iter()
                        .chain(l.indexer.iter())
                        .map(|c| c.slot_floats())
                        .sum::<usize>()
            })
            .sum()
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

    pub fn ring_len(&self) -> usize {
        self.ring_len
    }

    /// The K=V row of `position` (one of the last `window - 1` the slot has seen).
    pub fn ring_row(&self, layer: usize, slot: usize, position: usize) -> &[f32] {
        let hd = self.head_dim;
        let at = (slot * self.ring_len + position % self.ring_len) * hd;
        &self.layers[layer].ring[at..at + hd]
    }

    pub fn write_ring(&mut self, layer: usize, slot: usize, position: usize, row: &[f32]) {
        if self.ring_len == 0 {
            return;
        }
        let hd = self.head_dim;
        let at = (slot * self.ring_len + position % self.ring_len) * hd;
        self.layers[layer].ring[at..at + hd].copy_from_slice(row);
    }
}

/// The least common multiple of the compress rates in use: the smallest valid block size.
pub fn lcm_rates(cfg: &DsV4Config) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    (0..cfg.num_layers)
        .filter_map(|l| cfg.rate(l))
        .fold(1, |acc, r| acc / gcd(acc, r) * r)
}
