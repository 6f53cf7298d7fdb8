//! Prompt logprobs: which of a planned row's tokens are scored, and the sampler's scores
//! gathered per prompt position until the request's first output carries them.

use super::{Request, SchedulerState};
use crate::sampling::ScoredToken;
use crate::sched::{PlannedRow, RowInput};
use crate::step::{PromptScore, ScoredRow, Step};

impl Request {
    /// What of `row`'s tokens is scored, while the prompt's scores are still wanted.
    pub(super) fn score(&self, row: &PlannedRow) -> Option<PromptScore> {
        let num_top = self.request.prompt_logprobs?;
        self.prompt_scores.as_ref()?;
        let RowInput::Tokens(ids) = &row.input else {
            return None;
        };
        // Drafts ride only on a row with one prompt token left, which scores nothing (its
        // logits draw the first generated token): a scored row's sampling row is its last.
        debug_assert!(
            row.num_draft_tokens == 0 || row.num_cached_tokens + 1 >= self.prompt_ids.len()
        );
        let (first, num_prompt) = (row.num_cached_tokens, self.prompt_ids.len());
        // The last prompt position's logits draw the first generated token; past the
        // prompt (a recompute after preemption) nothing is scored.
        let end = (first + ids.len()).min(num_prompt - 1);
        (first < end).then(|| PromptScore {
            first_position: first,
            targets: self.prompt_ids[first + 1..=end].to_vec(),
            num_top,
        })
    }
}

impl Request {
    /// The prompt's scores, once every position after the first has one (a request ended
    /// before its prompt was scored through reports none, never holes).
    pub(super) fn take_scores(&mut self) -> Option<Vec<Option<ScoredToken>>> {
        let scores = self.prompt_scores.take()?;
        scores[1..].iter().all(Option::is_some).then_some(scores)
    }
}

impl SchedulerState {
    /// Files `scored`'s tokens under their sequences' prompt positions (a recomputed
    /// position overwrites its earlier score).
    pub(super) fn on_scored(&mut self, planned: &Step, scored: Vec<ScoredRow>) {
        for s in scored {
            let Some(row) = planned.rows.get(s.row) else {
                continue;
            };
            let Some(scores) = self
                .requests
                .get_mut(&row.plan.seq_id)
                .and_then(|r| r.prompt_scores.as_mut())
            else {
                continue;
            };
            for (i, token) in s.tokens.into_iter().enumerate() {
                if let Some(slot) = scores.get_mut(s.first_position + 1 + i) {
                    *slot = Some(token);
                }
            }
        }
    }
}
