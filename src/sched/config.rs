//! Scheduler configuration: pool sizes, caps and the per-step time budget.

/// Sizes and policies of one [`Scheduler`](super::Scheduler). Plain data; the scheduler
/// reads it once at construction.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in blocks.
    pub num_blocks: usize,
    /// Per-sequence state slots; `None` when the model needs none.
    pub num_state_slots: Option<usize>,
    /// With state slots: tokens before a prefix-cache hit point that are recomputed to
    /// rebuild a sequence's state (its blocks hold the rest).
    pub num_replay_tokens: usize,
    /// With state slots: states saved at block boundaries and kept with the prefix, so a
    /// hit resumes without the replay (`saved_states.rs`); 0: every hit replays.
    pub num_saved_states: usize,
    /// Cap on running (admitted) sequences.
    pub max_num_seqs: usize,
    /// Token cap per step: prefill chunk tokens plus one per decode row.
    pub max_step_tokens: usize,
    /// Time budget per step that the cost model sizes prefill chunks against.
    pub step_time_budget_secs: f64,
    pub enable_prefix_cache: bool,
    /// Prompt plus generated tokens of one sequence never exceed this.
    pub max_context_tokens: usize,
    /// A preempted sequence ends (`FinishReason::Preempted`) instead of being
    /// recomputed later: for callers that would rather retry elsewhere than wait.
    pub stop_preempted: bool,
    /// Draft tokens a decode row may carry for verification (prompt lookup); 0: off.
    pub num_speculative_tokens: usize,
    /// Verify only the drafts worth their cost this step (DSpark: survival of the drafts'
    /// confidences against the fitted step cost); else every draft proposed.
    pub confidence_verify: bool,
    /// Steps are planned while the previous one runs (ZOS): a sequence whose row verifies
    /// drafts sits out the next step, which confidence scheduling charges it.
    pub verify_skips_next_step: bool,
    /// Under ZOS a sequence whose row verifies drafts is continued in the next step
    /// anyway: the rank reads that row's last token and moves the continuing row back by
    /// the drafts it rejected (models without per-sequence state; sequences whose verify
    /// rows the rank verifies itself, `SeqRequest::verified_by_picks`). Such a sequence
    /// never sits out, and its verify rows are not charged a step.
    pub continue_verify_rows: bool,
    /// Drafts come from a draft model in the rank workers: planned rows carry placeholders
    /// (`spec::MODEL_DRAFT`) the worker fills in. Otherwise prompt lookup.
    pub model_drafts: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            num_state_slots: None,
            num_replay_tokens: 0,
            num_saved_states: 0,
            max_num_seqs: 256,
            max_step_tokens: 2048,
            step_time_budget_secs: 0.05,
            enable_prefix_cache: true,
            max_context_tokens: 4096,
            stop_preempted: false,
            num_speculative_tokens: 0,
            confidence_verify: false,
            verify_skips_next_step: false,
            continue_verify_rows: false,
            model_drafts: false,
        }
    }
}
