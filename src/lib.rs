//! troupe: an LLM inference engine. See docs/ARCHITECTURE.md for the map of the tree.

pub mod actors;
pub mod api;
pub mod bench_serve;
pub mod cli;
pub mod cluster;
pub mod engine;
pub mod eplb;
pub mod error;
pub mod kernels;
pub mod model;
pub mod notice;
pub mod protocol;
pub mod route;
pub mod runner;
pub mod sampling;
pub mod sched;
pub mod spec;
pub mod step;
pub mod store;
pub mod structured;
pub mod sync;

pub use error::{Result, TroupeError};
