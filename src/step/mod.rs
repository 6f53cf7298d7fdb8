//! The step contract: the one message a step is (`Step`: a `StepRow` per row, the plan row
//! and its sampling together, and the ZOS `RemapTable`), what the rank hands the sampler
//! (`StepLogits`) and what the sampler reports back (`SampledStep`, one `SampledRow` per
//! sampled row). The scheduler actor builds the step, every rank applies it, the sampler
//! (`sample::StepSampler`) turns its logits into tokens.

mod image;
mod sample;

use crate::sync::Shared as Arc;

pub use image::{PromptImage, VIRTUAL_ID_BASE, is_virtual, with_virtual_ids};
pub use sample::{SampleError, StepSampler, score_rows};

use crate::eplb::MoeBalance;
use crate::sampling::{SamplingParams, ScoredToken};
use crate::sched::{KvLoad, PlannedRow, RowInput, StateImport, StateLoad, StateSave, StepPlan};
use crate::structured::SeqConstraint;

/// One step, as it travels from the scheduler to every rank and on to the sampler.
#[derive(Debug, Clone)]
pub struct Step {
    /// The engine's reset count when it was planned: a step of an older epoch is void.
    pub epoch: u64,
    pub step_id: u64,
    pub rows: Vec<StepRow>,
    /// Which rows take their input token from which row of the previous step's output
    /// (zero-overhead scheduling); empty without ZOS.
    pub remap: RemapTable,
    /// Prefix-store blocks the rank fills before the rows run (`StepPlan::kv_loads`).
    pub kv_loads: Vec<KvLoad>,
    /// Saved states put into slots before the rows run (`StepPlan::state_loads`).
    pub state_loads: Vec<StateLoad>,
    /// Stored states put into slots before the rows run (`StepPlan::state_imports`).
    pub state_imports: Vec<StateImport>,
    /// Slots saved after the rows ran (`StepPlan::state_saves`).
    pub state_saves: Vec<StateSave>,
}

/// One row of a step: what the model computes and how its next token is drawn.
#[derive(Debug, Clone)]
pub struct StepRow {
    pub plan: PlannedRow,
    /// `None`: a row whose logits nobody samples (a prefill chunk before the prompt's end).
    pub sampling: Option<RowSampling>,
    /// A prefill row of a prompt being scored (prompt logprobs).
    pub score: Option<PromptScore>,
    /// The sequence's images, where it has any: its rows name their placeholders by
    /// virtual ids (`image.rs`), and every position after an image moves with it.
    pub images: Option<Arc<[PromptImage]>>,
}

/// A prefill row whose prompt tokens are scored: the model returns a logit row for every
/// input token, and the first `targets.len()` of them score the prompt token after each
/// (a sampling row's own rows are its last ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptScore {
    /// The prompt position of the row's first input token: its logits score the token at
    /// `first_position + 1`.
    pub first_position: usize,
    pub targets: Vec<u32>,
    /// How many of the most likely ids to report at each position.
    pub num_top: usize,
}

/// A scored row's prompt tokens (`PromptScore`), as the sampler reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredRow {
    /// Its plan row.
    pub row: usize,
    pub first_position: usize,
    pub tokens: Vec<ScoredToken>,
}

/// Rows whose input is a token the previous step draws: known on the device, or to the
/// sampler, only after this step was planned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemapTable {
    entries: Vec<Remap>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remap {
    /// This step's row.
    pub row: usize,
    pub prev_step: u64,
    /// The row of `prev_step` whose drawn token is this row's input.
    pub prev_row: usize,
}

impl RemapTable {
    /// The table of `rows`: each row planned as a continuation of the previous step.
    pub fn of_rows<'a>(rows: impl Iterator<Item = &'a PlannedRow>) -> Self {
        let entries = rows
            .enumerate()
            .filter_map(|(row, r)| match r.input {
                RowInput::FromPrevious {
                    prev_step,
                    prev_row,
                    ..
                } => Some(Remap {
                    row,
                    prev_step,
                    prev_row,
                }),
                RowInput::Tokens(_) => None,
            })
            .collect();
        RemapTable { entries }
    }

    pub fn entries(&self) -> &[Remap] {
        &self.entries
    }

    /// Where row `row`'s input comes from, if it is remapped.
    pub fn source(&self, row: usize) -> Option<&Remap> {
        // Rows are in order: a binary search by row.
        self.entries
            .binary_search_by_key(&row, |r| r.row)
            .ok()
            .map(|i| &self.entries[i])
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Step {
    /// A planned step with each row's sampling (`sampling[i]` for `plan.rows[i]`).
    pub fn new(epoch: u64, plan: StepPlan, sampling: Vec<Option<RowSampling>>) -> Self {
        debug_assert_eq!(plan.rows.len(), sampling.len());
        let remap = RemapTable::of_rows(plan.rows.iter());
        let rows = plan
            .rows
            .into_iter()
            .zip(sampling)
            .map(|(plan, sampling)| StepRow {
                plan,
                sampling,
                score: None,
                images: None,
            })
            .collect();
        Step {
            epoch,
            step_id: plan.step_id,
            rows,
            remap,
            kv_loads: plan.kv_loads,
            state_loads: plan.state_loads,
            state_imports: plan.state_imports,
            state_saves: plan.state_saves,
        }
    }
}

/// What a row of a step drew, as a row continuing it in the next step needs it: the last
/// token, and how many of the row's drafts were rejected (the continuing row was planned
/// as if none were, and moves back by as many positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drawn {
    pub token: u32,
    pub num_rejected: u32,
}

impl Drawn {
    /// A row without drafts: one token.
    pub fn token(token: u32) -> Self {
        Drawn {
            token,
            num_rejected: 0,
        }
    }
}

