//! The rank worker's buffer of last sampled tokens: the sampler publishes each step's
//! tokens here, and a worker running step N+1 under zero-overhead scheduling reads the
//! tokens of step N for its continuing rows — without a round trip through the scheduler.
//!
//! Invariants: steps are published in increasing order; a reader waits only for a step
//! that is in flight; `invalidate` (rank or sampler restart) wakes every waiter with `None`
//! so nothing blocks on a step whose tokens will never come. Loom-checked in
//! `tests/loom_sampled_tokens.rs`.

use crate::step::Drawn;
use crate::sync::{Arc, Condvar, Mutex};

#[derive(Default)]
struct Inner {
    /// Bumped by `invalidate`; a reader that started in an older epoch gives up.
    epoch: u64,
    /// The newest published step and what its rows drew, one per plan row (`None` for
    /// rows that sample nothing).
    step_id: Option<u64>,
    tokens: Vec<Option<Drawn>>,
}

#[derive(Clone, Default)]
pub struct SampledTokens {
    shared: Arc<(Mutex<Inner>, Condvar)>,
}

impl SampledTokens {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn epoch(&self) -> u64 {
        self.shared.0.lock().unwrap().epoch
    }

    /// Publishes step `step_id`'s tokens (indexed by plan row) if `epoch` is current.
    pub fn publish(&self, epoch: u64, step_id: u64, tokens: Vec<Option<Drawn>>) {
        let (lock, cond) = &*self.shared;
        let mut inner = lock.lock().unwrap();
        if inner.epoch != epoch {
            return;
        }
        inner.step_id = Some(step_id);
        inner.tokens = tokens;
        drop(inner);
        cond.notify_all();
    }

    /// What `row` of `step_id` drew, waiting until it is published; `None` when the
    /// buffer is invalidated (or was, since `epoch`) first.
    pub fn wait(&self, epoch: u64, step_id: u64, row: usize) -> Option<Drawn> {
        let (lock, cond) = &*self.shared;
        let mut inner = lock.lock().unwrap();
        loop {
            if inner.epoch != epoch {
                return None;
            }
            if inner.step_id.is_some_and(|s| s >= step_id) {
                // Only the newest step is kept: the scheduler plans at most one step ahead,
                // so a reader of step N runs before step N + 1 can be published.
                return if inner.step_id == Some(step_id) {
                    inner.tokens.get(row).copied().flatten()
                } else {
                    None
                };
            }
            inner = cond.wait(inner).unwrap();
        }
    }

    /// Drops whatever was published and wakes all waiters with `None`.
    pub fn invalidate(&self) -> u64 {
        let (lock, cond) = &*self.shared;
        let mut inner = lock.lock().unwrap();
        inner.epoch += 1;
        inner.step_id = None;
        inner.tokens.clear();
        let epoch = inner.epoch;
        drop(inner);
        cond.notify_all();
        epoch
    }
}
