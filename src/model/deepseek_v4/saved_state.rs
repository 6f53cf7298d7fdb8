//! Slot states saved at block boundaries, for prefix hits that resume without a replay
//! (the "stored" part of the seed's state block, §8.3): per layer the sliding-window ring
//! and each overlapping compressor's previous window. A compressor's open window is left
//! out (the "dropped" part): every compress rate divides the block size, so at a block
//! boundary no window is open.

use super::cache::{CacheFormats, DsV4Cache, SlotSpan};
use super::config::DsV4Config;
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;

/// One layer's saved states: its ring's, then per overlapping compressor (the main one,
/// then the indexer's) its previous window's kv and gate rows.
struct SavedLayer<B: DsV4Kernels> {
    ring: B::Buf,
    prev: Vec<(B::Buf, B::Buf)>,
}

pub struct SavedStates<B: DsV4Kernels = CpuBackend> {
    layers: Vec<SavedLayer<B>>,
    num_saved: usize,
}

/// Per layer: floats of its ring, and of each overlapping compressor's previous window.
fn layer_floats<B: DsV4Kernels>(cache: &DsV4Cache<B>) -> Vec<(usize, Vec<usize>)> {
    let ring = cache.ring_floats();
    cache
        .layers
        .iter()
        .map(|l| {
            let prev = l
                .compressor
                .iter()
                .chain(l.indexer.iter())
                .map(|c| c.slot_floats().1)
                .filter(|&floats| floats > 0)
                .collect();
            (ring, prev)
        })
        .collect()
}

impl SavedStates<CpuBackend> {
    /// Bytes of one saved state, for sizing its pool.
    pub fn bytes_per_state(cfg: &DsV4Config) -> usize {
        Self::bytes_per_state_in(cfg, CacheFormats::default())
    }

    /// `bytes_per_state` with the ring stored as `formats` says.
    pub fn bytes_per_state_in(cfg: &DsV4Config, formats: CacheFormats) -> usize {
        let b = CpuBackend::default();
        let cache = DsV4Cache::on_in(&b, cfg, formats, 1, 0, super::cache::lcm_rates(cfg));
        layer_floats(&cache)
            .iter()
            .map(|(ring, prev)| ring + 2 * prev.iter().sum::<usize>())
            .sum::<usize>()
            * 4
    }
}

impl<B: DsV4Kernels> SavedStates<B> {
    /// `num_saved` states of `cache`'s layout on `b`.
    pub fn on(b: &B, cache: &DsV4Cache<B>, num_saved: usize) -> Self {
        let layers = layer_floats(cache)
            .into_iter()
            .map(|(ring, prev)| SavedLayer {
                ring: b.alloc(num_saved * ring),
                prev: prev
                    .iter()
                    .map(|&f| (b.alloc(num_saved * f), b.alloc(num_saved * f)))
                    .collect(),
            })
            .collect();
        SavedStates { layers, num_saved }
    }

    pub fn num_saved(&self) -> usize {
        self.num_saved
    }

    /// Copies `slot`'s state (at a block boundary) into saved state `saved`.
    pub fn save(&mut self, b: &B, cache: &DsV4Cache<B>, slot: usize, saved: usize) {
        assert!(saved < self.num_saved, "saved state {saved} out of range");
        for ((layer, (ring, prev)), cl) in self
            .layers
            .iter_mut()
            .zip(layer_floats(cache))
            .zip(&cache.layers)
        {
            b.copy_floats(
                &cl.ring,
                slot * ring..(slot + 1) * ring,
                &mut layer.ring,
                saved * ring,
            );
            let overlapping = cl
                .compressor
                .iter()
                .chain(cl.indexer.iter())
                .filter(|c| c.overlap);
            for ((kv, gate), (c, f)) in layer.prev.iter_mut().zip(overlapping.zip(prev)) {
                b.copy_floats(&c.prev_kv, slot * f..(slot + 1) * f, kv, saved * f);
                b.copy_floats(&c.prev_gate, slot * f..(slot + 1) * f, gate, saved * f);
            }
        }
    }