/// How to sample one plan row.
#[derive(Debug, Clone)]
pub struct RowSampling {
    /// The request's parameters, its seed resolved.
    pub params: Arc<SamplingParams>,
    /// Position of the token being sampled in its sequence: with the seed, the whole of
    /// what the draw depends on. A row continuing a verify row has this as if all of
    /// that row's drafts were accepted (`Drawn::num_rejected` less).
    pub position: u64,
    pub prompt_ids: Arc<[u32]>,
    /// Generated tokens the scheduler knew when it planned the step.
    pub output_ids: Arc<Vec<u32>>,
    /// Ids that may not be drawn now (stop ids while under `min_tokens`); for a row
    /// continuing a verify row, counted with the fewest tokens that row may yield.
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

    /// A row verifying drafts with nothing to apply at any position (no processors, no
    /// stop-id ban under `min_tokens`), greedy or — where the backend draws as the sampler
    /// does (`samples_on_device`) — sampled: the device's pick at each of its logit rows is
    /// the sampler's token there (the seeded draw keyed by position; under rejection
    /// acceptance the draft or the residual draw, `PickRow::draft`), so verification needs
    /// the picks, not the logits. (For a row continuing the previous step, `output_ids` lacks the
    /// tokens still in flight: the `min_tokens` test errs towards the host.)
    pub fn verifies_on_device(&self, samples_on_device: bool) -> bool {
        !self.drafts.is_empty()
            && (self.params.is_greedy() || samples_on_device)
            && self.is_plain_but_drafts()
            && self.output_ids.len() >= self.min_tokens
    }

    /// A row with a grammar and nothing else to apply (no processors, no stop-id ban now or,
    /// for a verify row, at a later position), where the backend draws as the sampler does:
    /// the rank masks it with the grammar's bits and the device draws it (greedy, seeded,
    /// each draft verified by the draw at its position).
    pub fn masked_on_device(&self, samples_on_device: bool) -> bool {
        samples_on_device
            && self.constraint.is_some()
            && self.params.has_no_processors()
            && self.banned_ids.is_empty()
            && (self.drafts.is_empty() || self.output_ids.len() >= self.min_tokens)
    }

    /// `is_plain`, drafts aside: the sampler's distribution at every position is the raw
    /// logits' after temperature and the cuts.
    pub fn is_plain_but_drafts(&self) -> bool {
        self.params.has_no_processors() && self.banned_ids.is_empty() && self.constraint.is_none()
    }
}

/// A step's logits as they reach the sampler: picks made on the device, and the host
/// copies of the rows still to be sampled here.
#[derive(Debug, Default)]
pub struct StepLogits {
    /// Per plan row: the device's pick (greedy, seeded, under a grammar's mask) and its
    /// logprob.
    pub picked: Vec<Option<(u32, f32)>>,
    /// Per plan row verifying on the device: the greedy pick (and logprob) of each of its
    /// logit rows, the draft positions' and the one after.
    pub verify_picks: Vec<Option<Vec<(u32, f32)>>>,
    /// Per plan row: its row in `host` (a sampling row's first own row).
    pub host_row: Vec<Option<usize>>,
    /// Per plan row with a `PromptScore`: the row in `host` of its first scoring row.
    pub score_row: Vec<Option<usize>>,
    /// `[host rows, vocab]`.
    pub host: Vec<f32>,
    /// Per plan row whose drafts a draft model filled in (`--spec draft`): the drafts and
    /// the draft model's probability of each; the row's `RowSampling::drafts` were
    /// placeholders.
    pub model_drafts: Vec<Option<Vec<(u32, f32)>>>,
    /// MoE models with EPLB: the balance after this step's routing.
    pub moe_balance: Option<MoeBalance>,
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
    /// Drawn by the host's sampler from logits copied off the device (not picked there).
    pub host_sampled: bool,
}

/// A step's sampled rows, in plan-row order (rows without sampling left out), as the
/// sampler reports them to the scheduler.
#[derive(Debug, Clone)]
pub struct SampledStep {
    pub epoch: u64,
    pub step_id: u64,
    pub rows: Vec<SampledRow>,
    /// The step's scored prompt rows.
    pub scored: Vec<ScoredRow>,
    pub elapsed_secs: f64,
    /// The worker's idle time before this step (waiting for work or for ZOS tokens).
    pub worker_idle_secs: f64,
    /// The device's idle time before this step on its own timeline (CUDA events).
    pub device_idle_secs: Option<f64>,
    /// MoE models with EPLB: the balance after this step's routing.
    pub moe_balance: Option<MoeBalance>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(input: RowInput) -> PlannedRow {
        PlannedRow {
            seq_id: 1,
            input,
            num_cached_tokens: 0,
            block_table: Vec::new(),
            state_slot: None,
            state_start: 0,
            replay_until: 0,
            sample: true,
            num_draft_tokens: 0,
        }
    }

    #[test]
    fn the_remap_table_names_exactly_the_continued_rows() {
        let rows = [
            row(RowInput::Tokens(vec![1, 2])),
            row(RowInput::FromPrevious {
                prev_step: 6,
                prev_row: 3,
                drafts: Vec::new(),
            }),
            row(RowInput::Tokens(vec![4])),
            row(RowInput::FromPrevious {
                prev_step: 6,
                prev_row: 0,
                drafts: vec![5, 6],
            }),
        ];
        let table = RemapTable::of_rows(rows.iter());
        let sources: Vec<Option<(u64, usize)>> = (0..5)
            .map(|r| table.source(r).map(|m| (m.prev_step, m.prev_row)))
            .collect();
        assert_eq!(sources, vec![None, Some((6, 3)), None, Some((6, 0)), None]);
        assert!(RemapTable::of_rows(rows[..1].iter()).is_empty());
    }
}
