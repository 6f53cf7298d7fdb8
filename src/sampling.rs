//! Logits → token, per request: greedy, temperature, top-k, top-p, with a seeded
//! counter-based draw so a request's tokens never depend on what else shares its batch.

use crate::error::{Result, TroupeError};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
    /// How many of the most likely tokens to report with their log-probabilities.
    pub num_top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            num_top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(TroupeError::InvalidSampling(format!(
                "temperature must be a finite number ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(TroupeError::InvalidSampling(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if self.num_top_logprobs > 20 {
            return Err(TroupeError::InvalidSampling(format!(
                "top_logprobs must be at most 20, got {}",
                self.num_top_logprobs
            )));
        }
        Ok(())
    }
}

/// SplitMix64's finalizer: a strong 64-bit mix, the basis of counter-based draws.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from (seed, position, stream): the same triple always draws the same.
pub fn uniform(seed: u64, position: u64, stream: u64) -> f64 {
    let h = splitmix64(seed ^ splitmix64(position ^ splitmix64(stream)));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

pub const STREAM_SAMPLE: u64 = 0;

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `(id, log-probability)` of the `k` most likely tokens under `log_softmax(logits)`.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max
        + logits
            .iter()
            .map(|&v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    ids.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b as usize].total_cmp(&logits[a as usize])
    });
    ids.truncate(k);
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids.into_iter()
        .map(|i| (i, logits[i as usize] - log_z))
        .collect()
}

/// Reusable buffers so sampling allocates nothing per token.
#[derive(Default)]
pub struct Sampler {
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// Samples the token at `position` of a sequence.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
        if params.temperature == 0.0 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, v / params.temperature)),
        );
        if params.top_k > 0 && params.top_k < c.len() {
            c.select_nth_unstable_by(params.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            c.truncate(params.top_k);
        }
        // Descending by logit, ties by id: the order is a function of the logits alone.
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = c[0].1;
        let mut total = 0f64;
        for e in c.iter_mut() {
            e.1 = ((e.1 - max) as f64).exp() as f32;
            total += e.1 as f64;
        }
        if params.top_p < 1.0 {
            let mut cum = 0f64;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                cum += e.1 as f64 / total;
                if cum >= params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = c.iter().map(|e| e.1 as f64).sum();
        }
        let target = uniform(params.seed, position, STREAM_SAMPLE) * total;
        let mut cum = 0f64;
        for e in c.iter() {
            cum += e.1 as f64;
            if cum > target {
                return e.0;
            }
        }
        c.last().expect("at least one candidate").0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_maximum() {
        let mut s = Sampler::default();
        assert_eq!(
            s.sample(&[0.1, 3.0, -1.0, 2.9], &SamplingParams::default(), 0),
            1
        );
    }

    #[test]
    fn same_seed_and_position_draw_the_same_token() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let mut s = Sampler::default();
        let a: Vec<u32> = (0..20).map(|pos| s.sample(&logits, &p, pos)).collect();
        let b: Vec<u32> = (0..20).map(|pos| s.sample(&logits, &p, pos)).collect();
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 3,
            "draws vary by position: {a:?}"
        );
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_excludes_the_tail() {
        let logits = [1.0, 5.0, 0.5, 4.9];
        let mut s = Sampler::default();
        let k1 = SamplingParams {
            temperature: 2.0,
            top_k: 1,
            ..Default::default()
        };
        let p_small = SamplingParams {
            temperature: 1.0,
            top_p: 0.6,
            ..Default::default()
        };
        for pos in 0..100 {
            assert_eq!(s.sample(&logits, &k1, pos), 1);
            let t = s.sample(&logits, &p_small, pos);
            assert!(t == 1 || t == 3, "token {t} lies outside the top-p nucleus");
        }
    }

    #[test]
    fn top_logprobs_are_normalized_and_sorted() {
        let lp = top_logprobs(&[0.0, 1.0, 2.0], 3);
        assert_eq!(lp.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 1, 0]);
        let total: f32 = lp.iter().map(|e| e.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn invalid_parameters_are_named() {
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("temperature")
        );
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("top_p"));
    }
}
