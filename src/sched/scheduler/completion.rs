//! Taking a step's results: tokens to the sequences, KV positions computed (and rolled back
//! for rejected drafts), finished sequences released.

use super::{Scheduler, SeqStatus};
use crate::sched::SeqId;
use crate::sched::{SeqEvent, StepId};
use crate::spec::Drafter;

impl Scheduler {
    /// Takes step `step_id`'s results, one token per sampling row. See the module doc for
    /// the contract.
    /// Before `on_step_verified` of the same step: the probabilities a draft model gave
    /// the drafts it filled in, per sequence (`--spec draft`), for its drafter's
    /// confidences.
    pub fn observe_draft_probs(&mut self, probs: &[(SeqId, &[f32])]) {
        for &(seq_id, p) in probs {
            let Some(&idx) = self.idx_of.get(&seq_id) else {
                continue;
            };
            if let Some(drafter) = self.seqs[idx].as_mut().and_then(|s| s.drafter.as_mut()) {
                drafter.observe_draft_probs(p);
            }
        }
    }

    pub fn on_step_done(
        &mut self,
        step_id: StepId,
        sampled: &[u32],
        elapsed_secs: f64,
    ) -> Vec<SeqEvent> {
        let per_row: Vec<&[u32]> = sampled.iter().map(std::slice::from_ref).collect();
        self.on_step_verified(step_id, &per_row, elapsed_secs)
    }

    /// The period between the completion of step `step_id` (just taken by
    /// `on_step_verified`) and the one before it, as the engine ran: what confidence
    /// scheduling learns the real price of a verify step from (`VerifyPrice`).
    pub fn observe_step_period(&mut self, step_id: StepId, secs: f64) {
        if let Some((id, num_rows, verifies, predicted)) = self.last_decode_step.take()
            && id == step_id
        {
            self.verify_price
                .observe(num_rows, verifies, predicted, secs);
            tracing::debug!(
                num_rows,
                verifies,
                predicted,
                observed = secs,
                verify_factor = self.verify_price.factor(num_rows),
                "decode step priced"
            );
        }
    }

    /// A decode step's rows, whether it verified drafts and the seconds the measured curve
    /// gives it; `None` for a step with prefill chunks or without a curve.
    fn curve_secs(&self, step: &super::InFlightStep) -> Option<(StepId, usize, bool, f64)> {
        let curve = self.decode_curve.as_ref()?;
        let decode = step
            .rows
            .iter()
            .all(|r| r.sample && r.num_tokens == 1 + r.num_draft_tokens);
        if !decode {
            return None;
        }
        let cost = crate::spec::CurveCost {
            curve,
            model: crate::spec::LinearCost(self.cost_model.coefficients()),
            verify_factor: 1.0,
        };
        let verifies = step.rows.iter().any(|r| r.num_draft_tokens > 0);
        let predicted = crate::spec::StepCost::step_secs(&cost, &step.features);
        Some((step.step_id, step.rows.len(), verifies, predicted))
    }

