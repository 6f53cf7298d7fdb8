//! Where a sequence with per-sequence state resumes a prefix hit: from the state saved at
//! the end of one of its hit blocks when that costs no more than the bounded replay (at
//! the last hit block it costs nothing), else by replaying the tokens before the hit. And
//! the other way: a row that leaves its slot at a block boundary with an exact state has
//! the rank save it for that block. With a prefix store, saved states go there too, kept
//! with their block: a hit that ends on a stored block with a state (another engine's,
//! or this one's before a restart) resumes with it.

use super::Scheduler;
use crate::sched::{
    CachedBlock, ROOT_HASH, SavedStates, StateImport, StateLoad, StateSave, StepId,
};
use crate::sync::Shared;

/// Saved states and what the rank owes them for the step being planned.
#[derive(Debug, Clone)]
pub(super) struct StateLink {
    pub(super) saved: SavedStates,
    pub(super) loads: Vec<StateLoad>,
    pub(super) saves: Vec<StateSave>,
    pub(super) imports: Vec<StateImport>,
    pub(super) num_resumed_hits: u64,
    pub(super) num_replayed_hits: u64,
}

impl StateLink {
    pub(super) fn new(num_saved: usize, num_blocks: usize) -> Self {
        StateLink {
            saved: SavedStates::new(num_saved, num_blocks),
            loads: Vec::new(),
            saves: Vec::new(),
            imports: Vec::new(),
            num_resumed_hits: 0,
            num_replayed_hits: 0,
        }
    }

    /// After a device reset: the slots and blocks these name are gone.
    pub(super) fn forget(&mut self) {
        self.saved.clear();
        self.loads.clear();
        self.saves.clear();
        self.imports.clear();
    }
}

/// Where an admitted sequence's first row starts, and the saved or stored state it
/// starts from (neither: a fresh state there, a replay when there are hits after it).
#[derive(Debug, Clone)]
pub(super) struct Resume {
    pub(super) start: usize,
    pub(super) saved: Option<u32>,
    pub(super) stored: Option<Shared<[u8]>>,
}

impl Resume {
    /// The slot starts with a cold run's state: its history begins at 0.
    pub(super) fn exact(&self) -> bool {
        self.saved.is_some() || self.stored.is_some()
    }
}

impl Scheduler {
    /// Prefix hits that resumed from a saved state.
    pub fn num_resumed_hits(&self) -> u64 {
        self.states.num_resumed_hits
    }

    /// Prefix hits that rebuilt the state by the bounded replay.
    pub fn num_replayed_hits(&self) -> u64 {
        self.states.num_replayed_hits
    }

    /// Where waiting sequence `idx`, whose first `num_cached` tokens hit (`hits`: the
    /// device's blocks among them, first; then `num_stored` of the store's), starts
    /// computing.
    pub(super) fn resume_point(
        &mut self,
        idx: usize,
        hits: &[CachedBlock],
        num_stored: usize,
        num_cached: usize,
    ) -> Resume {
        let mut resume = Resume {
            start: num_cached,
            saved: None,
            stored: None,
        };
        if self.slots.is_none() || num_cached == 0 {
            return resume;
        }
        if num_stored > 0 {
            let seq = self.seq(idx);
            let stored = seq.stored_prefix.as_ref().expect("stored hits");
            let last = &stored.blocks[hits.len() + num_stored - 1 - stored.first_block];
            if let Some(state) = &last.state {
                resume.stored = Some(state.clone());
                return resume;
            }
        }
        let block_size = self.cfg.block_size;
        let replay_start = num_cached.saturating_sub(self.cfg.num_replay_tokens);
        let step = self.next_step_id;
        for (i, hit) in hits.iter().enumerate().rev() {
            let boundary = (i + 1) * block_size;
            if boundary < replay_start {
                break;
            }
            if let Some(saved) = self.states.saved.find(hit.block_id, step) {
                resume.start = boundary;
                resume.saved = Some(saved);
                return resume;
            }
        }
        resume.start = replay_start;
        resume
    }

