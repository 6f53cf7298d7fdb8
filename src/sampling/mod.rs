//! Logits → token, per request and per row: every row of a batch is sampled with its own
//! parameters, seed and history, never with the batch's.
//!
//! The pipeline, in vLLM's order: `logit_bias` → banned ids (−∞) → repetition / frequency /
//! presence penalties → (greedy: argmax, done) → temperature → top-k → top-p → min-p →
//! a draw with `uniform(seed, position, STREAM_SAMPLE)`.
//!
//! Invariants:
//! - A row's result is a pure function of (logits, params, context): the draw is a hash of
//!   (seed, position, stream), the candidate order is by value then id, and the buffers
//!   reused across calls are rebuilt (or, for the penalty table, restored to zeros) before
//!   being read.
//! - `Sampler::sample` is the pipeline with an empty context and draws exactly what the
//!   first sampler did: same division by the temperature, same top-k select, same order,
//!   same f64 sums. New cuts only ever remove a suffix of that order.
//!
//! Cost per row of vocabulary V: greedy O(V) (one argmax pass; logprobs one vectorized
//! log-sum-exp pass); with top-k, an O(V) select then O(k log k); otherwise an O(V) radix
//! sort and V exps. The processors cost O(#bias + #banned + #prompt + #output). No
//! allocation per call after warm-up, except the returned `top_logprobs`.

#[cfg(test)]
mod distribution_tests;
mod logprobs;
mod params;
mod processors;
mod rng;
mod sort;
#[cfg(test)]
mod tests;

pub use logprobs::{ScoredToken, log_sum_exp, score_token};
pub use params::{MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, SamplingParams};
pub use rng::{STREAM_ACCEPT, STREAM_DRAFT, STREAM_GUMBEL, STREAM_SAMPLE, splitmix64, uniform};

use processors::Penalties;

/// What a row's sampling may look at besides its logits.
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleContext<'a> {
    /// Position of the token being sampled in its sequence: with the seed, all the draw
    /// depends on.
    pub position: u64,
    /// The prompt, for `repetition_penalty`.
    pub prompt_ids: &'a [u32],
    /// Tokens generated so far, for all three penalties.
    pub output_ids: &'a [u32],
    /// Token ids that may not be sampled now (the engine passes the stop ids while fewer
    /// than min_tokens were generated).
    pub banned_ids: &'a [u32],
}

#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    pub token: u32,
    /// Log-probability of `token` under the distribution it was sampled from (or the raw
    /// one with `raw_logprobs`).
    pub logprob: f32,
    /// The `num_top_logprobs` most likely `(id, logprob)` pairs of that same distribution,
    /// descending, ties by id. Fewer when fewer tokens survive the cuts: tokens that cannot
    /// be sampled are not reported.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The first index of the largest logit (NaNs never win, except a NaN at index 0).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two vectorized passes (the max, then its first index) instead of one loop-carried
    // compare per element; the same answer as `v > best` scanning from index 0.
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let max = logprobs::max_value(logits);
    const CHUNK: usize = 16;
    for (c, chunk) in logits.chunks(CHUNK).enumerate() {
        if chunk.iter().fold(false, |any, &v| any | (v == max)) {
            let i = chunk
                .iter()
                .position(|&v| v == max)
                .expect("the chunk holds the max");
            return (c * CHUNK + i) as u32;
        }
    }
    0
}

/// `(id, log-probability)` of the `k` most likely tokens under `log_softmax(logits)`,
/// descending, ties by id.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    logprobs::log_softmax_top(logits, k).1
}

/// Reusable buffers so sampling allocates nothing per token.
#[derive(Default)]
pub struct Sampler {
    /// The row after the processors, when any applies (else the sampler reads the logits).
    processed: Vec<f32>,
    /// Whether the last draw read `processed` rather than the caller's logits.
    row_is_processed: bool,
    /// Top-k rows: `(id, scaled logit)`, cut to the k largest and sorted.
    candidates: Vec<(u32, f32)>,
    /// Other rows: the scaled logits by id, and their order keys, sorted.
    scaled: Vec<f32>,
    keys: Vec<u32>,
    key_scratch: Vec<u32>,
    /// Candidate weights exp(scaled − max) in sorted order: probabilities relative to the
    /// most likely candidate.
    weights: Vec<f32>,
    penalties: Penalties,
}

