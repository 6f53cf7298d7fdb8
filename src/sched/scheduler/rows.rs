//! Planning one row: its input (known tokens, a ZOS continuation, or a decode token with
//! drafts to verify) and the bookkeeping of what is in flight.

use super::{RowRecord, Scheduler};
use crate::sched::sequence::RowRef;
use crate::sched::{PlannedRow, RowInput, StepId};
use std::collections::HashMap;

use crate::spec::{CurveCost, Draft, Drafter, SpecRequest, plan_verification_skipping};

/// Σ over a proposal of Π of the confidences up to each draft: its expected tokens.
fn survival_sum(confidences: impl Iterator<Item = f32>) -> f64 {
    let mut survival = 1.0;
    confidences
        .map(|c| {
            survival *= c.clamp(0.0, 1.0) as f64;
            survival
        })
        .sum()
}

/// Plain rows a confidence-scheduled sequence is continued with before it waits a step to
/// let its drafter look at its full history again.
const RECHECK_AFTER_PLAIN_ROWS: usize = 8;

/// `waits_for_drafts`' rule: a speculating sequence with a row in flight sits out the step
/// being planned when that row verifies drafts, under fixed-K verification, or when its
/// last drafts were worth more than the one token a ZOS continuation gives (infinite before
/// its drafter is calibrated) or it has not drafted for a while.
fn sits_out(
    verify_in_flight: bool,
    confidence_under_zos: bool,
    draft_gain: f64,
    num_plain_rows: usize,
) -> bool {
    verify_in_flight
        || !confidence_under_zos
        || draft_gain > 1.0
        || num_plain_rows >= RECHECK_AFTER_PLAIN_ROWS
}

impl Scheduler {
    /// Whether a speculating sequence with a row in flight sits out this step (ZOS plans
    /// it before that row's token is known). Never where its verify rows are continued
    /// (`continues`); else always while a verify row is in flight or under fixed-K
    /// verification, and under confidence scheduling only when its drafts were worth more
    /// than the token the continuation gives, or to look again every
    /// `RECHECK_AFTER_PLAIN_ROWS` plain rows.
    pub(super) fn waits_for_drafts(&self, idx: usize) -> bool {
        let seq = self.seq(idx);
        if self.continues(seq) {
            return false;
        }
        sits_out(
            seq.num_in_flight_verify_rows > 0,
            self.cfg.confidence_verify && self.cfg.verify_skips_next_step,
            seq.draft_gain,
            seq.num_plain_rows_since_draft,
        )
    }

