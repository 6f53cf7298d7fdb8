//! The sampler actor: turns a step's logits into tokens, each row with its own request's
//! parameters, history and seed, publishes them to the rank's `SampledTokens` (for ZOS)
//! and reports them to the scheduler.

use std::sync::Arc as StdArc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::fault::FaultPlan;
use super::sampled_tokens::SampledTokens;
use super::scheduler::SchedulerMsg;
use crate::sampling::{SampleContext, Sampler as RowSampler, SamplingParams};
use crate::spec::TargetDistribution;
use crate::spec::verify::{self, History};
use crate::structured::SeqConstraint;

/// How to sample one plan row.
#[derive(Debug, Clone)]
pub struct RowSampling {
    /// The request's parameters, its seed resolved.
    pub params: StdArc<SamplingParams>,
    /// Position of the token being sampled in its sequence: with the seed, the whole of
    /// what the draw depends on.
    pub position: u64,
    pub prompt_ids: StdArc<[u32]>,
    /// Generated tokens the scheduler knew when it planned the step.
    pub output_ids: StdArc<Vec<u32>>,
    /// ZOS: one more generated token, the one row `prev_row` of the previous step drew.
    pub pending_prev_row: Option<usize>,
    /// Ids that may not be drawn now (stop ids while under `min_tokens`).
    pub banned_ids: StdArc<[u32]>,
    /// Structured output: the grammar that masks this row.
    pub constraint: Option<StdArc<SeqConstraint>>,
    /// Drafts this row verifies (the last of its input tokens; its logits come with one
    /// row per draft and one after). Empty: one token, sampled as usual.
    pub drafts: Vec<u32>,
    /// A verify row's later positions ban these while fewer than `min_tokens` tokens were
    /// generated (`banned_ids` holds the first position's bans).
    pub stop_ids: StdArc<[u32]>,
    pub min_tokens: usize,
    /// Accept the drafts by rejection sampling where the row allows it (`SpecAcceptance`).
    pub rejection: bool,
}

impl RowSampling {
    /// No processors and nothing to report but the token's logprob: the rank worker can
    /// pick it where the logits lie (`Backend::pick_rows`), and only the pick crosses to
    /// the host.
    pub fn is_plain(&self) -> bool {
        self.drafts.is_empty() && self.is_plain_but_drafts()
    }

    /// `is_plain`, drafts aside: the sampler's distribution at every position is the raw
    /// logits' after temperature and the cuts.
    /// A greedy row verifying drafts with nothing to apply at any position (no processors,
    /// no stop-id ban under `min_tokens`): the device's argmax of each of its logit rows is
    /// the sampler's token there, so verification needs the picks, not the logits.
    pub fn verifies_on_device(&self) -> bool {
        !self.drafts.is_empty()
            && self.params.is_greedy()
            && self.is_plain_but_drafts()
            && self.pending_prev_row.is_none()
            && self.output_ids.len() >= self.min_tokens
    }

    pub fn is_plain_but_drafts(&self) -> bool {
        let p = &self.params;
        p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.num_top_logprobs == 0
            && !p.raw_logprobs
            && self.banned_ids.is_empty()
            && self.constraint.is_none()
    }
}

/// A step's logits as they reach the sampler: picks made on the device, and the host
/// copies of the rows still to be sampled here.
#[derive(Debug, Default)]
pub struct StepLogits {
    /// Per plan row: the device's greedy pick and its logprob.
    pub picked: Vec<Option<(u32, f32)>>,
    /// Per plan row verifying on the device: the greedy pick (and logprob) of each of its
    /// logit rows, the draft positions' and the one after.
    pub verify_picks: Vec<Option<Vec<(u32, f32)>>>,
    /// Per plan row: its row in `host`.
    pub host_row: Vec<Option<usize>>,
    /// `[host rows, vocab]`.
    pub host: Vec<f32>,
    /// Per plan row whose drafts a draft model filled in (`--spec draft`): the drafts and
    /// the draft model's probability of each; the row's `RowSampling::drafts` were
    /// placeholders.
    pub model_drafts: Vec<Option<Vec<(u32, f32)>>>,
}