/// How a token was chosen, for its logprobs.
enum Drawn {
    Greedy {
        token: u32,
    },
    Sampled {
        token: u32,
        /// The largest scaled logit: candidate weights are exp(scaled − max_scaled).
        max_scaled: f32,
        /// ln of the kept candidates' total weight.
        log_total: f64,
        /// The kept candidates are the first `num_kept` of the sorted order.
        num_kept: usize,
        /// Whether that order is `Sampler::candidates` (top-k rows) or `Sampler::keys`.
        top_k_cut: bool,
    },
}

impl Drawn {
    fn token(&self) -> u32 {
        match *self {
            Drawn::Greedy { token } | Drawn::Sampled { token, .. } => token,
        }
    }
}

impl Sampler {
    /// Samples the token at `position` of a sequence: `sample_row` with no prompt, output
    /// or banned ids, without the logprobs.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
        let ctx = SampleContext {
            position,
            ..SampleContext::default()
        };
        self.draw(logits, params, &ctx).token()
    }

    /// The full pipeline (see the module docs) for one row, with the logprobs of the
    /// distribution sampled from: for a greedy row, softmax of the processed logits (no
    /// temperature); else the truncated, renormalized one; with `raw_logprobs`, the raw
    /// model distribution.
    pub fn sample_row(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        ctx: &SampleContext<'_>,
    ) -> SampleOutput {
        let drawn = self.draw(logits, params, ctx);
        let token = drawn.token();
        let k = params.num_top_logprobs;
        if params.raw_logprobs {
            let (log_z, top_logprobs) = logprobs::log_softmax_top(logits, k);
            return SampleOutput {
                token,
                logprob: logits[token as usize] - log_z,
                top_logprobs,
            };
        }
        let row = if self.row_is_processed {
            &self.processed[..]
        } else {
            logits
        };
        let Drawn::Sampled {
            max_scaled,
            log_total,
            num_kept,
            top_k_cut,
            ..
        } = drawn
        else {
            let (log_z, top_logprobs) = logprobs::log_softmax_top(row, k);
            return SampleOutput {
                token,
                logprob: row[token as usize] - log_z,
                top_logprobs,
            };
        };
        // The draw's own f32 division, so the draw's scaled value.
        let logprob = |id: u32| {
            ((row[id as usize] / params.temperature - max_scaled) as f64 - log_total) as f32
        };
        let k = k.min(num_kept);
        let mut top_logprobs = Vec::with_capacity(k);
        if top_k_cut {
            top_logprobs.extend(self.candidates[..k].iter().map(|&(id, _)| (id, 0.0)));
        } else {
            // The first k of the sorted order: by value, ties by id, as top_k_values picks.
            logprobs::top_k_values(&self.scaled, k, &mut top_logprobs);
        }
        for e in &mut top_logprobs {
            e.1 = logprob(e.0);
        }
        SampleOutput {
            token,
            logprob: logprob(token),
            top_logprobs,
        }
    }

    fn draw(&mut self, logits: &[f32], params: &SamplingParams, ctx: &SampleContext<'_>) -> Drawn {
        let row: &[f32] = if processors::needs_processing(params, ctx) {
            self.processed.clear();
            self.processed.extend_from_slice(logits);
            processors::apply(&mut self.processed, params, ctx, &mut self.penalties);
            self.row_is_processed = true;
            &self.processed
        } else {
            self.row_is_processed = false;
            logits
        };
        if params.is_greedy() {
            return Drawn::Greedy { token: argmax(row) };
        }
        let top_k_cut = params.top_k > 0 && params.top_k < row.len();
        let (max_scaled, total) = if top_k_cut {
            let c = &mut self.candidates;
            c.clear();
            c.extend(
                row.iter()
                    .enumerate()
                    .map(|(i, &v)| (i as u32, v / params.temperature)),
            );
            // This select (by value alone) decides which of several candidates tied at the
            // k-th place survive; it is the first sampler's, so seeded draws stay the same.
            c.select_nth_unstable_by(params.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            c.truncate(params.top_k);
            c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let max_scaled = c[0].1;
            let total = fill_weights(c.iter().map(|e| e.1), max_scaled, &mut self.weights);
            (max_scaled, total)
        } else {
            self.scaled.clear();
            self.scaled
                .extend(row.iter().map(|&v| v / params.temperature));
            self.keys.clear();
            self.keys
                .extend(self.scaled.iter().map(|&v| sort::descending_key(v)));
            sort::sort_keys(&mut self.keys, &mut self.key_scratch);
            let max_scaled = sort::key_value(self.keys[0]);
            let sorted = self.keys.iter().map(|&key| sort::key_value(key));
            let total = fill_weights(sorted, max_scaled, &mut self.weights);
            (max_scaled, total)
        };
        let (num_kept, total, index) = cut_and_draw(&self.weights, total, params, ctx.position);
        let token = if top_k_cut {
            self.candidates[index].0
        } else {
            // Sorted position `index` holds the n-th id (in id order) of its value.
            let key = self.keys[index];
            let first = self.keys[..index]
                .iter()
                .rposition(|&k| k != key)
                .map_or(0, |p| p + 1);
            sort::nth_id_with_value(&self.scaled, sort::key_value(key), index - first)
                .expect("every sorted key is some id's value")
        };
        Drawn::Sampled {
            token,
            max_scaled,
            log_total: total.ln(),
            num_kept,
            top_k_cut,
        }
    }
}

