//! Sampling one step: each row with its request's parameters, history and seed; a verify
//! row's drafts verified with the same sampler (several tokens a row), or against the
//! argmax picks the rank made on the device. The sampler actor calls it and publishes.

use crate::sampling::{SampleContext, Sampler as RowSampler, score_token};
use crate::spec::TargetDistribution;
use crate::spec::verify::{self, History};
use crate::structured::SeqConstraint;
use crate::sync::Shared as Arc;

use super::{Drawn, SampledRow, ScoredRow, Step, StepLogits};

/// A step whose logits do not match its rows: a bug upstream, which fails the sampler (its
/// supervisor restarts it and the engine recomputes).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SampleError {
    #[error("step {step_id}: row {row} has neither a pick nor logits")]
    NoLogits { step_id: u64, row: usize },
    #[error(
        "step {step_id}: row {row} verifies {num_drafts} drafts but has {num_logit_rows} logit rows"
    )]
    TooFewLogitRows {
        step_id: u64,
        row: usize,
        num_drafts: usize,
        num_logit_rows: usize,
    },
    #[error(
        "step {step_id}: row {row} scores {num_targets} prompt tokens but has {num_logit_rows} logit rows"
    )]
    TooFewScoreRows {
        step_id: u64,
        row: usize,
        num_targets: usize,
        num_logit_rows: usize,
    },
}

/// What a sampled row yielded: every token (a verify row's accepted drafts and the one
/// after them), and how many of its drafts were rejected.
type Yielded = (Vec<u32>, u32);

/// The sampler's state across steps.
#[derive(Default)]
pub struct StepSampler {
    sampler: RowSampler,
    /// The previous step's tokens by row (all a verify row yielded) and its rejected
    /// drafts, for the histories and positions of ZOS rows.
    last_step: Option<(u64, u64, Vec<Option<Yielded>>)>,
    history: Vec<u32>,
    /// A constrained row's logits, masked.
    masked: Vec<f32>,
}

/// One step's outcome.
pub struct StepOutcome {
    /// Per sampled row, in plan-row order.
    pub rows: Vec<SampledRow>,
    /// Per plan row: what it drew (what a ZOS row of the next step reads).
    pub per_row: Vec<Option<Drawn>>,
    /// Constrained rows and their histories with the new tokens: advanced once the tokens
    /// are out, so the next masks are computed beside the next forward pass.
    pub advances: Vec<(Arc<SeqConstraint>, Vec<u32>)>,
}

