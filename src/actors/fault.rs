//! Fault injection for the tests that kill and break actors (tests/fault_injection.rs).
//! Shared flags the actors consult at the points where a real fault would strike; all
//! off in normal runs, and checking them costs one relaxed load per step.

use crate::sync::Arc;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
    pub fn panic_next_verify(&self) {
        self.inner.panic_next_verify.store(true, Ordering::SeqCst);
    }
    pub(crate) fn take_verify_panic(&self) -> bool {
        self.inner.panic_next_verify.swap(false, Ordering::SeqCst)
    }
    pub(crate) fn take_readback_failure(&self) -> bool {
        self.inner.fail_next_readback.swap(false, Ordering::SeqCst)
    }
    pub(crate) fn take_step_panic(&self) -> bool {
        self.inner.panic_next_step.swap(false, Ordering::SeqCst)
    }
    pub(crate) fn take_start_failure(&self) -> bool {
        self.inner
            .failing_starts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}