    /// Confidence-scheduled verification: the drafts of every sequence whose next row is a
    /// decode row, cut to the verify lengths that maximise expected tokens per second of
    /// step time (`plan_verification` over the measured decode curve with the fitted cost
    /// model's attention terms, or the fitted model alone before a curve). Rows planned besides
    /// them count as they will run: plain decode rows, and the prefill chunk each running
    /// sequence still prefilling will get (sized the way `schedule` sizes it), so a step that
    /// mixes prefill and decode is priced whole. Sequences still waiting for admission are
    /// not counted: whether they fit is decided after the drafts.
    /// Per sequence: the drafts to verify, and how many were proposed.
    pub(super) fn confidence_drafts(&mut self) -> HashMap<usize, (Vec<u32>, usize)> {
        let mut requests = Vec::new();
        let mut proposals = Vec::new();
        let mut other_rows = Vec::new();
        let running = self.running.clone();
        let decode = self.decode_features();
        let mut num_prefill_rows = 0;
        for idx in running {
            let seq = self.seq(idx);
            if !seq.may_sample_more(self.cfg.max_context_tokens) {
                continue;
            }
            let num_cached = seq.num_scheduled_tokens;
            let Some(num_remaining) = seq.num_tokens().checked_sub(num_cached) else {
                continue;
            };
            if num_remaining > 1 {
                let max_q = num_remaining
                    .min(self.cfg.max_step_tokens)
                    .min(seq.max_chunk_tokens());
                let budget = self.cfg.step_time_budget_secs;
                let q = self.chunk(&decode, num_cached, max_q, budget, num_prefill_rows);
                if q > 0 {
                    other_rows.push((q, num_cached));
                    num_prefill_rows += 1;
                }
                continue;
            }
            if num_remaining != 1 {
                continue;
            }
            let num_context_tokens = seq.num_tokens();
            let history_known = seq.num_pending_tokens == 0;
            let drafts = self.propose(idx, self.cfg.num_speculative_tokens);
            let calibrated = self
                .seq(idx)
                .drafter
                .as_ref()
                .is_none_or(|d| d.calibrated());
            if history_known {
                // What waiting a step for the full history would buy next time (ZOS).
                let gain = if calibrated {
                    survival_sum(drafts.iter().map(|d| d.confidence))
                } else {
                    f64::INFINITY
                };
                let seq = self.seqs[idx].as_mut().expect("running");
                seq.draft_gain = gain;
                seq.num_plain_rows_since_draft = 0;
            }
            if drafts.is_empty() {
                other_rows.push((1, num_context_tokens));
                continue;
            }
            requests.push(SpecRequest {
                confidences: drafts.iter().map(|d| Some(d.confidence)).collect(),
                num_context_tokens,
                calibrated,
                sits_out_after: !self.continues(self.seq(idx)),
            });
            proposals.push((idx, drafts));
        }
        let skip_tokens = if self.cfg.verify_skips_next_step {
            1.0
        } else {
            0.0
        };
        let plan = match &self.decode_curve {
            Some(curve) => plan_verification_skipping(
                &requests,
                &other_rows,
                &CurveCost {
                    curve,
                    model: crate::spec::LinearCost(self.cost_model.coefficients()),
                    verify_factor: self.verify_price.factor(requests.len() + other_rows.len()),
                },
                skip_tokens,
            ),
            None => {
                plan_verification_skipping(&requests, &other_rows, &self.cost_model, skip_tokens)
            }
        };
        proposals
            .into_iter()
            .zip(plan.verify_lens)
            .map(|((idx, drafts), len)| {
                let seq = self.seqs[idx].as_mut().expect("running");
                if seq.draft_gain.is_finite() {
                    // What the plan took of them: waiting a step again pays only if it
                    // would take enough.
                    seq.draft_gain = survival_sum(drafts[..len].iter().map(|d| d.confidence));
                }
                let chosen = drafts[..len].iter().map(|d| d.token).collect();
                (idx, (chosen, drafts.len()))
            })
            .collect()
    }

    /// Up to `max_drafts` draft tokens for sequence `idx`'s next decode row: no more than
    /// its remaining output and context allow after the row's own token.
    pub(super) fn drafts(&mut self, idx: usize, max_drafts: usize) -> Vec<u32> {
        self.propose(idx, max_drafts)
            .into_iter()
            .map(|d| d.token)
            .collect()
    }

    /// Whether a row of `seq` continues its verify row in flight: under
    /// `continue_verify_rows`, for a sequence whose verify rows the rank verifies itself
    /// (any other would stall the whole next step until the sampler is done).
    pub(super) fn continues(&self, seq: &crate::sched::sequence::Sequence) -> bool {
        self.cfg.continue_verify_rows && seq.verified_by_picks
    }

    /// The drafter's proposal for sequence `idx`, with confidences, within the room left.
    /// A row continuing an in-flight one (`continue_verify_rows`) gets drafts proposed
    /// after a guess of what that row yields (`Drafter::propose_continuing`).
    fn propose(&mut self, idx: usize, max_drafts: usize) -> Vec<Draft> {
        let max_context_tokens = self.cfg.max_context_tokens;
        let continues = self.continues(self.seq(idx));
        let seq = self.seqs[idx].as_mut().expect("live");
        if seq.num_pending_tokens > 0 && !continues {
            return Vec::new();
        }
        let num_planned = seq.num_tokens() - seq.tokens.len();
        let room = (seq
            .max_tokens
            .saturating_sub(seq.num_generated() + num_planned + 1))
        .min(max_context_tokens.saturating_sub(seq.num_tokens() + 1))
        .min(max_drafts)
        .min(self.cfg.num_speculative_tokens);
        let Some(drafter) = seq.drafter.as_mut().filter(|_| room > 0) else {
            return Vec::new();
        };
        let mut drafts = if seq.num_pending_tokens == 0 {
            drafter.propose(&seq.tokens, room)
        } else {
            drafter.propose_continuing(&seq.tokens, &seq.in_flight_drafts, room)
        };
        // An image's placeholder is no token the model could sample: never a draft.
        if let Some(at) = drafts
            .iter()
            .position(|d| d.token >= crate::sched::FIRST_VIRTUAL_ID)
        {
            drafts.truncate(at);
        }
        drafts
    }

