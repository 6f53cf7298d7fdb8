//! A request as the scheduler sees it: what was asked ([`SeqRequest`]), what it emits
//! ([`SeqEvent`]) and its progress ([`Sequence`]).
//!
//! Token positions of a sequence, at any moment:
//! `num_computed_tokens ≤ num_scheduled_tokens < num_tokens()`, where
//! - `tokens` are the known ones (prompt + generated tokens already reported);
//! - `num_tokens()` adds `num_pending_tokens`, sampled by in-flight steps but not yet
//!   reported (zero-overhead scheduling plans as if each had arrived), and
//!   `num_provisional_tokens`, the drafts of in-flight verify rows (planned as if all
//!   are accepted; a continuing row moves back on the device by as many as are not);
//! - `num_scheduled_tokens` have their KV written by done or in-flight steps;
//! - `num_computed_tokens` have their KV written by done steps (prefix-cache safe).
//!
//! A running sequence's next row feeds positions `num_scheduled_tokens..` and samples
//! when it reaches `num_tokens()`; a decode row is the case of exactly one position left.

use super::{SeqId, StepId};
use crate::spec::SeqDrafter;

/// A generation request handed to [`Scheduler::add`](super::Scheduler::add).
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    pub seq_id: SeqId,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// Generate through stop tokens (they are emitted as ordinary tokens).
    pub ignore_eos: bool,
    /// Prefix-cache namespace: only requests with equal salts share cached blocks.
    pub cache_salt: u64,
    /// Its verify rows are verified against the target's picks (greedy, or drawn on the
    /// device with the seed, the drafts accepted by the draw or by rejection there;
    /// nothing applied to the logits but a grammar's mask, which the rank computes): the
    /// rank learns their outcome itself, so under ZOS a row continuing one needs no wait
    /// for the sampler (`continue_verify_rows`).
    pub verified_by_picks: bool,
    /// Its prompt is scored (prompt logprobs): every prompt position is computed, so its
    /// admission takes no prefix hits (from the device's cache or the store).
    pub score_prompt: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled (it is not emitted).
    Stop,
    /// `max_tokens` generated, or the context is full.
    Length,
    /// Ended by [`Scheduler::abort`](super::Scheduler::abort); never emitted by the core.
    Abort,
    /// Preempted under `stop_preempted`: its KV was given up and it is not recomputed.
    Preempted,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// One generated token, in order; stop tokens are not emitted.
    Token {
        seq_id: SeqId,
        token: u32,
    },
    Finished {
        seq_id: SeqId,
        reason: FinishReason,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    /// Finished or aborted; kept only until its in-flight rows are done.
    Finished,
}

/// Where a pending token will come from: row `row` of in-flight step `step_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRef {
    pub step_id: StepId,
    pub row: usize,
}

/// Progress of one request; see the module doc for the position invariants.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub seq_id: SeqId,
    /// Order of arrival, for re-queueing after a device reset.
    pub arrival: u64,
    pub num_prompt_tokens: usize,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub cache_salt: u64,
    pub verified_by_picks: bool,
    pub score_prompt: bool,
    pub tokens: Vec<u32>,
    pub num_pending_tokens: usize,
    pub num_scheduled_tokens: usize,
    pub num_computed_tokens: usize,
    pub block_table: Vec<u32>,
    /// Chain hashes of `block_table`'s leading blocks that are prefix-cache hits or were
    /// registered (or found already registered) after being computed.
    pub block_hashes: Vec<u64>,
    pub state_slot: Option<u32>,
    /// Where the state slot's history begins: 0, or for a prefix hit on a model with
    /// per-sequence state, the first replayed token (bounded replay).
    pub state_start: usize,
    /// Tokens before this are prefix-cache hits: replayed rows rebuild the slot's state
    /// from them and leave their (shared, already written) blocks alone.
    pub replay_until: usize,
    pub status: SeqStatus,
    /// Rows of this sequence in in-flight steps; resources are only reused at 0.
    pub num_in_flight_rows: usize,
    /// The latest sampling row planned for this sequence.
    pub last_sample_row: Option<RowRef>,
    /// Proposes draft tokens when speculative decoding is on.
    pub drafter: Option<SeqDrafter>,
    /// In-flight rows that verify drafts (their token counts are unknown until verified).
    pub num_in_flight_verify_rows: usize,
    /// Drafts of in-flight verify rows, counted in `num_tokens()` as if accepted.
    pub num_provisional_tokens: usize,
    /// The drafts of the latest in-flight verify row: with the tokens, the history a
    /// continuing row's drafts are proposed after.
    pub in_flight_drafts: Vec<u32>,
    /// Expected tokens its latest proposal's drafts were worth (Σ of their survivals);
    /// infinite until a calibrated proposal was seen.
    pub draft_gain: f64,
    /// Sampling rows planned without drafts since its drafter last saw its full history.
    pub num_plain_rows_since_draft: usize,
    /// Prompt blocks a prefix store holds, taken at admission.
    pub stored_prefix: Option<crate::sched::StoredPrefix>,
}

