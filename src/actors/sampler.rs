//! The sampler actor: turns a step's logits into tokens, each row with its own request's
//! parameters, history and seed, publishes them to the rank's `SampledTokens` (for ZOS)
//! and reports them to the scheduler.

use crate::sync::Shared;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, DerivedActorRef};

use crate::runner::fault::FaultPlan;
use crate::runner::sampled_tokens::SampledTokens;
use crate::step::{SampledStep, Step, StepLogits, StepSampler, score_rows};

pub enum SamplerMsg {
    Sample {
        step: Shared<Step>,
        logits: Shared<StepLogits>,
        vocab_size: usize,
        started: Instant,
        /// The worker's idle time before this step (waiting for work or for ZOS tokens).
        idle_secs: f64,
        /// The device's idle time before this step on its own timeline (CUDA events).
        device_idle_secs: Option<f64>,
    },
}

pub struct SamplerArgs {
    /// The scheduler, as far as the sampler sees it: where sampled steps go.
    pub scheduler: DerivedActorRef<SampledStep>,
    pub sampled: SampledTokens,
    pub faults: FaultPlan,
}

pub struct SamplerState {
    scheduler: DerivedActorRef<SampledStep>,
    faults: FaultPlan,
    sampled: SampledTokens,
    core: StepSampler,
}

pub struct SamplerActor;

impl ractor::Message for SamplerMsg {}

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
            faults: args.faults,
            sampled: args.sampled,
            core: StepSampler::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SamplerMsg>,
        msg: SamplerMsg,
        st: &mut SamplerState,
    ) -> Result<(), ActorProcessingErr> {
        let SamplerMsg::Sample {
            step,
            logits,
            vocab_size,
            started,
            idle_secs,
            device_idle_secs,
        } = msg;
        let (epoch, step_id) = (step.epoch, step.step_id);
        let faults = st.faults.clone();
        let out = st.core.sample(&step, &logits, vocab_size, &mut || {
            faults.take_verify_panic()
        })?;
        tracing::debug!(
            step = step_id,
            rows = out.per_row.len(),
            "sampled tokens published"
        );
        st.sampled.publish(epoch, step_id, out.per_row);
        let scored = score_rows(&step, &logits, vocab_size)?;
        st.scheduler
            .send_message(SampledStep {
                epoch,
                step_id,
                rows: out.rows,
                scored,
                elapsed_secs: started.elapsed().as_secs_f64(),
                worker_idle_secs: idle_secs,
                device_idle_secs,
                moe_balance: logits.moe_balance,
            })
            .map_err(|_| "the scheduler is gone")?;
        for (c, history) in out.advances {
            c.advance(history);
        }
        Ok(())
    }
}