impl StepSampler {
    /// Samples `step`'s rows; `verify_fault` is asked before each verification (the
    /// fault-injection tests panic there).
    pub fn sample(
        &mut self,
        step: &Step,
        logits: &StepLogits,
        vocab_size: usize,
        verify_fault: &mut dyn FnMut() -> bool,
    ) -> Result<StepOutcome, SampleError> {
        let (epoch, step_id, rows) = (step.epoch, step.step_id, &step.rows);
        // Per plan row: every token it yielded, and its rejected drafts.
        let mut yielded: Vec<Option<Yielded>> = Vec::with_capacity(rows.len());
        let (mut tokens, mut token_logprobs, mut top_logprobs) =
            (Vec::new(), Vec::new(), Vec::new());
        // Per sampled row (as `tokens`): the draft model's probabilities of its drafts.
        let mut draft_probs: Vec<Vec<f32>> = Vec::new();
        // Per sampled row: whether its logits crossed to the host (no pick on the device).
        let mut host_sampled: Vec<bool> = Vec::new();
        // Constrained rows and their histories with the new token, advanced after the
        // tokens are out so the next masks are computed beside the next forward pass.
        let mut advances: Vec<(Arc<SeqConstraint>, Vec<u32>)> = Vec::new();
        for (row, s) in rows.iter().map(|r| r.sampling.as_ref()).enumerate() {
            let Some(s) = s else {
                yielded.push(None);
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
            host_sampled.push(
                logits.picked.get(row).is_none_or(Option::is_none)
                    && logits.verify_picks.get(row).is_none_or(Option::is_none),
            );
            draft_probs
                .push(model_drafts.map_or_else(Vec::new, |d| d.iter().map(|x| x.1).collect()));
            // ZOS: the tokens the remapped row of the previous step drew (the scheduler did
            // not know them when it planned this row, nor, after a verify row, how many
            // drafts it rejected: this row's position moves back by as many).
            let pending = step.remap.source(row).and_then(|m| match &self.last_step {
                Some((e, prev_step, prev)) if *e == epoch && *prev_step == m.prev_step => {
                    prev.get(m.prev_row).and_then(Option::as_ref)
                }
                _ => None,
            });
            let output_ids: &[u32] = match pending {
                Some((t, _)) => {
                    self.history.clear();
                    self.history.extend_from_slice(&s.output_ids);
                    self.history.extend_from_slice(t);
                    &self.history
                }
                None => &s.output_ids,
            };
            let position = s.position - pending.map_or(0, |p| p.1 as u64);
            // The scheduler counted the fewest tokens the continued row may yield.
            let banned_ids: &[u32] = match pending {
                Some(_) if output_ids.len() >= s.min_tokens => &[],
                Some(_) => &s.stop_ids,
                None => &s.banned_ids,
            };
            let ctx = SampleContext {
                position,
                prompt_ids: &s.prompt_ids,
                output_ids,
                banned_ids,
            };
            if let Some((token, logprob)) = logits.picked.get(row).copied().flatten() {
                yielded.push(Some((vec![token], 0)));
                tokens.push(vec![token]);
                token_logprobs.push(vec![logprob]);
                top_logprobs.push(vec![Vec::new()]);
                continue;
            }
            if let Some(picks) = logits.verify_picks.get(row).and_then(Option::as_ref) {
                if verify_fault() {
                    panic!("sampler panicked mid-verification (injected fault)");
                }
                // The drafts that equal the pick there (the argmax, or the seeded draw),
                // then the pick at the first mismatch (or after the last draft).
                let num_accepted = verify::num_accepted_by_picks(drafts, picks.iter().map(|p| p.0));
                let emitted = &picks[..=num_accepted.min(picks.len() - 1)];
                yielded.push(Some((
                    emitted.iter().map(|p| p.0).collect(),
                    (drafts.len() + 1 - emitted.len()) as u32,
                )));
                tokens.push(emitted.iter().map(|p| p.0).collect());
                token_logprobs.push(emitted.iter().map(|p| p.1).collect());
                top_logprobs.push(vec![Vec::new(); emitted.len()]);
                continue;
            }
            let Some(host_row) = logits.host_row.get(row).copied().flatten() else {
                return Err(SampleError::NoLogits { step_id, row });
            };
            let host_rows = logits.host.len() / vocab_size.max(1);
            if host_row + drafts.len() >= host_rows {
                return Err(SampleError::TooFewLogitRows {
                    step_id,
                    row,
                    num_drafts: drafts.len(),
                    num_logit_rows: host_rows.saturating_sub(host_row),
                });
            }
            if !drafts.is_empty() {
                if verify_fault() {
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
                    let v = verify::rejection(&targets, drafts, None, s.params.seed, position);
                    let lps: Vec<f32> = v
                        .tokens
                        .iter()
                        .zip(&targets)
                        .map(|(&t, d)| d.prob(t).ln() as f32)
                        .collect();
                    yielded.push(Some((
                        v.tokens.clone(),
                        (drafts.len() + 1 - v.tokens.len()) as u32,
                    )));
                    top_logprobs.push(vec![Vec::new(); v.tokens.len()]);
                    tokens.push(v.tokens);
                    token_logprobs.push(lps);
                    continue;
                }
                let outs = verify::with_sampler(
                    &mut self.sampler,
                    &rows,
                    drafts,
                    &s.params,
                    position,
                    history,
                );
                if let Some(c) = &s.constraint {
                    // The matcher saw the accepted drafts; its next mask follows the
                    // emitted tokens (rolling back anything it saw beyond them).
                    let mut history = output_ids.to_vec();
                    history.extend(outs.iter().map(|o| o.token));
                    advances.push((c.clone(), history));
                }
                yielded.push(Some((
                    outs.iter().map(|o| o.token).collect(),
                    (drafts.len() + 1 - outs.len()) as u32,
                )));
                tokens.push(outs.iter().map(|o| o.token).collect());
                token_logprobs.push(outs.iter().map(|o| o.logprob).collect());
                top_logprobs.push(outs.into_iter().map(|o| o.top_logprobs).collect());
                continue;
            }
            let row_logits = &logits.host[host_row * vocab_size..(host_row + 1) * vocab_size];
            let row_logits = match &s.constraint {
                Some(c) => {
                    self.masked.clear();
                    self.masked.extend_from_slice(row_logits);
                    c.mask_logits(output_ids, &mut self.masked);
                    &self.masked[..]
                }
                None => row_logits,
            };
            let out = self.sampler.sample_row(row_logits, &s.params, &ctx);
            if let Some(c) = &s.constraint {
                let mut history = output_ids.to_vec();
                history.push(out.token);
                advances.push((c.clone(), history));
            }
            yielded.push(Some((vec![out.token], 0)));
            tokens.push(vec![out.token]);
            token_logprobs.push(vec![out.logprob]);
            top_logprobs.push(vec![out.top_logprobs]);
        }
        let per_row = yielded
            .iter()
            .map(|y| {
                y.as_ref().map(|(tokens, num_rejected)| Drawn {
                    token: *tokens.last().expect("a sampled row yields a token"),
                    num_rejected: *num_rejected,
                })
            })
            .collect();
        self.last_step = Some((epoch, step_id, yielded));
        let rows = tokens
            .into_iter()
            .zip(token_logprobs)
            .zip(top_logprobs)
            .zip(draft_probs)
            .zip(host_sampled)
            .map(
                |((((tokens, token_logprobs), top_logprobs), draft_probs), host_sampled)| {
                    SampledRow {
                        tokens,
                        token_logprobs,
                        top_logprobs,
                        draft_probs,
                        host_sampled,
                    }
                },
            )
            .collect();
        Ok(StepOutcome {
            rows,
            per_row,
            advances,
        })
    }
}

/// The prompt tokens of `step`'s scored rows, each under the raw logits of the position
/// before it. The sampler runs it after publishing the step's tokens: the next step's
/// continuing rows wait for those, not for this.
pub fn score_rows(
    step: &Step,
    logits: &StepLogits,
    vocab_size: usize,
) -> Result<Vec<ScoredRow>, SampleError> {
    let host_rows = logits.host.len() / vocab_size.max(1);
    let mut scored = Vec::new();
    for (row, score) in step.rows.iter().enumerate() {
        let Some(score) = &score.score else {
            continue;
        };
        let Some(first) = logits.score_row.get(row).copied().flatten() else {
            return Err(SampleError::NoLogits {
                step_id: step.step_id,
                row,
            });
        };
        if first + score.targets.len() > host_rows {
            return Err(SampleError::TooFewScoreRows {
                step_id: step.step_id,
                row,
                num_targets: score.targets.len(),
                num_logit_rows: host_rows.saturating_sub(first),
            });
        }
        let tokens = score
            .targets
            .iter()
            .enumerate()
            .map(|(i, &target)| {
                let r = first + i;
                let row_logits = &logits.host[r * vocab_size..(r + 1) * vocab_size];
                score_token(row_logits, target, score.num_top)
            })
            .collect();
        scored.push(ScoredRow {
            row,
            first_position: score.first_position,
            tokens,
        });
    }
    Ok(scored)
}
