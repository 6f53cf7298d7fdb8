//! `HostFlags`: the two words a device step and the thread serving its host calls meet
//! through (`kernels::cuda::host_calls`). The device raises `started` to a call's tag + 1
//! once the call's inputs have landed in host memory; the host takes it (lowering the
//! word), computes, and raises `answered` to the same value once its rows are written;
//! the device takes that (lowering it) and copies the rows in. Each side writes a word
//! only after seeing the other's last write, so neither loses a raise. On CUDA the device's
//! side is `kernels-cuda/host_flags.cu` over page-locked words; `raise_started` and
//! `take_answer` are that side as the loom model (`tests/loom_primitives.rs`) runs it.

use super::atomic::{AtomicU32, Ordering};

/// `answered` once the host gave up on a step: every wait of the device passes.
pub const ABANDONED: u32 = u32::MAX;

pub struct HostFlags<'a> {
    pub started: &'a AtomicU32,
    pub answered: &'a AtomicU32,
}

impl HostFlags<'_> {
    /// Host: the tag of the call the device started, if it has, lowering the word.
    pub fn take_started(&self) -> Option<u32> {
        let raised = self.started.load(Ordering::Acquire);
        if raised == 0 {
            return None;
        }
        // The device raises the next call only after seeing this call's answer, which
        // this store precedes.
        self.started.store(0, Ordering::Relaxed);
        Some(raised - 1)
    }

    /// Host: call `tag`'s rows are written.
    pub fn answer(&self, tag: u32) {
        self.answered.store(tag + 1, Ordering::Release);
    }

    /// Host: no answer is coming for the step's calls left; the device goes on.
    pub fn abandon(&self) {
        self.answered.store(ABANDONED, Ordering::Release);
    }

    /// Device: call `tag`'s inputs are in host memory.
    pub fn raise_started(&self, tag: u32) {
        self.started.store(tag + 1, Ordering::Release);
    }

    /// Device: whether call `tag` is answered (or the step abandoned), lowering the word.
    pub fn take_answer(&self, tag: u32) -> bool {
        let seen = self.answered.load(Ordering::Acquire);
        if seen == tag + 1 {
            self.answered.store(0, Ordering::Relaxed);
            return true;
        }
        seen == ABANDONED
    }
}
