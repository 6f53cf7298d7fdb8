//! A planned step: what the rank workers run, row by row.

use super::{KvLoad, SeqId, StateImport, StateLoad, StateSave, StepId};

/// One forward step over a batch of rows (decode rows and prefill chunks, mixed).
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub step_id: StepId,
    pub rows: Vec<PlannedRow>,
    /// Blocks of admitted prefix-store hits, filled before the rows run.
    pub kv_loads: Vec<KvLoad>,
    /// Saved states copied into admitted sequences' slots before the rows run.
    pub state_loads: Vec<StateLoad>,
    /// States the store kept, written into admitted sequences' slots before the rows run.
    pub state_imports: Vec<StateImport>,
    /// Slots copied out after the rows ran (each then ends at a block boundary).
    pub state_saves: Vec<StateSave>,
}

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct PlannedRow {
    pub seq_id: SeqId,
    pub input: RowInput,
    /// KV positions already filled; the row's first input token sits at this position.
    pub num_cached_tokens: usize,
    /// Covers `num_cached_tokens + row length` positions.
    pub block_table: Vec<u32>,
    pub state_slot: Option<u32>,
    /// Where the slot's state begins (a row starting here starts it afresh) and where a
    /// bounded replay of prefix-hit tokens ends (`Sequence::state_start`, `replay_until`).
    pub state_start: usize,
    pub replay_until: usize,
    /// This row's last token yields a sampled token (final prefill chunk, or decode).
    pub sample: bool,
    /// The row's last inputs are this many draft tokens: it returns a logit row for each
    /// and one after, and yields 1 ..= this + 1 tokens (the accepted drafts and one more).
    pub num_draft_tokens: usize,
}

impl PlannedRow {
    /// Input tokens of the row (`FromPrevious`: the continued token and its drafts).
    pub fn num_tokens(&self) -> usize {
        match &self.input {
            RowInput::Tokens(tokens) => tokens.len(),
            RowInput::FromPrevious { drafts, .. } => 1 + drafts.len(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum RowInput {
    Tokens(Vec<u32>),
    /// Zero-overhead scheduling: first the token sampled last by row `prev_row` of the
    /// in-flight step `prev_step` (the rank worker finds it on the device or in its
    /// sampled-token buffer), then `drafts` to verify after it. `prev_row` indexes that
    /// plan's `rows` (all rows, not only sampling ones).
    ///
    /// When `prev_row` verifies drafts of its own, this row was planned as if all of them
    /// are accepted: each one rejected moves this row one position earlier
    /// (`num_cached_tokens` is its position when none is), and its drafts were proposed
    /// after a guess of what that row draws.
    FromPrevious {
        prev_step: StepId,
        prev_row: usize,
        drafts: Vec<u32>,
    },
}
