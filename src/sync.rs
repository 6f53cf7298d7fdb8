//! The one place shared-memory primitives come from: std normally, loom under
//! `--cfg troupe_loom` so the loom suites (`tests/loom_*.rs`) can explore their
//! interleavings. Nothing else in the crate names `std::sync` for shared state.

#[cfg(troupe_loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};
#[cfg(troupe_loom)]
pub use loom::thread;

#[cfg(not(troupe_loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};
#[cfg(not(troupe_loom))]
pub use std::thread;