pub enum SamplerMsg {
    Sample {
        epoch: u64,
        step_id: u64,
        logits: StdArc<StepLogits>,
        vocab_size: usize,
        sampling: StdArc<Vec<Option<RowSampling>>>,
        started: Instant,
        /// The worker's idle time before this step (waiting for work or for ZOS tokens).
        idle_secs: f64,
        /// The device's idle time before this step on its own timeline (CUDA events).
        device_idle_secs: Option<f64>,
    },
}

pub struct SamplerArgs {
    pub scheduler: ActorRef<SchedulerMsg>,
    pub sampled: SampledTokens,
    pub faults: FaultPlan,
}

pub struct SamplerState {
    scheduler: ActorRef<SchedulerMsg>,
    faults: FaultPlan,
    sampled: SampledTokens,
    sampler: RowSampler,
    /// The previous step's tokens by row, for the histories of ZOS rows.
    last_step: Option<(u64, u64, Vec<Option<u32>>)>,
    history: Vec<u32>,
    /// A constrained row's logits, masked.
    masked: Vec<f32>,
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
            faults: args.faults,
            sampled: args.sampled,
            sampler: RowSampler::default(),
            last_step: None,
            history: Vec::new(),
            masked: Vec::new(),
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
            device_idle_secs,
        } = msg;
        let mut per_row = Vec::with_capacity(sampling.len());
        let (mut tokens, mut token_logprobs, mut top_logprobs) =
            (Vec::new(), Vec::new(), Vec::new());
        // Per sampled row (as `tokens`): the draft model's probabilities of its drafts.
        let mut draft_probs: Vec<Vec<f32>> = Vec::new();
        // Constrained rows and their histories with the new token, advanced after the
        // tokens are out so the next masks are computed beside the next forward pass.
        let mut advances: Vec<(StdArc<SeqConstraint>, Vec<u32>)> = Vec::new();
        for (row, s) in sampling.iter().enumerate() {
            let Some(s) = s else {
                per_row.push(None);
                continue;
            };
            // A draft model's drafts, where it filled in the row's placeholders.
            let model_drafts = logits.model_drafts.get(row).and_then(Option::as_ref);
            let filled: Vec<u32>;
            let drafts: &[u32] = match model_drafts {
                Some(d) => {
                    filled = d.iter().map(|x| x.0).collect();
                    &filled
                }
                None => &s.drafts,
            };
            draft_probs
                .push(model_drafts.map_or_else(Vec::new, |d| d.iter().map(|x| x.1).collect()));
            let pending = s.pending_prev_row.and_then(|prev_row| match &st.last_step {
                Some((e, prev_step, toks)) if *e == epoch && *prev_step + 1 == step_id => {
                    toks.get(prev_row).copied().flatten()
                }
                _ => None,
            });
            let output_ids: &[u32] = match pending {
                Some(t) => {
                    st.history.clear();
                    st.history.extend_from_slice(&s.output_ids);
                    st.history.push(t);
                    &st.history
                }
                None => &s.output_ids,
            };
            let ctx = SampleContext {
                position: s.position,
                prompt_ids: &s.prompt_ids,
                output_ids,
                banned_ids: &s.banned_ids,
            };
            if let Some((token, logprob)) = logits.picked.get(row).copied().flatten() {
                per_row.push(Some(token));
                tokens.push(vec![token]);
                token_logprobs.push(vec![logprob]);
                top_logprobs.push(vec![Vec::new()]);
                continue;
            }
            if let Some(picks) = logits.verify_picks.get(row).and_then(Option::as_ref) {
                if st.faults.take_verify_panic() {
                    panic!("sampler panicked mid-verification (injected fault)");
                }
                // Greedy: the drafts that equal the argmax there, then the argmax at the
                // first mismatch (or after the last draft).
                let num_accepted = drafts
                    .iter()
                    .zip(picks)
                    .take_while(|(d, p)| **d == p.0)
                    .count();
                let emitted = &picks[..=num_accepted.min(picks.len() - 1)];
                per_row.push(emitted.last().map(|p| p.0));
                tokens.push(emitted.iter().map(|p| p.0).collect());
                token_logprobs.push(emitted.iter().map(|p| p.1).collect());
                top_logprobs.push(vec![Vec::new(); emitted.len()]);
                continue;
            }
            let Some(host_row) = logits.host_row.get(row).copied().flatten() else {
                return Err(
                    format!("step {step_id}: row {row} has neither a pick nor logits").into(),
                );
            };
            let host_rows = logits.host.len() / vocab_size.max(1);
            if host_row + drafts.len() >= host_rows {
                return Err(format!(
                    "step {step_id}: row {row} verifies {} drafts but has {} logit rows",
                    drafts.len(),
                    host_rows.saturating_sub(host_row)
                )
                .into());
            }
            if !drafts.is_empty() {
                if st.faults.take_verify_panic() {
                    panic!("sampler panicked mid-verification (injected fault)");
                }
                // Each position's token is the one this sampler draws there with the
                // accepted drafts as history: the output of speculation off.
                let rows: Vec<&[f32]> = (host_row..=host_row + drafts.len())
                    .map(|r| &logits.host[r * vocab_size..(r + 1) * vocab_size])
                    .collect();
                let mask = s.constraint.as_ref().map(|c| {
                    move |history: &[u32], logits: &mut [f32]| c.mask_logits(history, logits)
                });
                let history = History {
                    prompt_ids: &s.prompt_ids,
                    output_ids,
                    banned_ids: &s.stop_ids,
                    ban_below_len: s.min_tokens,
                    mask: mask.as_ref().map(|m| m as &verify::GrammarMask<'_>),
                };
                if s.rejection && s.is_plain_but_drafts() && output_ids.len() >= s.min_tokens {
                    // The target's distribution at each position is the sampler's (no
                    // processors apply); n-gram drafts are certain (q one-hot).
                    let targets: Vec<TargetDistribution> = rows
                        .iter()
                        .map(|r| TargetDistribution::new(r, &s.params))
                        .collect();
                    let v = verify::rejection(&targets, drafts, None, s.params.seed, s.position);
                    let lps: Vec<f32> = v
                        .tokens
                        .iter()
                        .zip(&targets)
                        .map(|(&t, d)| d.prob(t).ln() as f32)
                        .collect();
                    per_row.push(v.tokens.last().copied());
                    top_logprobs.push(vec![Vec::new(); v.tokens.len()]);
                    tokens.push(v.tokens);
                    token_logprobs.push(lps);
                    continue;
                }
                let outs = verify::with_sampler(
                    &mut st.sampler,
                    &rows,
                    drafts,
                    &s.params,
                    s.position,
                    history,
                );
                if let Some(c) = &s.constraint {
                    // The matcher saw the accepted drafts; its next mask follows the
                    // emitted tokens (rolling back anything it saw beyond them).
                    let mut history = output_ids.to_vec();
                    history.extend(outs.iter().map(|o| o.token));
                    advances.push((c.clone(), history));
                }
                per_row.push(outs.last().map(|o| o.token));
                tokens.push(outs.iter().map(|o| o.token).collect());
                token_logprobs.push(outs.iter().map(|o| o.logprob).collect());
                top_logprobs.push(outs.into_iter().map(|o| o.top_logprobs).collect());
                continue;
            }
            let row_logits = &logits.host[host_row * vocab_size..(host_row + 1) * vocab_size];
            let row_logits = match &s.constraint {
                Some(c) => {
                    st.masked.clear();
                    st.masked.extend_from_slice(row_logits);
                    c.mask_logits(output_ids, &mut st.masked);
                    &st.masked[..]
                }
                None => row_logits,
            };
            let out = st.sampler.sample_row(row_logits, &s.params, &ctx);
            if let Some(c) = &s.constraint {
                let mut history = output_ids.to_vec();
                history.push(out.token);
                advances.push((c.clone(), history));
            }
            per_row.push(Some(out.token));
            tokens.push(vec![out.token]);
            token_logprobs.push(vec![out.logprob]);
            top_logprobs.push(vec![out.top_logprobs]);
        }
        tracing::debug!(
            step = step_id,
            rows = per_row.len(),
            "sampled tokens published"
        );
        st.sampled.publish(epoch, step_id, per_row.clone());
        st.last_step = Some((epoch, step_id, per_row));
        st.scheduler.cast(SchedulerMsg::StepSampled {
            epoch,
            step_id,
            tokens,
            token_logprobs,
            top_logprobs,
            draft_probs,
            elapsed_secs: started.elapsed().as_secs_f64(),
            worker_idle_secs: idle_secs,
            device_idle_secs,
        })?;
        for (c, history) in advances {
            c.advance(history);
        }
        Ok(())
    }
}
