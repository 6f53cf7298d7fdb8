//! Sampling one step: each row with its request's parameters, history and seed; a verify
//! row's drafts verified with the same sampler (several tokens a row), or against the
//! argmax picks the rank made on the device. The sampler actor calls it and publishes.

use crate::sampling::{SampleContext, SampleOutput, Sampler as RowSampler, score_token};
use crate::spec::TargetDistribution;
use crate::spec::verify::{self, History};
use crate::structured::SeqConstraint;
use crate::sync::Shared as Arc;

use super::{Drawn, RowSampling, SampledRow, ScoredRow, Step, StepLogits};

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

/// What one sampled row drew: every token (a verify row's accepted drafts and the one after
/// them), each one's logprob and top logprobs, and how many drafts it rejected.
struct Draw {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    num_rejected: u32,
}

impl Draw {
    /// Tokens without top logprobs: a device's picks, a rejection-sampled verify row.
    fn bare(tokens: Vec<u32>, logprobs: Vec<f32>, num_drafts: usize) -> Draw {
        Draw {
            num_rejected: (num_drafts + 1 - tokens.len()) as u32,
            top: vec![Vec::new(); tokens.len()],
            tokens,
            logprobs,
        }
    }

    fn sampled(outs: Vec<SampleOutput>, num_drafts: usize) -> Draw {
        Draw {
            num_rejected: (num_drafts + 1 - outs.len()) as u32,
            tokens: outs.iter().map(|o| o.token).collect(),
            logprobs: outs.iter().map(|o| o.logprob).collect(),
            top: outs.into_iter().map(|o| o.top_logprobs).collect(),
        }
    }
}

/// A sampled row as the host's sampler sees it: its history (with the tokens a ZOS
/// predecessor drew), its position and bans, its drafts.
struct RowView<'a> {
    s: &'a RowSampling,
    output_ids: &'a [u32],
    position: u64,
    banned_ids: &'a [u32],
    drafts: &'a [u32],
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
        let (epoch, step_id) = (step.epoch, step.step_id);
        // Per plan row: every token it yielded, and its rejected drafts.
        let mut yielded: Vec<Option<Yielded>> = Vec::with_capacity(step.rows.len());
        let mut rows = Vec::new();
        // Constrained rows and their histories with the new tokens.
        let mut advances: Vec<(Arc<SeqConstraint>, Vec<u32>)> = Vec::new();
        for (row, s) in step.rows.iter().map(|r| r.sampling.as_ref()).enumerate() {
            let Some(s) = s else {
                yielded.push(None);
                continue;
            };
            // A draft model's drafts, where it filled in the row's placeholders.
            let model_drafts = logits.model_drafts.get(row).and_then(Option::as_ref);
            let filled: Option<Vec<u32>> = model_drafts.map(|d| d.iter().map(|x| x.0).collect());
            let picked = logits.picked.get(row).copied().flatten();
            let verify_picks = logits.verify_picks.get(row).and_then(Option::as_ref);
            let draw = if let Some((token, logprob)) = picked {
                Draw::bare(vec![token], vec![logprob], 0)
            } else {
                let drafts = filled.as_deref().unwrap_or(&s.drafts);
                let row_view = view(&self.last_step, &mut self.history, step, row, s, drafts);
                if let Some(picks) = verify_picks {
                    check_fault(verify_fault);
                    by_picks(row_view.drafts, picks)
                } else {
                    let host = host_rows(logits, vocab_size, step_id, row, row_view.drafts.len())?;
                    if !row_view.drafts.is_empty() {
                        check_fault(verify_fault);
                    }
                    let (sampler, masked) = (&mut self.sampler, &mut self.masked);
                    draw_on_host(sampler, masked, &row_view, &host, &mut advances)
                }
            };
            yielded.push(Some((draw.tokens.clone(), draw.num_rejected)));
            rows.push(SampledRow {
                tokens: draw.tokens,
                token_logprobs: draw.logprobs,
                top_logprobs: draw.top,
                draft_probs: model_drafts
                    .map_or_else(Vec::new, |d| d.iter().map(|x| x.1).collect()),
                // Its logits crossed to the host: no pick on the device.
                host_sampled: picked.is_none() && verify_picks.is_none(),
            });
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
        Ok(StepOutcome {
            rows,
            per_row,
            advances,
        })
    }
}

/// Row `row` of `step` with its history. ZOS: the tokens the remapped row of the previous
/// step drew (`last_step`; the scheduler did not know them when it planned this row, nor,
/// after a verify row, how many drafts it rejected: this row's position moves back by as
/// many), gathered in `history`.
fn view<'a>(
    last_step: &'a Option<(u64, u64, Vec<Option<Yielded>>)>,
    history: &'a mut Vec<u32>,
    step: &Step,
    row: usize,
    s: &'a RowSampling,
    drafts: &'a [u32],
) -> RowView<'a> {
    let pending = step.remap.source(row).and_then(|m| match last_step {
        Some((e, prev_step, prev)) if *e == step.epoch && *prev_step == m.prev_step => {
            prev.get(m.prev_row).and_then(Option::as_ref)
        }
        _ => None,
    });
    let position = s.position - pending.map_or(0, |p| p.1 as u64);
    let output_ids: &[u32] = match pending {
        Some((t, _)) => {
            history.clear();
            history.extend_from_slice(&s.output_ids);
            history.extend_from_slice(t);
            history
        }
        None => &s.output_ids,
    };
    // The scheduler counted the fewest tokens the continued row may yield.
    let banned_ids: &[u32] = match pending.is_some() {
        true if output_ids.len() >= s.min_tokens => &[],
        true => &s.stop_ids,
        false => &s.banned_ids,
    };
    RowView {
        s,
        output_ids,
        position,
        banned_ids,
        drafts,
    }
}

