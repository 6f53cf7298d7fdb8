//! The scheduler's side of a prefix store below the device: prompt blocks the store holds
//! admitted as computed (the rank loads them before the step that admits them), and
//! blocks registered in the prefix cache handed out to be saved there.

use super::Scheduler;
use crate::sched::prefix_cache::ROOT_HASH;
use crate::sched::{
    CachedBlock, KvLoad, KvSave, SchedError, SeqRequest, StoredBlock, StoredPrefix,
};

/// What the scheduler owes the store and the rank between steps.
#[derive(Debug, Clone, Default)]
pub(super) struct StoreLink {
    /// Save registered blocks (a store is attached).
    pub(super) on: bool,
    /// For the step being planned.
    pub(super) loads: Vec<KvLoad>,
    pub(super) saves: Vec<KvSave>,
    /// Blocks admitted from the store, over the scheduler's lifetime.
    pub(super) num_hit_blocks: u64,
}

impl StoreLink {
    /// After a device reset: the blocks these name are gone.
    pub(super) fn forget_transfers(&mut self) {
        self.loads.clear();
        self.saves.clear();
    }
}

impl Scheduler {
    /// Attaches a prefix store: every block registered from now on is handed out by
    /// `take_kv_saves`, and `add_with_stored` takes what the store holds.
    pub fn set_kv_store(&mut self, on: bool) {
        self.store.on = on && self.cfg.enable_prefix_cache;
    }

    /// Blocks registered since the last call, to copy to the store before any later step
    /// can reuse them (the caller sends them to the rank before planning again).
    pub fn take_kv_saves(&mut self) -> Vec<KvSave> {
        std::mem::take(&mut self.store.saves)
    }

    /// Prompt blocks admitted from the store instead of being computed.
    pub fn num_stored_hit_blocks(&self) -> u64 {
        self.store.num_hit_blocks
    }

    /// How many leading full blocks of `tokens` (the last token never counts) are cached
    /// on the device now: where a store lookup starts.
    pub fn num_device_prefix_blocks(&mut self, tokens: &[u32], cache_salt: u64) -> usize {
        if !self.cfg.enable_prefix_cache || tokens.is_empty() {
            return 0;
        }
        let mut hits = std::mem::take(&mut self.hits);
        hits.clear();
        self.prefix_cache.match_prefix(
            &tokens[..tokens.len() - 1],
            cache_salt,
            usize::MAX,
            &mut hits,
        );
        let n = hits.len();
        self.hits = hits;
        n
    }

    /// `add`, with the prompt blocks a store holds.
    pub fn add_with_stored(
        &mut self,
        req: SeqRequest,
        stored: StoredPrefix,
    ) -> Result<(), SchedError> {
        let seq_id = req.seq_id;
        self.add(req)?;
        if self.store.on && !stored.blocks.is_empty() {
            let idx = self.idx_of[&seq_id];
            self.seq_mut(idx).stored_prefix = Some(stored);
        }
        Ok(())
    }

    /// Of waiting sequence `idx`'s stored blocks, how many follow its device `hits`
    /// without a gap, verified against its tokens' chain hashes, up to `max_blocks`
    /// blocks in all.
    pub(super) fn num_stored_hits(
        &self,
        idx: usize,
        hits: &[CachedBlock],
        max_blocks: usize,
    ) -> usize {
        let num_device_hits = hits.len();
        let seq = self.seq(idx);
        let Some(stored) = seq.stored_prefix.as_ref().filter(|_| self.store.on) else {
            return 0;
        };
        if stored.first_block > num_device_hits {
            return 0;
        }
        let block_size = self.cfg.block_size;
        let mut parent = hits.last().map_or(ROOT_HASH, |h| h.hash);
        let mut n = 0;
        for i in num_device_hits..max_blocks {
            let Some(block) = stored.blocks.get(i - stored.first_block) else {
                break;
            };
            let tokens = &seq.tokens[i * block_size..(i + 1) * block_size];
            let hash = self.prefix_cache.hash_block(parent, tokens, seq.cache_salt);
            if hash != block.hash {
                break;
            }
            parent = hash;
            n += 1;
        }
        n
    }

    /// Admitted sequence `idx` takes `n` stored blocks after its `num_device_hits` hits:
    /// its fresh blocks there are loaded by the step being planned and registered now.
    pub(super) fn load_stored(&mut self, idx: usize, num_device_hits: usize, n: usize) {
        let Some(stored) = self.seq_mut(idx).stored_prefix.take() else {
            return;
        };
        if n == 0 {
            return;
        }
        self.store.num_hit_blocks += n as u64;
        let block_size = self.cfg.block_size;
        for i in num_device_hits..num_device_hits + n {
            let StoredBlock { hash, payload, .. } = stored.blocks[i - stored.first_block].clone();
            let seq = self.seqs[idx].as_mut().expect("live");
            let block_id = seq.block_table[i];
            let parent_hash = seq.block_hashes.last().copied().unwrap_or(ROOT_HASH);
            let tokens = &seq.tokens[i * block_size..(i + 1) * block_size];
            if self
                .prefix_cache
                .insert(block_id, hash, parent_hash, tokens, seq.cache_salt)
            {
                self.blocks.mark_cached(block_id);
            }
            seq.block_hashes.push(hash);
            self.store.loads.push(KvLoad { block_id, payload });
        }
    }
}