    /// Appends the row of sequence `idx` feeding its next `q` positions (the last
    /// `drafts.len()` of them drafts to verify).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_row(
        &mut self,
        idx: usize,
        step_id: StepId,
        q: usize,
        drafts: &[u32],
        rows: &mut Vec<PlannedRow>,
        records: &mut Vec<RowRecord>,
    ) {
        let row_index = rows.len();
        let seq = self.seqs[idx].as_mut().expect("live");
        let start = seq.num_scheduled_tokens;
        let input = if seq.num_pending_tokens > 0 {
            // Only a decode row can start at a pending token (see sequence.rs).
            debug_assert_eq!((q - drafts.len(), start + 1), (1, seq.num_tokens()));
            let from = seq.last_sample_row.expect("pending token has a source row");
            RowInput::FromPrevious {
                prev_step: from.step_id,
                prev_row: from.row,
                drafts: drafts.to_vec(),
            }
        } else {
            let mut tokens = seq.tokens[start..start + q - drafts.len()].to_vec();
            tokens.extend_from_slice(drafts);
            RowInput::Tokens(tokens)
        };
        let sample = start + q - drafts.len() == seq.num_tokens();
        rows.push(PlannedRow {
            seq_id: seq.seq_id,
            input,
            num_cached_tokens: start,
            block_table: seq.block_table.clone(),
            state_slot: seq.state_slot,
            state_start: seq.state_start,
            replay_until: seq.replay_until,
            sample,
            num_draft_tokens: drafts.len(),
        });
        records.push(RowRecord {
            seq_idx: idx,
            num_tokens: q,
            sample,
            num_draft_tokens: drafts.len(),
        });
        seq.num_scheduled_tokens += q;
        seq.num_in_flight_rows += 1;
        if !drafts.is_empty() {
            seq.num_in_flight_verify_rows += 1;
            seq.num_provisional_tokens += drafts.len();
            seq.in_flight_drafts.clear();
            seq.in_flight_drafts.extend_from_slice(drafts);
            seq.num_plain_rows_since_draft = 0;
        } else if sample {
            seq.num_plain_rows_since_draft += 1;
        }
        if sample {
            seq.num_pending_tokens += 1;
            seq.last_sample_row = Some(RowRef {
                step_id,
                row: row_index,
            });
        }
        if drafts.is_empty() {
            self.plan_state_save(idx, start + q, step_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_sits_out_a_zos_step_only_for_drafts_worth_it() {
        // A verify row in flight: its token count is unknown, always wait.
        assert!(sits_out(true, true, 0.0, 0));
        // Fixed-K verification drafts whenever it can.
        assert!(!sits_out(false, true, 0.5, 0) && sits_out(false, false, 0.5, 0));
        // Confidence under ZOS: drafts worth more than the continuation's token, or a
        // drafter still learning, wait; others are continued until a periodic look.
        assert!(sits_out(false, true, 1.4, 0));
        assert!(sits_out(false, true, f64::INFINITY, 0));
        assert!(!sits_out(false, true, 1.0, RECHECK_AFTER_PLAIN_ROWS - 1));
        assert!(sits_out(false, true, 0.0, RECHECK_AFTER_PLAIN_ROWS));
        // 0.9, then 0.9·0.5, then a confidence above 1 counted as 1.
        let gain = survival_sum([0.9f32, 0.5, 2.0].into_iter());
        assert!((gain - 1.8).abs() < 1e-6, "{gain}");
    }
}
