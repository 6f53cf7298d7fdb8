//! The sampler actor: turns a step's logits into tokens, each row with its own request's
//! parameters and seed, publishes them to the rank's `SampledTokens` (for ZOS) and reports
//! them to the scheduler.

use std::sync::Arc as StdArc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::sampled_tokens::SampledTokens;
use super::scheduler::SchedulerMsg;
use crate::sampling::{Sampler as RowSampler, SamplingParams, top_logprobs};

/// How to sample one plan row.
#[derive(Debug, Clone)]
pub struct RowSampling {
    pub params: SamplingParams,
    /// Position of the token being sampled in its sequence: with the seed, the whole of
    /// what the draw depends on.
    pub position: u64,
}

pub enum SamplerMsg {
    Sample {
        epoch: u64,
        step_id: u64,
        /// `[rows, vocab]`: the logits of each row's last token.
        logits: StdArc<Vec<f32>>,
        vocab_size: usize,
        sampling: StdArc<Vec<Option<RowSampling>>>,
        started: Instant,
        /// The worker's idle time before this step (waiting for work or for ZOS tokens).
        idle_secs: f64,
    },
}

pub struct SamplerArgs {
    pub scheduler: ActorRef<SchedulerMsg>,
    pub sampled: SampledTokens,
}

pub struct SamplerState {
    scheduler: ActorRef<SchedulerMsg>,
    sampled: SampledTokens,
    sampler: RowSampler,
}

pub struct SamplerActor;

impl Actor for SamplerActor {
    type Msg = SamplerMsg;
    type State = SamplerState;
    type Arguments = SamplerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SamplerMsg>,
        args: SamplerArgs,
    ) -> Result<SamplerState, ActorProcessingErr> {
        Ok(SamplerState {
            scheduler: args.scheduler,
            sampled: args.sampled,
            sampler: RowSampler::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SamplerMsg>,
        msg: SamplerMsg,
        st: &mut SamplerState,
    ) -> Result<(), ActorProcessingErr> {
        let SamplerMsg::Sample {
            epoch,
            step_id,
            logits,
            vocab_size,
            sampling,
            started,
            idle_secs,
        } = msg;
        let mut per_row = Vec::with_capacity(sampling.len());
        let mut tokens = Vec::new();
        let mut logprobs = Vec::new();
        for (row, s) in sampling.iter().enumerate() {
            let Some(s) = s else {
                per_row.push(None);
                continue;
            };
            let row_logits = &logits[row * vocab_size..(row + 1) * vocab_size];
            let token = st.sampler.sample(row_logits, &s.params, s.position);
            per_row.push(Some(token));
            tokens.push(token);
            logprobs.push(top_logprobs(row_logits, s.params.num_top_logprobs));
        }
        st.sampled.publish(epoch, step_id, per_row);
        st.scheduler.cast(SchedulerMsg::StepSampled {
            epoch,
            step_id,
            tokens,
            top_logprobs: logprobs,
            elapsed_secs: started.elapsed().as_secs_f64(),
            worker_idle_secs: idle_secs,
        })?;
        Ok(())
    }
}
