//! Where a sequence with per-sequence state resumes a prefix hit: from the state saved at
//! the end of one of its hit blocks when that costs no more than the bounded replay (at
//! the last hit block it costs nothing), else by replaying the tokens before the hit. And
//! the other way: a row that leaves its slot at a block boundary with an exact state has
//! the rank save it for that block.

use super::Scheduler;
use crate::sched::{CachedBlock, SavedStates, StateLoad, StateSave, StepId};

/// Saved states and what the rank owes them for the step being planned.
#[derive(Debug, Clone)]
pub(super) struct StateLink {
    pub(super) saved: SavedStates,
    pub(super) loads: Vec<StateLoad>,
    pub(super) saves: Vec<StateSave>,
    pub(super) num_resumed_hits: u64,
    pub(super) num_replayed_hits: u64,
}

impl StateLink {
    pub(super) fn new(num_saved: usize, num_blocks: usize) -> Self {
        StateLink {
            saved: SavedStates::new(num_saved, num_blocks),
            loads: Vec::new(),
            saves: Vec::new(),
            num_resumed_hits: 0,
            num_replayed_hits: 0,
        }
    }

    /// After a device reset: the slots and blocks these name are gone.
    pub(super) fn forget(&mut self) {
        self.saved.clear();
        self.loads.clear();
        self.saves.clear();
    }
}

/// Where an admitted sequence's first row starts, and the saved state it starts from
/// (`None`: a fresh state there, a replay when there are hits after it).
#[derive(Debug, Clone, Copy)]
pub(super) struct Resume {
    pub(super) start: usize,
    pub(super) saved: Option<u32>,
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

    /// Where a sequence whose first `num_cached` tokens hit (`hits`: the device's blocks
    /// among them, first) starts computing.
    pub(super) fn resume_point(&mut self, hits: &[CachedBlock], num_cached: usize) -> Resume {
        if self.slots.is_none() || num_cached == 0 {
            return Resume {
                start: num_cached,
                saved: None,
            };
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
                return Resume {
                    start: boundary,
                    saved: Some(saved),
                };
            }
        }
        Resume {
            start: replay_start,
            saved: None,
        }
    }

    /// Commits `resume` for sequence `idx`, just admitted into `slot` with `num_cached`
    /// hit tokens.
    pub(super) fn commit_resume(&mut self, resume: Resume, slot: u32, num_cached: usize) {
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
        admitting: Option<(Resume, usize)>,
    ) -> usize {
        if self.states.saved.capacity() == 0
            || self.slots.is_none()
            || !self.cfg.enable_prefix_cache
        {
            return q;
        }
        let seq = self.seq(idx);
        let (state_start, replay_until) = match admitting {
            Some((resume, num_cached)) if resume.saved.is_some() => (0, num_cached),
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
        let block = seq.block_table[end / block_size - 1];
        if let Some(saved) = self.states.saved.attach(block, step) {
            self.states.saves.push(StateSave { slot, saved });
        }
    }
}
