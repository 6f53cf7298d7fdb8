//! The pure scheduling core: block accounting, state slots, prefix cache, cost model and
//! the step planner. No ractor, tokio or device imports; unit-tested in milliseconds.
//!
//! | file | what it is |
//! |---|---|
//! | `config.rs` | [`SchedulerConfig`]: pool sizes, caps, step time budget |
//! | `error.rs` | [`SchedError`]: why `add` refuses a request for good |
//! | `sequence.rs` | [`SeqRequest`], [`SeqEvent`], [`FinishReason`], per-request progress |
//! | `plan.rs` | [`StepPlan`], [`PlannedRow`], [`RowInput`]: what rank workers run |
//! | `block_manager.rs` | refcounted KV blocks: intrusive free list + LRU of cached blocks |
//! | `state_slots.rs` | per-sequence state slots (a second fixed-size pool) |
//! | `saved_states.rs` | slot states saved at block boundaries, kept with the prefix ([`StateSave`], [`StateLoad`]) |
//! | `prefix_cache.rs` | chain hash of full blocks → block, verified on hit |
//! | `stored_prefix.rs` | [`StoredPrefix`] (a prompt's blocks found in a prefix store), [`KvLoad`], [`KvSave`] |
//! | `cost_model.rs` | step seconds as a quadratic in (q, c), refit online |
//! | `scheduler.rs` | [`Scheduler`]: continuous batching, chunked prefill, preemption, ZOS |
//! | `scheduler/resources.rs` | a sequence's blocks and slot: reserve, register, (deferred) release |
//! | `scheduler/sim.rs`, `tests.rs` | fake paged device + reference model; scenario tests |

mod block_manager;
mod config;
mod cost_model;
mod error;
mod plan;
mod prefix_cache;
mod saved_states;
mod scheduler;
mod sequence;
mod state_slots;
mod stored_prefix;

/// Token ids from here up name an image's placeholders by its content in the core's copy
/// of a prompt (`step::PromptImage::virtual_ids`); no vocabulary reaches them.
pub const FIRST_VIRTUAL_ID: u32 = 1 << 31;

pub use block_manager::{Alloc, Allocation, BlockManager};
pub use config::SchedulerConfig;
pub use cost_model::{CostModel, StepFeatures};
pub use error::SchedError;
pub use plan::{PlannedRow, RowInput, StepPlan};
pub use prefix_cache::{CachedBlock, PrefixCache, PrefixCacheStats, ROOT_HASH, block_hash};
pub use saved_states::{SavedStates, StateLoad, StateSave};
pub use scheduler::Scheduler;
pub use sequence::{FinishReason, SeqEvent, SeqRequest};
pub use state_slots::StateSlots;
pub use stored_prefix::{KvLoad, KvSave, StateImport, StoredBlock, StoredPrefix};

/// A request's id, chosen by the caller; unique among unfinished requests.
pub type SeqId = u64;
/// A planned step's id: 0, 1, 2, … in plan order for the scheduler's lifetime.
pub type StepId = u64;