    /// Puts saved state `saved` into `slot`: it then holds `position` tokens of a history
    /// `span` (which begins at 0: the saved state is a cold run's).
    pub fn load(
        &self,
        b: &B,
        cache: &mut DsV4Cache<B>,
        saved: usize,
        slot: usize,
        span: SlotSpan,
        position: usize,
    ) {
        assert!(saved < self.num_saved, "saved state {saved} out of range");
        let floats = layer_floats(cache);
        for ((layer, (ring, prev)), cl) in self.layers.iter().zip(floats).zip(&mut cache.layers) {
            b.copy_floats(
                &layer.ring,
                saved * ring..(saved + 1) * ring,
                &mut cl.ring,
                slot * ring,
            );
            let overlapping = cl
                .compressor
                .iter_mut()
                .chain(cl.indexer.iter_mut())
                .filter(|c| c.overlap);
            for ((kv, gate), (c, f)) in layer.prev.iter().zip(overlapping.zip(prev)) {
                b.copy_floats(kv, saved * f..(saved + 1) * f, &mut c.prev_kv, slot * f);
                b.copy_floats(gate, saved * f..(saved + 1) * f, &mut c.prev_gate, slot * f);
            }
        }
        cache.resume(slot, span, position);
    }

    /// Saved state `saved` as bytes (little-endian words: per layer its ring's, then
    /// each overlapping compressor's previous kv and gate rows), for a prefix store;
    /// `bytes_per_state_in` of them.
    pub fn read_bytes(&self, b: &B, cache: &DsV4Cache<B>, saved: usize) -> Vec<u8> {
        assert!(saved < self.num_saved, "saved state {saved} out of range");
        let mut out = Vec::new();
        let mut put = |buf: &B::Buf, floats: usize| {
            let words = b.read_floats(buf, saved * floats..(saved + 1) * floats);
            out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        };
        for (layer, (ring, prev)) in self.layers.iter().zip(layer_floats(cache)) {
            put(&layer.ring, ring);
            for ((kv, gate), f) in layer.prev.iter().zip(prev) {
                put(kv, f);
                put(gate, f);
            }
        }
        out
    }
}

/// Puts `read_bytes`' bytes into `slot` of `cache`: it then holds `position` tokens of a
/// history `span` (which begins at 0). False (nothing written) where the bytes are not
/// one state's or the slot does not exist.
pub fn load_bytes<B: DsV4Kernels>(
    b: &B,
    cache: &mut DsV4Cache<B>,
    bytes: &[u8],
    slot: usize,
    span: SlotSpan,
    position: usize,
) -> bool {
    let floats = layer_floats(cache);
    let total: usize = floats
        .iter()
        .map(|(ring, prev)| ring + 2 * prev.iter().sum::<usize>())
        .sum();
    if bytes.len() != 4 * total || slot >= cache.num_slots() {
        return false;
    }
    let mut rest = bytes;
    let mut take = |buf: &mut B::Buf, floats: usize| {
        let (mine, after) = rest.split_at(4 * floats);
        let words: Vec<f32> = mine
            .chunks_exact(4)
            .map(|w| f32::from_le_bytes(w.try_into().expect("4 bytes")))
            .collect();
        b.write_floats(buf, slot * floats, &words);
        rest = after;
    };
    for (cl, (ring, prev)) in cache.layers.iter_mut().zip(floats) {
        take(&mut cl.ring, ring);
        let overlapping = cl
            .compressor
            .iter_mut()
            .chain(cl.indexer.iter_mut())
            .filter(|c| c.overlap);
        for (c, f) in overlapping.zip(prev) {
            take(&mut c.prev_kv, f);
            take(&mut c.prev_gate, f);
        }
    }
    cache.resume(slot, span, position);
    true
}
