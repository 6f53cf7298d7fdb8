//! A step's sampled tokens into the core, request outputs and status counters.

use crate::sync::Shared;
use std::collections::{HashMap, VecDeque};

use super::{SchedulerMsg, SchedulerState, TokenLogprobs, request_id_of};
use crate::api::MAX_SPEC_POSITIONS;
use crate::api::RequestOutput;
use crate::sched::{SeqEvent, SeqId};
use crate::step::{SampledStep, Step};

impl SchedulerState {
    pub(super) fn on_sampled(&mut self, mut step: SampledStep) {
        let (step_id, secs) = (step.step_id, step.elapsed_secs);
        let Some(planned) = self.in_flight.pop_front() else {
            return;
        };
        debug_assert_eq!(planned.step_id, step_id, "steps complete in plan order");
        // Before the tokens: the first output of a scored prompt carries its scores.
        self.on_scored(&planned, std::mem::take(&mut step.scored));
        self.count_sampled(&planned, &step);
        let sampling_rows = planned.rows.iter().map(|r| &r.plan).filter(|r| r.sample);
        // Per sequence, its tokens' logprobs in emission order.
        let mut logprobs_of: HashMap<SeqId, VecDeque<TokenLogprobs>> = sampling_rows
            .clone()
            .zip(&step.rows)
            .map(|(row, sampled)| {
                let lps = sampled.token_logprobs.iter().copied();
                (row.seq_id, lps.zip(sampled.top_logprobs.clone()).collect())
            })
            .collect();
        let probs: Vec<(SeqId, &[f32])> = sampling_rows
            .zip(&step.rows)
            .filter(|(_, s)| !s.draft_probs.is_empty())
            .map(|(r, s)| (r.seq_id, s.draft_probs.as_slice()))
            .collect();
        self.core.observe_draft_probs(&probs);
        let per_row: Vec<&[u32]> = step.rows.iter().map(|r| r.tokens.as_slice()).collect();
        let events = self.core.on_step_verified(step_id, &per_row, secs);
        // Steps in a row complete a period apart; after an idle gap, the step's own
        // latency bounds it.
        let now = std::time::Instant::now();
        let period = self
            .last_sampled_at
            .replace(now)
            .map_or(secs, |last| (now - last).as_secs_f64().min(secs));
        self.core.observe_step_period(step_id, period);
        for event in events {
            match event {
                SeqEvent::Token { seq_id, token } => {
                    let logprobs = logprobs_of.get_mut(&seq_id).and_then(VecDeque::pop_front);
                    self.on_token(seq_id, token, logprobs.unwrap_or_default());
                }
                SeqEvent::Finished { seq_id, reason } => self.finish(seq_id, reason),
            }
        }
    }

    /// The step's counters: decode or prefill tokens and time, rows the host sampled,
    /// speculative rows and their drafts accepted by position.
    fn count_sampled(&mut self, planned: &Step, step: &SampledStep) {
        let plan_rows = || planned.rows.iter().map(|r| &r.plan);
        let s = &mut self.status;
        let num_tokens: usize = plan_rows().map(|r| r.num_tokens()).sum();
        if plan_rows().all(|r| r.num_tokens() == 1 + r.num_draft_tokens) {
            // A decode step: the tokens it yields (a verify row's accepted drafts count).
            let num_yielded: usize = step.rows.iter().map(|r| r.tokens.len()).sum();
            s.num_decode_tokens += num_yielded as u64;
            s.decode_secs += step.elapsed_secs;
        } else {
            s.num_prefill_tokens += num_tokens as u64;
            s.prefill_secs += step.elapsed_secs;
        }
        for (row, sampled) in plan_rows().filter(|r| r.sample).zip(&step.rows) {
            s.num_host_sampled_rows += sampled.host_sampled as u64;
            if row.num_draft_tokens > 0 {
                s.num_spec_verified_tokens += row.num_draft_tokens as u64;
                s.num_spec_verify_rows += 1;
                let num_accepted = sampled.tokens.len().saturating_sub(1);
                s.num_spec_accepted_tokens += num_accepted as u64;
                for i in 0..row.num_draft_tokens.min(MAX_SPEC_POSITIONS) {
                    s.spec_verified_by_position[i] += 1;
                    s.spec_accepted_by_position[i] += (i < num_accepted) as u64;
                }
            }
        }
    }

    /// A token the core accepted for `seq_id`: appended, sent to its caller with its
    /// logprobs, and the request's other completions forked once its first token is out.
    fn on_token(&mut self, seq_id: SeqId, token: u32, (logprob, top): TokenLogprobs) {
        let Some(r) = self.requests.get_mut(&seq_id) else {
            return;
        };
        Shared::make_mut(&mut r.token_ids).push(token);
        let with_top = r.params.num_top_logprobs > 0;
        let out = RequestOutput {
            prompt_logprobs: r.take_scores(),
            request_id: request_id_of(seq_id),
            index: r.index,
            token_ids: vec![token],
            token_logprobs: vec![logprob],
            top_logprobs: if with_top { vec![top] } else { Vec::new() },
            ..Default::default()
        };
        self.emit(seq_id, out);
        // Only while the request is still wanted: `emit` aborts it when the caller has
        // gone.
        if let Some(r) = self.requests.get_mut(&seq_id) {
            let forks = std::mem::take(&mut r.pending_forks);
            self.start_forks(forks);
        }
    }
}

impl From<SampledStep> for SchedulerMsg {
    fn from(step: SampledStep) -> Self {
        SchedulerMsg::StepSampled(step)
    }
}

/// Lets the sampler hold the scheduler as a `DerivedActorRef<SampledStep>` (it knows the
/// step contract, not the scheduler's messages).
impl TryFrom<SchedulerMsg> for SampledStep {
    type Error = ();

    fn try_from(msg: SchedulerMsg) -> Result<Self, ()> {
        match msg {
            SchedulerMsg::StepSampled(step) => Ok(step),
            _ => Err(()),
        }
    }
}
