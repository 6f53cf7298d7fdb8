//! Verification of one sequence's drafts against the target model's rows. `targets[i]` is
//! the target distribution after the history and drafts `0..i` (so one more row than
//! drafts); the first draft sits at sequence position `first_position`. Each function
//! returns the accepted drafts followed by one token the target chose itself: the
//! correction at the first rejection, or the bonus token after the last draft.
//!
//! - [`greedy`]: accept while the draft is the target's pick (argmax rows, one-hot targets).
//! - [`rejection`]: accept draft x with probability min(1, p(x) / q(x)) (the draw from its
//!   own stream, `STREAM_ACCEPT`), else resample from max(0, p − q); the output tokens are
//!   distributed exactly as the target's, whatever the drafts.
//! - [`coupled`]: the target's token at each position is the Gumbel-max pick of
//!   (seed, position, target distribution); drafts are accepted while they equal it. The
//!   output is then the same sequence with speculation off, on, at any verify length and in
//!   any batch — the deterministic-varlen mode.
//! - [`with_sampler`]: the same coupling through the engine's own sampler: position i's
//!   token is what `Sampler::sample_row` draws from row i with the history extended by the
//!   accepted drafts — penalties, bans, counter-hash draw and logprobs included — so a
//!   request's tokens and logprobs are those it gets with speculation off.

use super::TargetDistribution;
use super::gumbel_pick;
use crate::sampling::{
    STREAM_ACCEPT, STREAM_SAMPLE, SampleContext, SampleOutput, Sampler, SamplingParams, uniform,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Accepted drafts, then the target's own token.
    pub tokens: Vec<u32>,
    pub num_accepted: usize,
}

fn check_rows(targets: usize, drafts: usize) {
    assert_eq!(
        targets,
        drafts + 1,
        "one target row per draft, and one after"
    );
}

/// Greedy verification against the target's argmax picks (the drafts' positions and the
/// one after): the drafts equal to the pick there, in order.
pub fn num_accepted_by_picks(drafts: &[u32], picks: impl IntoIterator<Item = u32>) -> usize {
    drafts
        .iter()
        .zip(picks)
        .take_while(|(d, p)| **d == *p)
        .count()
}

pub fn greedy(targets: &[TargetDistribution], drafts: &[u32]) -> Verified {
    check_rows(targets.len(), drafts.len());
    let mut tokens = Vec::with_capacity(targets.len());
    for (target, &draft) in targets.iter().zip(drafts) {
        let pick = target.sample(0.0);
        tokens.push(pick);
        if pick != draft {
            return Verified {
                num_accepted: tokens.len() - 1,
                tokens,
            };
        }
    }
    tokens.push(targets[drafts.len()].sample(0.0));
    Verified {
        num_accepted: drafts.len(),
        tokens,
    }
}

/// `draft_dists[i]` is the distribution draft i was drawn from; `None` for a deterministic
/// drafter (n-gram), whose q is one-hot at its draft.
pub fn rejection(
    targets: &[TargetDistribution],
    drafts: &[u32],
    draft_dists: Option<&[TargetDistribution]>,
    seed: u64,
    first_position: u64,
) -> Verified {
    check_rows(targets.len(), drafts.len());
    let mut tokens = Vec::with_capacity(targets.len());
    for (i, (target, &draft)) in targets.iter().zip(drafts).enumerate() {
        let position = first_position + i as u64;
        let one_hot;
        let q = match draft_dists {
            Some(d) => &d[i],
            None => {
                one_hot = TargetDistribution::one_hot(draft);
                &one_hot
            }
        };
        let token = rejection_pick(target, draft, q, seed, position);
        tokens.push(token);
        if token != draft {
            return Verified {
                num_accepted: i,
                tokens,
            };
        }
    }
    let position = first_position + drafts.len() as u64;
    tokens.push(targets[drafts.len()].sample(uniform(seed, position, STREAM_SAMPLE)));
    Verified {
        num_accepted: drafts.len(),
        tokens,
    }
}

/// One position of [`rejection`]: `draft` if it is accepted, else the residual draw (which
/// is never `draft`, so a pick tells whether the draft was kept). `q` is the distribution
/// the draft was drawn from.
pub fn rejection_pick(
    target: &TargetDistribution,
    draft: u32,
    q: &TargetDistribution,
    seed: u64,
    position: u64,
) -> u32 {
    let (p_x, q_x) = (target.prob(draft), q.prob(draft));
    if q_x > 0.0 && uniform(seed, position, STREAM_ACCEPT) < p_x / q_x {
        return draft;
    }
    target.sample_residual(q, uniform(seed, position, STREAM_SAMPLE))
}

pub fn coupled(
    targets: &[TargetDistribution],
    drafts: &[u32],
    seed: u64,
    first_position: u64,
) -> Verified {
    check_rows(targets.len(), drafts.len());
    let mut tokens = Vec::with_capacity(targets.len());
    for (i, target) in targets.iter().enumerate() {
        let pick = gumbel_pick(target, seed, first_position + i as u64);
        tokens.push(pick);
        if drafts.get(i) != Some(&pick) {
            break;
        }
    }
    Verified {
        num_accepted: tokens.len() - 1,
        tokens,
    }
}

/// What a request's sampling looks at besides its logits, before this step's drafts.
#[derive(Clone, Copy)]
pub struct History<'a> {
    pub prompt_ids: &'a [u32],
    pub output_ids: &'a [u32],
    /// Banned while fewer than `ban_below_len` tokens were generated (stop ids under
    /// `min_tokens`).
    pub banned_ids: &'a [u32],
    pub ban_below_len: usize,
    /// A grammar's mask after a history (structured output): forbidden logits to −∞. The
    /// matcher follows each draft as it is verified and is rolled back to the accepted
    /// history afterwards.
    pub mask: Option<&'a GrammarMask<'a>>,
}

/// Masks logits after a history: forbidden ids to −∞.
pub type GrammarMask<'a> = dyn Fn(&[u32], &mut [f32]) + 'a;

/// `rows[i]` are the target's logits after the history and drafts `0..i`; the first draft
/// sits at `first_position`. Returns the sampler's output for each emitted token: the
/// accepted drafts, then the sampler's own token at the first mismatch (or after the last).
pub fn with_sampler(
    sampler: &mut Sampler,
    rows: &[&[f32]],
    drafts: &[u32],
    params: &SamplingParams,
    first_position: u64,
    history: History<'_>,
) -> Vec<SampleOutput> {
    check_rows(rows.len(), drafts.len());
    let mut output_ids = history.output_ids.to_vec();
    let mut out = Vec::with_capacity(rows.len());
    let mut masked = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let row: &[f32] = match history.mask {
            Some(mask) => {
                masked.clear();
                masked.extend_from_slice(row);
                mask(&output_ids, &mut masked);
                &masked
            }
            None => row,
        };
        let banned = if output_ids.len() < history.ban_below_len {
            history.banned_ids
        } else {
            &[]
        };
        let ctx = SampleContext {
            position: first_position + i as u64,
            prompt_ids: history.prompt_ids,
            output_ids: &output_ids,
            banned_ids: banned,
        };
        let drawn = sampler.sample_row(row, params, &ctx);
        let token = drawn.token;
        out.push(drawn);
        if drafts.get(i) != Some(&token) {
            break;
        }
        output_ids.push(token);
    }
    out
}

#[cfg(test)]
mod tests;
