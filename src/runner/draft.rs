//! The draft model of `--spec draft`, run by the rank worker right before the model's
//! forward pass. Its KV cache has the model's block layout, so the step's block tables
//! address both, and it computes every position the model computes: each step it first
//! runs the step's rows as the model will (a verify row up to its first token), then, for
//! the verify rows only, one pass per draft, each feeding the draft picked by the pass
//! before — the last pass writes the last draft's K/V, so that the draft's cache holds
//! every position the model's verify row fills. Drafts are the draft model's greedy
//! tokens, with its probability of each (the scheduler's confidence, one step late).

use crate::kernels::Backend;
use crate::model::llama::{LlamaModel, SeqStep};

pub struct DraftModel<B: Backend> {
    model: LlamaModel<B>,
    cache: B::KvCache,
}

/// The greedy token of a logit row and its probability under the row's softmax.
pub(super) fn greedy(logits: &[f32]) -> (u32, f32) {
    let (best, max) =
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv { (i, v) } else { (bi, bv) }
            });
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (best as u32, (1.0 / sum) as f32)
}

impl<B: Backend> DraftModel<B> {
    pub fn new(model: LlamaModel<B>, cache: B::KvCache) -> Self {
        DraftModel {
            model: model.without_graphs(),
            cache,
        }
    }

    /// Per step row: `num_drafts[i]` drafts (token, probability) for a row whose last
    /// `num_drafts[i]` input tokens are placeholders; empty for the others.
    pub fn propose(
        &mut self,
        backend: &B,
        block_size: usize,
        steps: &[SeqStep<'_>],
        picked_rows: &[u32],
        num_drafts: &[usize],
    ) -> Vec<Vec<(u32, f32)>> {
        let vocab = self.model.cfg.vocab_size;
        let mut drafts: Vec<Vec<(u32, f32)>> = vec![Vec::new(); steps.len()];
        let known = |i: usize| steps[i].token_ids.len() - num_drafts[i];
        let mirror: Vec<SeqStep<'_>> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| SeqStep {
                token_ids: &s.token_ids[..known(i)],
                num_cached_tokens: s.num_cached_tokens,
                block_table: s.block_table,
                num_logit_rows: 1,
                state: None,
            })
            .collect();
        self.model.forward_on_device(
            backend,
            &mut self.cache,
            block_size,
            &mirror,
            picked_rows,
            &[],
            &[],
        );
        let wanted: Vec<usize> = (0..steps.len()).filter(|&i| num_drafts[i] > 0).collect();
        if wanted.is_empty() {
            return drafts;
        }
        // Each draft and its probability under the draft's softmax.
        let picks = backend.greedy_rows(self.model.device_logits(), vocab, &wanted);
        for (&(token, logprob), &i) in picks.iter().zip(&wanted) {
            drafts[i].push((token, logprob.exp()));
        }
        let max_drafts = num_drafts.iter().copied().max().unwrap_or(0);
        for pass in 1..=max_drafts {
            // Rows still drafting feed their newest draft; at its last draft a row only
            // writes that draft's K/V.
            let active: Vec<usize> = (0..steps.len())
                .filter(|&i| num_drafts[i] >= pass)
                .collect();
            let inputs: Vec<[u32; 1]> = active.iter().map(|&i| [drafts[i][pass - 1].0]).collect();
            let batch: Vec<SeqStep<'_>> = active
                .iter()
                .zip(&inputs)
                .map(|(&i, input)| SeqStep {
                    token_ids: input,
                    num_cached_tokens: steps[i].num_cached_tokens + known(i) + pass - 1,
                    block_table: steps[i].block_table,
                    num_logit_rows: 1,
                    state: None,
                })
                .collect();
            self.model.forward_on_device(
                backend,
                &mut self.cache,
                block_size,
                &batch,
                &[],
                &[],
                &[],
            );
            let more: Vec<usize> = (0..active.len())
                .filter(|&j| num_drafts[active[j]] > pass)
                .collect();
            if more.is_empty() {
                continue;
            }
            let picks = backend.greedy_rows(self.model.device_logits(), vocab, &more);
            for (&(token, logprob), &j) in picks.iter().zip(&more) {
                drafts[active[j]].push((token, logprob.exp()));
            }
        }
        drafts
    }
}

#[cfg(test)]
mod tests {
    use super::greedy;

    #[test]
    fn greedy_picks_the_argmax_with_its_softmax_probability() {
        let (token, prob) = greedy(&[0.0, 2.0, 1.0, 2.0f32.ln()]);
        assert_eq!(token, 1);
        let want = 2f32.exp() / (1.0 + 2f32.exp() + 1f32.exp() + 2.0);
        assert!((prob - want).abs() < 1e-6, "{prob} vs {want}");
    }
}
