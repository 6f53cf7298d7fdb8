//! A sequence's resources over its life: blocks reserved (preempting LCFS victims if
//! needed) and allocated, full blocks registered in the prefix cache once computed, and
//! blocks plus slot released on preemption or finish: at once, or deferred until the
//! last in-flight step that may touch them is done.

use super::Scheduler;
use crate::sched::KvSave;
use crate::sched::StepId;
use crate::sched::block_manager::BlockManager;
use crate::sched::prefix_cache::ROOT_HASH;
use crate::sched::sequence::SeqStatus;
use crate::sched::state_slots::StateSlots;
use crate::sched::{FinishReason, SeqEvent};

/// Blocks and a slot to give back once step `after_step` is done.
#[derive(Debug, Clone)]
pub(super) struct DeferredRelease {
    pub(super) after_step: StepId,
    pub(super) blocks: Vec<u32>,
    pub(super) slot: Option<u32>,
}

/// Outcome of finding blocks for one running sequence's row.
pub(super) enum Reserve {
    Reserved,
    /// Enough blocks come back when in-flight steps finish: skip this sequence this step.
    Wait,
    /// The sequence itself was the preemption victim.
    SelfPreempted,
}

impl Scheduler {
    /// Sequences preempted since the last call, in order.
    pub fn take_preempted(&mut self) -> Vec<crate::sched::SeqId> {
        std::mem::take(&mut self.preempted)
    }

    /// Whether `seq_id` waits for admission and has no token yet (a preempted sequence
    /// that had none counts as waiting still).
    pub fn is_queued(&self, seq_id: crate::sched::SeqId) -> bool {
        self.idx_of.get(&seq_id).is_some_and(|&idx| {
            let seq = self.seq(idx);
            seq.status == SeqStatus::Waiting && seq.num_generated() == 0
        })
    }

    /// The device lost its KV and state: forget in-flight steps, give every block and
    /// slot back, clear the prefix cache and requeue every unfinished sequence in arrival
    /// order to be recomputed from its known tokens.
    pub fn reset_device_state(&mut self) {
        self.in_flight.clear();
        self.deferred.clear();
        self.num_deferred_blocks = 0;
        self.blocks = BlockManager::new(self.cfg.num_blocks);
        self.slots = self.cfg.num_state_slots.map(StateSlots::new);
        self.prefix_cache.clear();
        self.store.forget_transfers();
        self.states.forget();
        self.running.clear();
        self.waiting.clear();
        let mut unfinished = Vec::new();
        for idx in 0..self.seqs.len() {
            let Some(seq) = self.seqs[idx].as_mut() else {
                continue;
            };
            seq.num_in_flight_rows = 0;
            seq.num_in_flight_verify_rows = 0;
            seq.num_pending_tokens = 0;
            seq.num_provisional_tokens = 0;
            seq.in_flight_drafts.clear();
            seq.last_sample_row = None;
            seq.block_table.clear();
            seq.state_slot = None;
            seq.reset_kv();
            if seq.is_finished() {
                self.remove(idx);
            } else {
                seq.status = SeqStatus::Waiting;
                unfinished.push((seq.arrival, idx));
            }
        }
        unfinished.sort_unstable();
        self.waiting
            .extend(unfinished.into_iter().map(|(_, idx)| idx));
    }

    /// Makes `num_blocks` allocatable for running sequence `idx`, preempting the most
    /// recently admitted running sequences if needed.
    pub(super) fn reserve_blocks(&mut self, idx: usize, num_blocks: usize) -> Reserve {
        loop {
            if self.blocks.num_free() >= num_blocks {
                return Reserve::Reserved;
            }
            // Deferred blocks return when in-flight steps finish; preempting now would
            // not free anything sooner. (An estimate: shared blocks may not come back.)
            if !self.in_flight.is_empty()
                && self.blocks.num_free() + self.num_deferred_blocks >= num_blocks
            {
                return Reserve::Wait;
            }
            let victim = self.running.pop().expect("idx itself is running");
            self.preempt(victim);
            if victim == idx {
                return Reserve::SelfPreempted;
            }
        }
    }

    pub(super) fn allocate_into(&mut self, idx: usize, num_blocks: usize) {
        for _ in 0..num_blocks {
            let alloc = self.blocks.allocate().expect("reserved beforehand");
            if alloc.evicted_cached {
                self.prefix_cache.remove_block(alloc.block_id);
            }
            self.states.saved.forget(alloc.block_id);
            self.seq_mut(idx).block_table.push(alloc.block_id);
        }
    }

