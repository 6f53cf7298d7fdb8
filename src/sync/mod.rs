//! The one place shared-memory primitives come from: std normally, loom under
//! the `loom` feature so the loom suites (`tests/loom_*.rs`) can explore their
//! interleavings. Nothing else in the crate names `std::sync`.
//!
//! `Shared` is std's `Arc` in both builds: a reference count over data nobody writes
//! after it is shared (prompts, parameters, weights, trait objects), where there is no
//! ordering for loom to explore and loom's `Arc` (no unsized coercion) does not fit.
//! `OnceLock` is std's too: loom has none, and a value set once before it is read by
//! anyone has no interleaving to explore.

#[cfg(feature = "loom")]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};
#[cfg(feature = "loom")]
pub use loom::thread;

#[cfg(not(feature = "loom"))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};
#[cfg(not(feature = "loom"))]
pub use std::thread;

pub use std::sync::Arc as Shared;
pub use std::sync::OnceLock;
/// prometheus-client's gauges are generic over std's atomics: metric values only, never
/// synchronised on.
pub use std::sync::atomic::AtomicU64 as GaugeAtomicU64;

mod busy;
pub mod channel;
mod gate;
mod host_flags;
mod pool;

pub use busy::BusyCell;
pub use gate::{Gate, Refusal, Ticket};
pub use host_flags::{ABANDONED, HostFlags};
pub use pool::SlotPool;