fn check_fault(verify_fault: &mut dyn FnMut() -> bool) {
    if verify_fault() {
        panic!("sampler panicked mid-verification (injected fault)");
    }
}

/// A row verified on the device: the drafts that equal the pick there (the argmax, or
/// the seeded draw), then the pick at the first mismatch (or after the last draft).
fn by_picks(drafts: &[u32], picks: &[(u32, f32)]) -> Draw {
    let num_accepted = verify::num_accepted_by_picks(drafts, picks.iter().map(|p| p.0));
    let emitted = &picks[..=num_accepted.min(picks.len() - 1)];
    Draw::bare(
        emitted.iter().map(|p| p.0).collect(),
        emitted.iter().map(|p| p.1).collect(),
        drafts.len(),
    )
}

/// A row's logit rows on the host: its own and one a draft.
fn host_rows(
    logits: &StepLogits,
    vocab_size: usize,
    step_id: u64,
    row: usize,
    num_drafts: usize,
) -> Result<Vec<&[f32]>, SampleError> {
    let Some(first) = logits.host_row.get(row).copied().flatten() else {
        return Err(SampleError::NoLogits { step_id, row });
    };
    let num_rows = logits.host.len() / vocab_size.max(1);
    if first + num_drafts >= num_rows {
        return Err(SampleError::TooFewLogitRows {
            step_id,
            row,
            num_drafts,
            num_logit_rows: num_rows.saturating_sub(first),
        });
    }
    Ok((first..=first + num_drafts)
        .map(|r| &logits.host[r * vocab_size..(r + 1) * vocab_size])
        .collect())
}

/// The host's sampler on a row's logits: one token, or its drafts verified.
fn draw_on_host(
    sampler: &mut RowSampler,
    masked: &mut Vec<f32>,
    r: &RowView<'_>,
    rows: &[&[f32]],
    advances: &mut Vec<(Arc<SeqConstraint>, Vec<u32>)>,
) -> Draw {
    let s = r.s;
    // The matcher's next mask follows the emitted tokens (rolling back anything it saw
    // beyond them), advanced after the tokens are out so the next masks are computed
    // beside the next forward pass.
    let mut advance = |tokens: &[u32]| {
        if let Some(c) = &s.constraint {
            let mut history = r.output_ids.to_vec();
            history.extend_from_slice(tokens);
            advances.push((c.clone(), history));
        }
    };
    if r.drafts.is_empty() {
        let row_logits = match &s.constraint {
            Some(c) => {
                masked.clear();
                masked.extend_from_slice(rows[0]);
                c.mask_logits(r.output_ids, masked);
                &masked[..]
            }
            None => rows[0],
        };
        let ctx = SampleContext {
            position: r.position,
            prompt_ids: &s.prompt_ids,
            output_ids: r.output_ids,
            banned_ids: r.banned_ids,
        };
        let out = sampler.sample_row(row_logits, &s.params, &ctx);
        advance(&[out.token]);
        return Draw::sampled(vec![out], 0);
    }
    // Each position's token is the one this sampler draws there with the accepted drafts
    // as history: the output of speculation off.
    if s.rejection && s.is_plain_but_drafts() && r.output_ids.len() >= s.min_tokens {
        // The target's distribution at each position is the sampler's (no processors
        // apply); n-gram drafts are certain (q one-hot).
        let targets: Vec<TargetDistribution> = rows
            .iter()
            .map(|row| TargetDistribution::new(row, &s.params))
            .collect();
        let v = verify::rejection(&targets, r.drafts, None, s.params.seed, r.position);
        let logprobs = v
            .tokens
            .iter()
            .zip(&targets)
            .map(|(&t, d)| d.prob(t).ln() as f32)
            .collect();
        return Draw::bare(v.tokens, logprobs, r.drafts.len());
    }
    let mask = s
        .constraint
        .as_ref()
        .map(|c| move |history: &[u32], logits: &mut [f32]| c.mask_logits(history, logits));
    let history = History {
        prompt_ids: &s.prompt_ids,
        output_ids: r.output_ids,
        banned_ids: &s.stop_ids,
        ban_below_len: s.min_tokens,
        mask: mask.as_ref().map(|m| m as &verify::GrammarMask<'_>),
    };
    let outs = verify::with_sampler(sampler, rows, r.drafts, &s.params, r.position, history);
    advance(&outs.iter().map(|o| o.token).collect::<Vec<_>>());
    Draw::sampled(outs, r.drafts.len())
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
