//! `SlotPool`: reusable buffers handed out one holder at a time (the GPU's page-locked
//! pick slots: taken when a step's picks are copied out, put back once they are read, on
//! whichever thread reads them).

use super::{Arc, Mutex};

pub struct SlotPool<T> {
    free: Arc<Mutex<Vec<T>>>,
}

impl<T> Clone for SlotPool<T> {
    fn clone(&self) -> Self {
        SlotPool {
            free: self.free.clone(),
        }
    }
}

impl<T> Default for SlotPool<T> {
    fn default() -> Self {
        SlotPool {
            free: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl<T> SlotPool<T> {
    /// A free slot, or a new one from `make` when none is free.
    pub fn take_or(&self, make: impl FnOnce() -> T) -> T {
        self.take().unwrap_or_else(make)
    }

    /// A free slot, if one is.
    pub fn take(&self) -> Option<T> {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// Back in the pool for the next taker.
    pub fn put(&self, slot: T) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
    }

    /// Slots free now.
    pub fn num_free(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}
