//! Logit processors applied before any cut, in vLLM's order: `logit_bias` → banned ids →
//! repetition / frequency / presence penalties.
//!
//! Cost: O(#bias + #banned + #prompt + #output) per row — the penalties touch only the ids
//! that occur, through a vocab-sized count table that is all zeros between calls.

use super::{SampleContext, SamplingParams};

/// Set in a `counts` entry when the token occurs in the prompt; the low bits count its
/// occurrences in the output.
const IN_PROMPT: u32 = 1 << 31;

/// Reusable tables for the penalties.
#[derive(Default)]
pub(super) struct Penalties {
    /// Per token id: occurrences in the output, `| IN_PROMPT` if in the prompt. All zeros
    /// between calls (restored from `touched`).
    counts: Vec<u32>,
    /// The ids whose `counts` entry is non-zero.
    touched: Vec<u32>,
    /// Set while `counts` may hold non-zeros (a panic mid-call leaves it set): the next call
    /// clears the whole table instead of trusting it.
    dirty: bool,
}

/// Whether any processor changes this row's logits (else the sampler reads them in place).
pub(super) fn needs_processing(params: &SamplingParams, ctx: &SampleContext<'_>) -> bool {
    let repetition = params.repetition_penalty != 1.0
        && !(ctx.prompt_ids.is_empty() && ctx.output_ids.is_empty());
    let output = (params.frequency_penalty != 0.0 || params.presence_penalty != 0.0)
        && !ctx.output_ids.is_empty();
    !params.logit_bias.is_empty() || !ctx.banned_ids.is_empty() || repetition || output
}

/// Applies every processor to `row` in place. Ids outside `row` (which validation keeps
/// out of `logit_bias`) are ignored.
pub(super) fn apply(
    row: &mut [f32],
    params: &SamplingParams,
    ctx: &SampleContext<'_>,
    penalties: &mut Penalties,
) {
    for &(token_id, bias) in &params.logit_bias {
        if let Some(logit) = row.get_mut(token_id as usize) {
            *logit += bias;
        }
    }
    for &token_id in ctx.banned_ids {
        if let Some(logit) = row.get_mut(token_id as usize) {
            *logit = f32::NEG_INFINITY;
        }
    }
    penalties.apply(row, params, ctx.prompt_ids, ctx.output_ids);
}

impl Penalties {
    fn apply(&mut self, row: &mut [f32], params: &SamplingParams, prompt: &[u32], output: &[u32]) {
        let repetition = params.repetition_penalty;
        let (frequency, presence) = (params.frequency_penalty, params.presence_penalty);
        let use_repetition = repetition != 1.0;
        if !use_repetition && frequency == 0.0 && presence == 0.0 {
            return;
        }
        if self.dirty || self.counts.len() < row.len() {
            let len = self.counts.len().max(row.len());
            self.counts.clear();
            self.counts.resize(len, 0);
        }
        self.dirty = true;
        let vocab_size = row.len();
        for &token_id in output {
            let t = token_id as usize;
            if t < vocab_size {
                if self.counts[t] == 0 {
                    self.touched.push(token_id);
                }
                self.counts[t] += 1;
            }
        }
        if use_repetition {
            for &token_id in prompt {
                let t = token_id as usize;
                if t < vocab_size {
                    if self.counts[t] == 0 {
                        self.touched.push(token_id);
                    }
                    self.counts[t] |= IN_PROMPT;
                }
            }
        }
        for &token_id in &self.touched {
            let t = token_id as usize;
            let num_in_output = self.counts[t] & !IN_PROMPT;
            self.counts[t] = 0;
            let logit = &mut row[t];
            // vLLM's apply_penalties: repetition first (over prompt ∪ output), then the
            // OpenAI penalties (over the output), each as an f32 tensor op would round.
            if use_repetition {
                *logit = if *logit > 0.0 {
                    *logit / repetition
                } else {
                    *logit * repetition
                };
            }
            if num_in_output > 0 {
                *logit -= frequency * num_in_output as f32;
                *logit -= presence;
            }
        }
        self.touched.clear();
        self.dirty = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context<'a>(prompt: &'a [u32], output: &'a [u32]) -> SampleContext<'a> {
        SampleContext {
            prompt_ids: prompt,
            output_ids: output,
            ..Default::default()
        }
    }

    /// The logits after the processors, through the pipeline's own code path.
    fn processed(logits: &[f32], params: &SamplingParams, ctx: &SampleContext<'_>) -> Vec<f32> {
        let mut row = logits.to_vec();
        apply(&mut row, params, ctx, &mut Penalties::default());
        row
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-6,
                "logit {i}: got {g}, want {w} ({got:?})"
            );
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Prompt {0, 1, 5}, output {2, 3}: every one of them, once, whatever its count.
        let got = processed(&logits, &p, &context(&[0, 1, 1, 5], &[2, 2, 3]));
        assert_close(&got, &[1.0, -2.0, 0.25, 1.5, -2.0, 0.0]);
        let below_one = SamplingParams {
            repetition_penalty: 0.5,
            ..Default::default()
        };
        let got = processed(&logits, &below_one, &context(&[1], &[0]));
        assert_close(&got, &[4.0, -0.5, 0.5, 3.0, -2.0, 0.0]);
    }

    #[test]
    fn frequency_penalty_scales_with_the_output_count_only() {
        let logits = [2.0, -1.0, 0.5, 3.0];
        let p = SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        };
        let got = processed(&logits, &p, &context(&[0, 1], &[2, 2, 3, 2]));
        assert_close(&got, &[2.0, -1.0, -1.0, 2.5]);
        let negative = SamplingParams {
            frequency_penalty: -1.0,
            ..Default::default()
        };
        assert_close(
            &processed(&logits, &negative, &context(&[], &[1, 1])),
            &[2.0, 1.0, 0.5, 3.0],
        );
    }

    #[test]
    fn presence_penalty_applies_once_per_output_token() {
        let logits = [2.0, -1.0, 0.5, 3.0];
        let p = SamplingParams {
            presence_penalty: 0.25,
            ..Default::default()
        };
        let got = processed(&logits, &p, &context(&[0, 1], &[2, 2, 3, 2]));
        assert_close(&got, &[2.0, -1.0, 0.25, 2.75]);
    }

    #[test]
    fn penalties_compose_in_vllm_order() {
        let logits = [2.0, -1.0, 0.5, 3.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            logit_bias: vec![(4, -2.0)],
            ..Default::default()
        };
        let ctx = SampleContext {
            banned_ids: &[0],
            ..context(&[0, 1, 4], &[2, 2, 3])
        };
        // 0: banned (−∞ stays −∞); 1: −1·2; 2: 0.5/2 − 0.5·2 − 0.25; 3: 3/2 − 0.5 − 0.25;
        // 4: bias first, 1 − 2 = −1, then ·2 as a now-negative logit.
        let got = processed(&logits, &p, &ctx);
        assert_eq!(got[0], f32::NEG_INFINITY);
        assert_close(&got[1..], &[-2.0, -1.0, 0.75, -2.0]);
    }
}
