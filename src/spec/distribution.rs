//! The distribution a row's token is drawn from, as the sampler draws it (temperature →
//! top-k → top-p → min-p over logits already processed for penalties and bias), in the
//! sampler's candidate order: by value descending, ties by id. Verification needs it whole:
//! p(draft), the residual max(0, p − q), and the Gumbel-max pick.

use crate::sampling::{STREAM_GUMBEL, SamplingParams, fill_weights, kept_prefix, splitmix64};

#[derive(Debug, Clone, PartialEq)]
pub struct TargetDistribution {
    /// The kept candidates in candidate order.
    ids: Vec<u32>,
    /// Their probabilities, summing to 1.
    probs: Vec<f64>,
}

impl TargetDistribution {
    /// Greedy rows (temperature 0) put all mass on the first index of the largest logit.
    pub fn new(logits: &[f32], params: &SamplingParams) -> Self {
        if params.is_greedy() {
            return Self::one_hot(crate::sampling::argmax(logits));
        }
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, v / params.temperature))
            .collect();
        cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if params.top_k > 0 && params.top_k < cands.len() {
            cands.truncate(params.top_k);
        }
        let max = cands[0].1;
        let mut weights = Vec::with_capacity(cands.len());
        let total = fill_weights(cands.iter().map(|c| c.1), max, &mut weights);
        let (num_kept, total) = kept_prefix(&weights, total, params);
        TargetDistribution {
            ids: cands[..num_kept].iter().map(|c| c.0).collect(),
            probs: weights[..num_kept]
                .iter()
                .map(|&w| w as f64 / total)
                .collect(),
        }
    }

    pub fn one_hot(token: u32) -> Self {
        TargetDistribution {
            ids: vec![token],
            probs: vec![1.0],
        }
    }

    pub fn prob(&self, token: u32) -> f64 {
        self.ids
            .iter()
            .position(|&id| id == token)
            .map_or(0.0, |i| self.probs[i])
    }

    /// Inverse-CDF draw in candidate order: the first candidate whose cumulative
    /// probability exceeds `u` ∈ [0, 1).
    pub fn sample(&self, u: f64) -> u32 {
        let mut cum = 0f64;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            cum += p;
            if cum > u {
                return id;
            }
        }
        *self
            .ids
            .last()
            .expect("a distribution keeps at least one candidate")
    }

    /// A draw from the residual max(0, p − q) (normalised), in p's candidate order; p itself
    /// when the residual is empty (p ≤ q everywhere, which rejection never reaches).
    pub fn sample_residual(&self, q: &TargetDistribution, u: f64) -> u32 {
        let residual: Vec<f64> = self
            .ids
            .iter()
            .zip(&self.probs)
            .map(|(&id, &p)| (p - q.prob(id)).max(0.0))
            .collect();
        let total: f64 = residual.iter().sum();
        if total <= 0.0 {
            return self.sample(u);
        }
        let target = u * total;
        let mut cum = 0f64;
        for (&id, &r) in self.ids.iter().zip(&residual) {
            cum += r;
            if cum > target && r > 0.0 {
                return id;
            }
        }
        let last = residual.iter().rposition(|&r| r > 0.0).expect("total > 0");
        self.ids[last]
    }
}

/// Standard Gumbel noise for `token` at `position` of a sequence seeded `seed`.
fn gumbel(seed: u64, position: u64, token: u32) -> f64 {
    let h = splitmix64(
        seed ^ splitmix64(position ^ splitmix64(STREAM_GUMBEL ^ splitmix64(token as u64))),
    );
    // In (0, 1): the half offset keeps ln away from 0 and 1.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -(-u.ln()).ln()
}

/// The Gumbel-max draw from `dist` at `position`: argmax of ln p + G(seed, position, id),
/// ties by id. Exactly a sample of `dist`, and a function of (seed, position, dist) alone —
/// a draft model that picks with the same noise agrees with it as often as the two
/// distributions allow.
pub fn gumbel_pick(dist: &TargetDistribution, seed: u64, position: u64) -> u32 {
    let mut best = (f64::NEG_INFINITY, u32::MAX);
    for (&id, &p) in dist.ids.iter().zip(&dist.probs) {
        if p <= 0.0 {
            continue;
        }
        let key = p.ln() + gumbel(seed, position, id);
        if key > best.0 || (key == best.0 && id < best.1) {
            best = (key, id);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{Sampler, uniform};

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 7,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn inverse_cdf_draws_are_the_samplers_draws() {
        // The same cuts and order as `Sampler::sample`, so the same token for the same draw.
        // Distinct values, so top-k's cut never falls inside a tie (the sampler's select
        // leaves the order of tied candidates at the cut unspecified).
        let logits: Vec<f32> = (0..300u64)
            .map(|i| (splitmix64(i) % 997) as f32 * 0.01 + i as f32 * 1e-5)
            .collect();
        let mut sampler = Sampler::default();
        for p in [
            params(1.0, 0, 1.0, 0.0),
            params(0.7, 20, 1.0, 0.0),
            params(1.3, 0, 0.9, 0.0),
            params(1.0, 50, 0.8, 0.05),
        ] {
            let dist = TargetDistribution::new(&logits, &p);
            for position in 0..200 {
                let u = uniform(p.seed, position, crate::sampling::STREAM_SAMPLE);
                assert_eq!(
                    dist.sample(u),
                    sampler.sample(&logits, &p, position),
                    "{p:?} at {position}"
                );
            }
        }
    }

    #[test]
    fn gumbel_picks_follow_the_distribution() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0];
        let dist = TargetDistribution::new(&logits, &params(1.0, 0, 1.0, 0.0));
        let n = 100_000;
        let mut counts = [0usize; 5];
        for position in 0..n {
            counts[gumbel_pick(&dist, 3, position) as usize] += 1;
        }
        for (id, &c) in counts.iter().enumerate() {
            let want = dist.prob(id as u32);
            let got = c as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {id}: {got} vs {want}");
        }
    }
}