    /// Commits `resume` for sequence `idx`, just admitted into `slot` with `num_cached`
    /// hit tokens.
    pub(super) fn commit_resume(&mut self, resume: Resume, slot: u32, num_cached: usize) {
        if let Some(payload) = resume.stored {
            self.states.num_resumed_hits += 1;
            self.states.imports.push(StateImport {
                slot,
                position: num_cached,
                payload,
            });
            return;
        }
        match resume.saved {
            Some(saved) => {
                self.states.num_resumed_hits += 1;
                self.states.loads.push(StateLoad {
                    saved,
                    slot,
                    position: resume.start,
                    replay_until: num_cached,
                });
            }
            None if num_cached > 0 => self.states.num_replayed_hits += 1,
            None => {}
        }
    }

    /// With saved states, a prefill chunk of sequence `idx` from `start` ends at the last
    /// block boundary it crosses, and the prompt's at the last one before its last token
    /// (where a repeat of the prompt hits), so the rank can save the state there.
    /// `admitting`: the sequence is being admitted with this resume and hit tokens.
    pub(super) fn align_chunk(
        &self,
        idx: usize,
        start: usize,
        q: usize,
        admitting: Option<(&Resume, usize)>,
    ) -> usize {
        if self.states.saved.capacity() == 0
            || self.slots.is_none()
            || !self.cfg.enable_prefix_cache
        {
            return q;
        }
        let seq = self.seq(idx);
        let (state_start, replay_until) = match admitting {
            Some((resume, num_cached)) if resume.exact() => (0, num_cached),
            Some((resume, num_cached)) => (resume.start, num_cached),
            None => (seq.state_start, seq.replay_until),
        };
        let end = start + q;
        let last = if end == seq.num_tokens() {
            end - 1
        } else {
            end
        };
        let boundary = last / self.cfg.block_size * self.cfg.block_size;
        let exact = state_start == 0 || boundary >= replay_until;
        if boundary > start && exact {
            boundary - start
        } else {
            q
        }
    }

    /// After sequence `idx`'s row ending at `end` was planned into step `step`: where the
    /// row leaves its slot at a block boundary with the state a cold run has there, the
    /// rank saves it for the block that ends there.
    pub(super) fn plan_state_save(&mut self, idx: usize, end: usize, step: StepId) {
        let block_size = self.cfg.block_size;
        let seq = self.seq(idx);
        let Some(slot) = seq.state_slot else {
            return;
        };
        // A replay's state is exact only from where it ends; a row that may move back
        // (drafts in flight) does not know where it ends.
        let exact = seq.state_start == 0 || end >= seq.replay_until;
        if !self.cfg.enable_prefix_cache
            || end == 0
            || !end.is_multiple_of(block_size)
            || !exact
            || seq.num_in_flight_verify_rows > 0
        {
            return;
        }
        let num_blocks = end / block_size;
        let block = seq.block_table[num_blocks - 1];
        // The store keeps the prompt's last boundary's state only: where a repeat of the
        // prompt, or a decode engine it is handed to, resumes (a copy is megabytes).
        let last_prompt_boundary =
            seq.num_prompt_tokens.saturating_sub(1) / block_size * block_size;
        let keep_as = (self.store.on && end == last_prompt_boundary)
            .then(|| self.chain_hash(idx, num_blocks));
        if let Some(saved) = self.states.saved.attach(block, step) {
            self.states.saves.push(StateSave {
                slot,
                saved,
                keep_as,
            });
        }
    }

    /// The chain hash of sequence `idx`'s first `num_blocks` blocks: the registered ones'
    /// as recorded, the rest from its tokens.
    fn chain_hash(&self, idx: usize, num_blocks: usize) -> u64 {
        let (seq, block_size) = (self.seq(idx), self.cfg.block_size);
        let known = seq.block_hashes.len().min(num_blocks);
        let mut hash = known
            .checked_sub(1)
            .map_or(ROOT_HASH, |i| seq.block_hashes[i]);
        for i in known..num_blocks {
            let tokens = &seq.tokens[i * block_size..(i + 1) * block_size];
            hash = self.prefix_cache.hash_block(hash, tokens, seq.cache_salt);
        }
        hash
    }
}
