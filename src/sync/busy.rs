//! `BusyCell`: a value that a worker brings forward in the background while its owner
//! may need it at any time. The owner marks it busy and hands the work off; whoever wants
//! the value waits until the work has finished instead of racing it. (The grammar
//! matcher: the mask pool advances it beside the forward pass, the sampler masks with it.)

use super::{Condvar, Mutex, MutexGuard};

pub struct BusyCell<T> {
    state: Mutex<Slot<T>>,
    idle: Condvar,
}

struct Slot<T> {
    value: T,
    busy: bool,
}

impl<T> BusyCell<T> {
    pub fn new(value: T) -> Self {
        BusyCell {
            state: Mutex::new(Slot { value, busy: false }),
            idle: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slot<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Work on the value is pending: `with_idle` waits until `finish`.
    pub fn mark_busy(&self) {
        self.lock().busy = true;
    }

    /// The pending work: `work` runs on the value, then waiters wake.
    pub fn finish<R>(&self, work: impl FnOnce(&mut T) -> R) -> R {
        let mut slot = self.lock();
        let out = work(&mut slot.value);
        slot.busy = false;
        drop(slot);
        self.idle.notify_all();
        out
    }

    /// `f` on the value once no work is pending on it.
    pub fn with_idle<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut slot = self.lock();
        while slot.busy {
            slot = self.idle.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
        f(&mut slot.value)
    }

    /// `f` on the value as it is now, pending work or not (for reports).
    pub fn with_current<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.lock().value)
    }
}
