//! `RequestIds`: the engine handle's request ids, unique across every clone of the handle
//! and every task that submits through it.

use crate::sync::Arc;
use crate::sync::atomic::{AtomicU64, Ordering};

#[derive(Clone)]
pub struct RequestIds {
    next: Arc<AtomicU64>,
}

impl Default for RequestIds {
    fn default() -> Self {
        RequestIds {
            next: Arc::new(AtomicU64::new(1)),
        }
    }
}

impl RequestIds {
    /// A fresh id. Uniqueness is all that is asked of the ids (no ordering with other
    /// memory), so a relaxed increment suffices: it is still one atomic read-modify-write.
    pub fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }
}
