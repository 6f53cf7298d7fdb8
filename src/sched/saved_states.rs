//! Per-sequence state saved at block boundaries, kept with the prefix (DeepSeek-V4's
//! sliding-window ring and CSA overlap, seed §8.3): a prefix hit whose last block has one
//! resumes with it and replays nothing. A saved state belongs to the KV block that ends at
//! its boundary and lives no longer than that block's contents: a block handed out again
//! loses it. The states are a pool of their own, evicted least-recently-used; a hit whose
//! state was evicted falls back to the bounded replay.

use std::collections::BTreeMap;

use super::StepId;

/// A rank copies slot `slot`'s state into saved state `saved` after the step that carries
/// this has run (the slot then sits at a block boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSave {
    pub slot: u32,
    pub saved: u32,
    /// With a prefix store: the rank also copies the state there, kept with the block of
    /// this chain hash (the one that ends at the boundary).
    pub keep_as: Option<u64>,
}

/// A rank copies saved state `saved` into slot `slot` before the step that carries this
/// runs: the slot then holds `position` tokens of a history that begins at 0, whose
/// positions before `replay_until` are prefix hits (their entries are in shared blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLoad {
    pub saved: u32,
    pub slot: u32,
    pub position: usize,
    pub replay_until: usize,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    saved: u32,
    /// The step whose rank copies the state in: only later steps may load it.
    written_by: StepId,
    last_used: u64,
}

#[derive(Debug, Clone)]
pub struct SavedStates {
    /// Per KV block: the state saved at its end.
    of_block: Vec<Option<Held>>,
    /// Per saved state: the block it belongs to.
    block_of: Vec<Option<u32>>,
    free: Vec<u32>,
    /// Least recently used first: (tick, block).
    lru: BTreeMap<u64, u32>,
    tick: u64,
}

impl SavedStates {
    pub fn new(num_saved: usize, num_blocks: usize) -> Self {
        assert!(
            num_saved <= u32::MAX as usize,
            "saved state ids must fit in u32"
        );
        SavedStates {
            of_block: vec![None; num_blocks],
            block_of: vec![None; num_saved],
            free: (0..num_saved as u32).rev().collect(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.block_of.len()
    }

    /// A saved state for the end of `block`, to be written by step `step` (the least
    /// recently used one is taken when none is free); `None` when the block has one
    /// already or there is no pool.
    pub fn attach(&mut self, block: u32, step: StepId) -> Option<u32> {
        if self.of_block[block as usize].is_some() {
            return None;
        }
        let saved = match self.free.pop() {
            Some(saved) => saved,
            None => {
                let (_, victim) = self.lru.pop_first()?;
                let held = self.of_block[victim as usize].take().expect("listed");
                held.saved
            }
        };
        self.tick += 1;
        self.lru.insert(self.tick, block);
        self.block_of[saved as usize] = Some(block);
        self.of_block[block as usize] = Some(Held {
            saved,
            written_by: step,
            last_used: self.tick,
        });
        Some(saved)
    }

    /// The state saved at the end of `block`, if a step before `step` wrote it; marked
    /// used.
    pub fn find(&mut self, block: u32, step: StepId) -> Option<u32> {
        let held = self.of_block[block as usize].as_mut()?;
        if held.written_by >= step {
            return None;
        }
        self.tick += 1;
        self.lru.remove(&held.last_used);
        self.lru.insert(self.tick, block);
        held.last_used = self.tick;
        Some(held.saved)
    }

    /// `block` is handed out for new contents: its saved state is gone.
    pub fn forget(&mut self, block: u32) {
        if let Some(held) = self.of_block[block as usize].take() {
            self.lru.remove(&held.last_used);
            self.block_of[held.saved as usize] = None;
            self.free.push(held.saved);
        }
    }

    pub fn clear(&mut self) {
        *self = SavedStates::new(self.capacity(), self.of_block.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_found_only_after_its_step_and_only_while_its_block_holds() {
        let mut s = SavedStates::new(2, 8);
        let a = s.attach(3, 10).unwrap();
        assert_eq!(s.attach(3, 11), None, "a block keeps its first state");
        assert_eq!(
            s.find(3, 10),
            None,
            "step 10 writes it: not loadable in step 10"
        );
        assert_eq!(s.find(3, 11), Some(a));
        s.forget(3);
        assert_eq!(s.find(3, 12), None);
        assert_eq!(s.attach(5, 12), Some(a), "a forgotten state is free again");
    }

    #[test]
    fn the_least_recently_used_state_goes_first() {
        let mut s = SavedStates::new(2, 8);
        let a = s.attach(1, 0).unwrap();
        let b = s.attach(2, 0).unwrap();
        assert_ne!(a, b);
        // Block 1 used since: block 2's state is the victim.
        assert_eq!(s.find(1, 1), Some(a));
        assert_eq!(s.attach(3, 1), Some(b));
        assert_eq!(s.find(2, 2), None);
        assert_eq!(s.find(1, 2), Some(a));
        assert_eq!(s.find(3, 2), Some(b));
        s.clear();
        assert_eq!(s.find(1, 3), None);
    }

    #[test]
    fn no_pool_saves_nothing() {
        let mut s = SavedStates::new(0, 4);
        assert_eq!(s.attach(0, 0), None);
        assert_eq!(s.find(0, 1), None);
    }
}