/// The most prompt tokens a step scores for one sequence: a scored chunk returns a logit
/// row per token (a vocabulary of floats each, copied to the host too), so its chunks are
/// kept this short.
pub const MAX_SCORED_CHUNK_TOKENS: usize = 256;

impl Sequence {
    /// Its prompt is still to be scored (nothing generated yet): it takes no prefix hits
    /// and its chunks are at most `MAX_SCORED_CHUNK_TOKENS`.
    pub fn scores_prompt(&self) -> bool {
        self.score_prompt && self.tokens.len() == self.num_prompt_tokens
    }

    /// The longest chunk a step may give it.
    pub fn max_chunk_tokens(&self) -> usize {
        if self.scores_prompt() {
            MAX_SCORED_CHUNK_TOKENS
        } else {
            usize::MAX
        }
    }

    pub fn new(req: SeqRequest, arrival: u64) -> Self {
        Self {
            seq_id: req.seq_id,
            arrival,
            num_prompt_tokens: req.prompt_ids.len(),
            max_tokens: req.max_tokens,
            stop_ids: req.stop_ids,
            ignore_eos: req.ignore_eos,
            cache_salt: req.cache_salt,
            verified_by_picks: req.verified_by_picks,
            score_prompt: req.score_prompt,
            tokens: req.prompt_ids,
            num_pending_tokens: 0,
            num_scheduled_tokens: 0,
            num_computed_tokens: 0,
            block_table: Vec::new(),
            block_hashes: Vec::new(),
            state_slot: None,
            state_start: 0,
            replay_until: 0,
            status: SeqStatus::Waiting,
            num_in_flight_rows: 0,
            last_sample_row: None,
            drafter: None,
            num_in_flight_verify_rows: 0,
            num_provisional_tokens: 0,
            in_flight_drafts: Vec::new(),
            draft_gain: f64::INFINITY,
            num_plain_rows_since_draft: 0,
            stored_prefix: None,
        }
    }

    /// Known plus pending tokens, and in-flight drafts as if accepted.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len() + self.num_pending_tokens + self.num_provisional_tokens
    }

    /// Generated tokens already reported.
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    pub fn is_finished(&self) -> bool {
        self.status == SeqStatus::Finished
    }

    /// Whether one more token may be sampled, counting in-flight samples: never plan a
    /// row past `max_tokens` or the context.
    pub fn may_sample_more(&self, max_context_tokens: usize) -> bool {
        self.num_generated() + self.num_pending_tokens + self.num_provisional_tokens
            < self.max_tokens
            && self.num_tokens() < max_context_tokens
    }

    /// Takes one sampled token. Returns whether it is emitted and whether the sequence
    /// finished with it. A stop token is neither emitted nor kept.
    pub fn accept_sample(
        &mut self,
        token: u32,
        max_context_tokens: usize,
    ) -> (bool, Option<FinishReason>) {
        self.num_pending_tokens -= 1;
        self.accept_verified(token, max_context_tokens)
    }

    /// A token beyond the pending one: an accepted draft's successor in a verify row.
    pub fn accept_verified(
        &mut self,
        token: u32,
        max_context_tokens: usize,
    ) -> (bool, Option<FinishReason>) {
        if !self.ignore_eos && self.stop_ids.contains(&token) {
            return (false, Some(FinishReason::Stop));
        }
        self.tokens.push(token);
        let full =
            self.num_generated() >= self.max_tokens || self.tokens.len() >= max_context_tokens;
        (true, full.then_some(FinishReason::Length))
    }

    /// Forgets all KV state so the sequence recomputes from its known tokens; the caller
    /// has taken `block_table` and `state_slot` to release them.
    pub fn reset_kv(&mut self) {
        debug_assert!(self.block_table.is_empty() && self.state_slot.is_none());
        self.num_scheduled_tokens = 0;
        self.num_computed_tokens = 0;
        self.state_start = 0;
        self.replay_until = 0;
        self.block_hashes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(max_tokens: usize, ignore_eos: bool) -> Sequence {
        Sequence::new(
            SeqRequest {
                seq_id: 1,
                prompt_ids: vec![5, 6, 7],
                max_tokens,
                stop_ids: vec![0],
                ignore_eos,
                cache_salt: 0,
                verified_by_picks: true,
                score_prompt: false,
            },
            0,
        )
    }

    #[test]
    fn stop_token_finishes_without_being_kept() {
        let mut s = seq(10, false);
        s.num_pending_tokens = 2;
        assert_eq!(s.accept_sample(9, 100), (true, None));
        assert_eq!(s.accept_sample(0, 100), (false, Some(FinishReason::Stop)));
        assert_eq!(s.tokens, vec![5, 6, 7, 9]);
    }

    #[test]
    fn ignore_eos_emits_stop_tokens_and_length_limits_apply() {
        let mut s = seq(2, true);
        s.num_pending_tokens = 2;
        assert!(!s.may_sample_more(100), "two pending reach max_tokens");
        assert_eq!(s.accept_sample(0, 100), (true, None));
        assert_eq!(s.accept_sample(0, 100), (true, Some(FinishReason::Length)));
        let mut s = seq(10, false);
        s.num_pending_tokens = 1;
        assert_eq!(s.accept_sample(4, 4), (true, Some(FinishReason::Length)));
    }
}
