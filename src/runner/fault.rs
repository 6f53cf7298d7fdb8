//! Fault injection for the tests that kill and break actors (tests/fault_injection.rs).
//! Shared flags the actors consult at the points where a real fault would strike; all
//! off in normal runs, and checking them costs one relaxed load per step. It also counts
//! the ranks that released their models, which a test of shutdown reads.

use crate::sync::Arc;
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[derive(Clone, Default)]
pub struct FaultPlan {
    inner: Arc<Flags>,
}

#[derive(Default)]
struct Flags {
    /// The next step a rank worker runs panics halfway through.
    panic_next_step: AtomicBool,
    /// This many upcoming rank worker starts fail (a permanent failure when large).
    failing_starts: AtomicUsize,
    /// The next step's readback (waiting for its picks to land) panics.
    fail_next_readback: AtomicBool,
    /// The sampler panics at the next row that verifies drafts.
    panic_next_verify: AtomicBool,
    /// Bit `d`: device slot `d` is gone — its rank's next step panics and no rank starts
    /// on it again.
    lost_devices: AtomicU64,
    /// Bit `d`: the rank on device slot `d` has yet to die of its device's loss.
    dying_devices: AtomicU64,
    /// Ranks that dropped their model on a graceful stop.
    released_models: AtomicUsize,
}

impl FaultPlan {
    pub fn panic_next_step(&self) {
        self.inner.panic_next_step.store(true, Ordering::SeqCst);
    }
    pub fn fail_next_starts(&self, n: usize) {
        self.inner.failing_starts.store(n, Ordering::SeqCst);
    }
    pub fn fail_next_readback(&self) {
        self.inner.fail_next_readback.store(true, Ordering::SeqCst);
    }
    /// Device slot `slot` (< 64) fails for good: the rank running on it panics at its
    /// next step and every later start there fails, so the group must shrink.
    pub fn lose_device(&self, slot: usize) {
        self.inner
            .lost_devices
            .fetch_or(1 << slot, Ordering::SeqCst);
        self.inner
            .dying_devices
            .fetch_or(1 << slot, Ordering::SeqCst);
    }
    pub fn panic_next_verify(&self) {
        self.inner.panic_next_verify.store(true, Ordering::SeqCst);
    }
    pub fn take_verify_panic(&self) -> bool {
        self.inner.panic_next_verify.swap(false, Ordering::SeqCst)
    }
    pub fn take_readback_failure(&self) -> bool {
        self.inner.fail_next_readback.swap(false, Ordering::SeqCst)
    }
    /// Whether the rank on device slot `slot` panics in this step.
    pub fn take_step_panic(&self, slot: usize) -> bool {
        let bit = 1u64 << slot;
        self.inner.dying_devices.fetch_and(!bit, Ordering::SeqCst) & bit != 0
            || self.inner.panic_next_step.swap(false, Ordering::SeqCst)
    }
    /// A rank dropped its model on a graceful stop.
    pub fn note_model_released(&self) {
        self.inner.released_models.fetch_add(1, Ordering::SeqCst);
    }
    pub fn num_models_released(&self) -> usize {
        self.inner.released_models.load(Ordering::SeqCst)
    }
    /// Whether a rank starting on device slot `slot` fails.
    pub fn take_start_failure(&self, slot: usize) -> bool {
        self.inner.lost_devices.load(Ordering::SeqCst) & (1 << slot) != 0
            || self
                .inner
                .failing_starts
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    }
}
