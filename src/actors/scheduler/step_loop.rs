//! The engine's step, as the scheduler drives it: plan a step, launch it on every rank
//! (whose readback hands its logits to the sampler), and, when the sampler reports,
//! postprocess it (`sampled.rs`). With zero-overhead scheduling two steps are in flight:
//! step N+1 is planned and launched while N still runs, before N's tokens are known; its
//! rows that continue N say so in the step's `RemapTable`, and each rank finds those
//! tokens where N left them (`runner::inputs`). That one-step lag is the whole of ZOS.

use ractor::ActorRef;

use super::SchedulerState;
use crate::actors::rank_worker::RankMsg;
use crate::actors::sampler::SamplerMsg;
use crate::sched::{PlannedRow, RowInput, SeqEvent, StepPlan};
use crate::step::{PromptScore, RowSampling, Step};
use crate::sync::Shared;

impl SchedulerState {
    /// Plans and launches steps while the pipeline has room: one step in flight without
    /// ZOS, two with it (step N runs while N+1 is planned and queued behind it).
    pub(super) fn kick(&mut self) {
        let Some(sampler) = self.sampler.clone() else {
            return;
        };
        if self.workers.is_empty() {
            return;
        }
        let depth = if self.zos { 2 } else { 1 };
        while self.failed.is_none() && self.in_flight.len() < depth {
            let Some(step) = self.plan_step() else {
                break;
            };
            self.launch(step, &sampler);
        }
        self.answer_drains();
    }

    /// The core's next plan as the step every rank runs: each row with how it is sampled
    /// and whether its prompt is scored. `None`: nothing to run.
    fn plan_step(&mut self) -> Option<Step> {
        self.send_kv_saves();
        let plan = self.core.schedule();
        for event in self.core.take_events() {
            if let SeqEvent::Finished { seq_id, reason } = event {
                self.finish(seq_id, reason);
            }
        }
        self.log_preemptions();
        let plan = plan?;
        self.trace_rows(&plan);
        let sampling: Vec<Option<RowSampling>> =
            plan.rows.iter().map(|row| self.row_sampling(row)).collect();
        let scores: Vec<Option<PromptScore>> = plan
            .rows
            .iter()
            .map(|row| self.requests.get(&row.seq_id)?.score(row))
            .collect();
        let mut step = Step::new(self.epoch, plan, sampling);
        for (row, score) in step.rows.iter_mut().zip(scores) {
            row.score = score;
            row.images = self
                .requests
                .get(&row.plan.seq_id)
                .and_then(|r| r.images.clone());
        }
        Some(step)
    }

    /// Sends `step` to every rank; the leader's readback hands its logits to `sampler`.
    fn launch(&mut self, step: Step, sampler: &ActorRef<SamplerMsg>) {
        let step = Shared::new(step);
        self.in_flight.push_back(step.clone());
        self.status.num_steps += 1;
        // Every rank runs the same step; a dead one loses it and the supervisor's
        // rebuild resets the core.
        for worker in &self.workers {
            let _ = worker.cast(RankMsg::Step {
                step: step.clone(),
                sampler: sampler.clone(),
            });
        }
    }

    /// Each row's request learns it runs (its first step admits it).
    fn trace_rows(&mut self, plan: &StepPlan) {
        let step_id = self.status.num_steps;
        for row in &plan.rows {
            if let Some(r) = self.requests.get_mut(&row.seq_id) {
                let _in = r.span.enter();
                if !r.started {
                    r.started = true;
                    tracing::debug!(index = r.index, "admitted to the running batch");
                }
                tracing::trace!(
                    step = step_id,
                    tokens = row.num_tokens(),
                    cached = row.num_cached_tokens,
                    "in step"
                );
            }
        }
    }

    /// How `row`'s next token is drawn (`None`: a row nobody samples).
    fn row_sampling(&self, row: &PlannedRow) -> Option<RowSampling> {
        let r = self.requests.get(&row.seq_id)?;
        if !row.sample {
            return None;
        }
        // A ZOS row's token from the step before is generated but not yet known.
        let continues = matches!(row.input, RowInput::FromPrevious { .. });
        let num_generated = r.token_ids.len() + continues as usize;
        let banned_ids = if num_generated < r.request.min_tokens {
            r.stop_ids.clone()
        } else {
            self.no_ids.clone()
        };
        let drafts = match &row.input {
            RowInput::Tokens(ids) => ids[ids.len() - row.num_draft_tokens..].to_vec(),
            RowInput::FromPrevious { drafts, .. } => drafts.clone(),
        };
        Some(RowSampling {
            params: r.params.clone(),
            // The first token sampled follows the row's last known token.
            position: (row.num_cached_tokens + row.num_tokens() - row.num_draft_tokens) as u64,
            prompt_ids: r.prompt_ids.clone(),
            output_ids: r.token_ids.clone(),
            banned_ids,
            constraint: r.constraint.clone(),
            rejection: self.rejection_acceptance && !drafts.is_empty(),
            drafts,
            stop_ids: r.stop_ids.clone(),
            min_tokens: r.request.min_tokens,
        })
    }
}