    /// Registers the sequence's newly computed full blocks in the prefix cache.
    pub(super) fn register_computed_blocks(&mut self, idx: usize) {
        if !self.cfg.enable_prefix_cache {
            return;
        }
        let block_size = self.cfg.block_size;
        let seq = self.seqs[idx].as_mut().expect("live");
        let num_full_blocks = seq.num_computed_tokens / block_size;
        debug_assert!(num_full_blocks * block_size <= seq.tokens.len());
        while seq.block_hashes.len() < num_full_blocks {
            let i = seq.block_hashes.len();
            let parent_hash = seq.block_hashes.last().copied().unwrap_or(ROOT_HASH);
            let tokens = &seq.tokens[i * block_size..(i + 1) * block_size];
            let hash = self
                .prefix_cache
                .hash_block(parent_hash, tokens, seq.cache_salt);
            let block_id = seq.block_table[i];
            let cache_salt = seq.cache_salt;
            seq.block_hashes.push(hash);
            if self
                .prefix_cache
                .insert(block_id, hash, parent_hash, tokens, cache_salt)
            {
                self.blocks.mark_cached(block_id);
                if self.store.on {
                    self.store.saves.push(KvSave {
                        block_id,
                        hash,
                        parent_hash,
                        cache_salt,
                        tokens: tokens.into(),
                    });
                }
            }
        }
    }

    /// Sequences sent back to waiting for lack of blocks, over the scheduler's lifetime.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Moves running sequence `idx` (already off `running`) to the front of the queue,
    /// to be recomputed from its known tokens.
    pub(super) fn preempt(&mut self, idx: usize) {
        self.num_preemptions += 1;
        self.preempted.push(self.seq(idx).seq_id);
        if self.cfg.stop_preempted {
            let seq_id = self.seq(idx).seq_id;
            self.pending_events.push(SeqEvent::Finished {
                seq_id,
                reason: FinishReason::Preempted,
            });
            self.finish(idx);
            return;
        }
        self.release_resources(idx);
        let seq = self.seq_mut(idx);
        seq.reset_kv();
        seq.status = SeqStatus::Waiting;
        self.waiting.push_front(idx);
    }

    /// Marks `idx` finished (already off `running`/`waiting` or to be retained out),
    /// releases its resources and drops it once no row of it is in flight.
    pub(super) fn finish(&mut self, idx: usize) {
        self.release_resources(idx);
        let seq = self.seq_mut(idx);
        seq.status = SeqStatus::Finished;
        if seq.num_in_flight_rows == 0 {
            self.remove(idx);
        }
    }

    /// Gives back the sequence's blocks and slot: now, or after the last in-flight step
    /// if one of its rows may still read or write them.
    pub(super) fn release_resources(&mut self, idx: usize) {
        let seq = self.seqs[idx].as_mut().expect("live");
        let mut blocks = std::mem::take(&mut seq.block_table);
        let slot = seq.state_slot.take();
        // Tail blocks first: they join the LRU earlier and so are evicted before the
        // shared prefix blocks other requests are likelier to hit.
        blocks.reverse();
        let last_in_flight = self.in_flight.back().map(|s| s.step_id);
        match last_in_flight.filter(|_| seq.num_in_flight_rows > 0) {
            Some(after_step) => {
                self.num_deferred_blocks += blocks.len();
                self.deferred.push_back(DeferredRelease {
                    after_step,
                    blocks,
                    slot,
                });
            }
            None => self.release_now(&blocks, slot),
        }
    }

    pub(super) fn release_now(&mut self, blocks: &[u32], slot: Option<u32>) {
        for &b in blocks {
            self.blocks.free(b);
            // Nobody can hit an uncached block: its saved state only takes room.
            if self.blocks.ref_count(b) == 0 && !self.blocks.is_cached(b) {
                self.states.saved.forget(b);
            }
        }
        if let (Some(slot), Some(slots)) = (slot, self.slots.as_mut()) {
            slots.free(slot);
        }
    }

    pub(super) fn remove(&mut self, idx: usize) {
        let seq = self.seqs[idx].take().expect("live");
        self.idx_of.remove(&seq.seq_id);
        self.free_seq_slots.push(idx);
    }

    #[cfg(test)]
    pub(super) fn check_block_integrity(&self) {
        self.blocks
            .check_integrity()
            .expect("block lists consistent");
    }
}