/// Weights exp(v − max) of scaled values in sorted (descending) order into `weights`, and
/// their sum, in that order and precision: the first sampler's arithmetic, bit for bit.
pub(crate) fn fill_weights(
    sorted: impl Iterator<Item = f32>,
    max_scaled: f32,
    weights: &mut Vec<f32>,
) -> f64 {
    // Below −104, exp(d) < 2^-150, which rounds to an f32 0: no libm call needed.
    const ZERO_BELOW: f32 = -104.0;
    weights.clear();
    let mut total = 0f64;
    let mut last: Option<(u32, f32)> = None;
    for value in sorted {
        let d = value - max_scaled;
        let weight = match last {
            // Equal values are adjacent: one exp per distinct value.
            Some((bits, weight)) if bits == value.to_bits() => weight,
            _ if d < ZERO_BELOW => 0.0,
            _ => (d as f64).exp() as f32,
        };
        last = Some((value.to_bits(), weight));
        weights.push(weight);
        total += weight as f64;
    }
    total
}

/// The cuts after temperature and the draw, over sorted `weights` summing to `total`:
/// `(num_kept, total kept weight, sorted index drawn)`.
fn cut_and_draw(
    weights: &[f32],
    total: f64,
    params: &SamplingParams,
    position: u64,
) -> (usize, f64, usize) {
    let (num_kept, total) = kept_prefix(weights, total, params);
    let target = uniform(params.seed, position, STREAM_SAMPLE) * total;
    let mut cum = 0f64;
    for (i, &w) in weights[..num_kept].iter().enumerate() {
        cum += w as f64;
        if cum > target {
            return (num_kept, total, i);
        }
    }
    (num_kept, total, num_kept - 1)
}

/// Top-p then min-p over sorted `weights` summing to `total`, each cut a prefix:
/// `(num_kept, total kept weight)`. Speculative verification cuts the same way.
pub(crate) fn kept_prefix(
    weights: &[f32],
    mut total: f64,
    params: &SamplingParams,
) -> (usize, f64) {
    let mut num_kept = weights.len();
    if params.top_p < 1.0 {
        let mut cum = 0f64;
        for (i, &w) in weights.iter().enumerate() {
            cum += w as f64 / total;
            if cum >= params.top_p as f64 {
                num_kept = i + 1;
                break;
            }
        }
        total = weights[..num_kept].iter().map(|&w| w as f64).sum();
    }
    if params.min_p > 0.0 {
        // A weight is the probability relative to the most likely candidate (weight 1),
        // whatever the cuts before removed: min-p keeps weight ≥ min_p, a prefix.
        if let Some(p) = weights[..num_kept].iter().position(|&w| w < params.min_p) {
            num_kept = p.max(1);
            total = weights[..num_kept].iter().map(|&w| w as f64).sum();
        }
    }
    (num_kept, total)
}
