//! The step contract: what one step asks of the sampler (each row's `RowSampling`), what
//! the rank hands it (`StepLogits`) and what it reports back (`SampledStep`, one
//! `SampledRow` per sampled row). The scheduler actor builds the rows, the rank fills the
//! logits, the sampler (`sample::StepSampler`) turns them into tokens.

mod sample;

use crate::sync::Shared as Arc;

pub use sample::StepSampler;

use crate::sampling::SamplingParams;
use crate::structured::SeqConstraint;

/// How to sample one plan row.
#[derive(Debug, Clone)]
pub struct RowSampling {
    /// The request's parameters, its seed resolved.
    pub params: Arc<SamplingParams>,
    /// Position of the token being sampled in its sequence: with the seed, the whole of
    /// what the draw depends on.
    pub position: u64,
    pub prompt_ids: Arc<[u32]>,
    /// Generated tokens the scheduler knew when it planned the step.
    pub output_ids: Arc<Vec<u32>>,
    /// ZOS: one more generated token, the one row `prev_row` of the previous step drew.
    pub pending_prev_row: Option<usize>,
    /// Ids that may not be drawn now (stop ids while under `min_tokens`).
    pub banned_ids: Arc<[u32]>,
    /// Structured output: the grammar that masks this row.
    pub constraint: Option<Arc<SeqConstraint>>,
    /// Drafts this row verifies (the last of its input tokens; its logits come with one
    /// row per draft and one after). Empty: one token, sampled as usual.
    pub drafts: Vec<u32>,
    /// A verify row's later positions ban these while fewer than `min_tokens` tokens were
    /// generated (`banned_ids` holds the first position's bans).
    pub stop_ids: Arc<[u32]>,
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

/// What a sampled row yields: one token, or a verify row's accepted drafts and the token
/// after them, with their logprobs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampledRow {
    pub tokens: Vec<u32>,
    /// Per token: its log-probability under the distribution it was sampled from.
    pub token_logprobs: Vec<f32>,
    /// Per token: the most likely `(id, logprob)` pairs (empty unless asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The draft model's probabilities of the drafts this row verified (`--spec draft`).
    pub draft_probs: Vec<f32>,
}

/// A step's sampled rows, in plan-row order (rows without sampling left out), as the
/// sampler reports them to the scheduler.
#[derive(Debug, Clone)]
pub struct SampledStep {
    pub epoch: u64,
    pub step_id: u64,
    pub rows: Vec<SampledRow>,
    pub elapsed_secs: f64,
    /// The worker's idle time before this step (waiting for work or for ZOS tokens).
    pub worker_idle_secs: f64,
    /// The device's idle time before this step on its own timeline (CUDA events).
    pub device_idle_secs: Option<f64>,
}