    /// `on_step_done` for steps with verify rows: per sampling row its tokens — the
    /// accepted drafts and one more (one token for a row without drafts). The KV written
    /// for rejected drafts is rolled back: those positions are computed again.
    pub fn on_step_verified(
        &mut self,
        step_id: StepId,
        sampled: &[&[u32]],
        elapsed_secs: f64,
    ) -> Vec<SeqEvent> {
        if self.in_flight.front().is_none_or(|s| s.step_id != step_id) {
            debug_assert!(
                self.in_flight.iter().all(|s| s.step_id != step_id),
                "step {step_id} completed out of plan order"
            );
            return Vec::new();
        }
        let step = self.in_flight.pop_front().expect("checked above");
        let num_sampling_rows = step.rows.iter().filter(|r| r.sample).count();
        assert_eq!(
            sampled.len(),
            num_sampling_rows,
            "step {step_id} has {num_sampling_rows} sampling rows but {} tokens came back",
            sampled.len()
        );
        self.cost_model
            .observe_features(&step.features, elapsed_secs);
        self.last_decode_step = self.curve_secs(&step);
        let mut events = std::mem::take(&mut self.pending_events);
        let mut sampled = sampled.iter();
        let mut any_finished = false;
        for rec in &step.rows {
            let tokens: &[u32] = if rec.sample {
                sampled.next().copied().unwrap_or(&[])
            } else {
                &[]
            };
            assert!(
                !rec.sample || (1..=rec.num_draft_tokens + 1).contains(&tokens.len()),
                "step {step_id}: a row with {} drafts yielded {} tokens",
                rec.num_draft_tokens,
                tokens.len()
            );
            let num_rejected = if rec.sample {
                rec.num_draft_tokens + 1 - tokens.len()
            } else {
                0
            };
            let seq = self.seqs[rec.seq_idx]
                .as_mut()
                .expect("in-flight row's sequence lives");
            seq.num_in_flight_rows -= 1;
            if rec.num_draft_tokens > 0 {
                seq.num_in_flight_verify_rows = seq.num_in_flight_verify_rows.saturating_sub(1);
                seq.num_provisional_tokens -= rec.num_draft_tokens;
                if seq.num_in_flight_verify_rows == 0 {
                    seq.in_flight_drafts.clear();
                }
            }
            let running = match seq.status {
                // The row ran after its sequence ended (ZOS overshoot, abort): discarded.
                SeqStatus::Finished => {
                    if seq.num_in_flight_rows == 0 {
                        self.remove(rec.seq_idx);
                    }
                    continue;
                }
                SeqStatus::Running => {
                    // Positions of rejected drafts hold KV for tokens that are not the
                    // sequence's: computed again next time. Accepted drafts count once
                    // they are the sequence's tokens (below).
                    seq.num_computed_tokens += rec.num_tokens - rec.num_draft_tokens;
                    seq.num_scheduled_tokens -= num_rejected;
                    self.register_computed_blocks(rec.seq_idx);
                    true
                }
                // Preempted after planning: its KV is dropped, but the samples are valid.
                SeqStatus::Waiting => false,
            };
            if tokens.is_empty() {
                continue;
            }
            let seq = self.seqs[rec.seq_idx].as_mut().expect("live");
            let seq_id = seq.seq_id;
            if let Some(drafter) = &mut seq.drafter
                && rec.num_draft_tokens > 0
            {
                drafter.observe(rec.num_draft_tokens, tokens.len() - 1);
            }
            for (j, &token) in tokens.iter().enumerate() {
                let seq = self.seqs[rec.seq_idx].as_mut().expect("live");
                let (emitted, finish) = if j == 0 {
                    seq.accept_sample(token, self.cfg.max_context_tokens)
                } else {
                    seq.accept_verified(token, self.cfg.max_context_tokens)
                };
                if emitted {
                    events.push(SeqEvent::Token { seq_id, token });
                    if running && j + 1 < tokens.len() {
                        // An accepted draft: its KV position is the sequence's now.
                        seq.num_computed_tokens += 1;
                        self.register_computed_blocks(rec.seq_idx);
                    }
                }
                if let Some(reason) = finish {
                    events.push(SeqEvent::Finished { seq_id, reason });
                    self.finish(rec.seq_idx);
                    any_finished = true;
                    break;
                }
            }
        }
        while self
            .deferred
            .front()
            .is_some_and(|d| d.after_step <= step_id)
        {
            let d = self.deferred.pop_front().expect("checked above");
            self.num_deferred_blocks -= d.blocks.len();
            self.release_now(&d.blocks, d.slot);
        }
        if any_finished {
            let seqs = &self.seqs;
            let live = |i: &usize| seqs[*i].as_ref().is_some_and(|s| !s.is_finished());
            self.running.retain(live);
            self.waiting.retain(live);
        }
        events
    }
}
