//! The sampler's draws against the truncated distributions, from their definitions:
//! temperature, top-k, top-p and min-p (χ² over many seeded draws).

use super::*;

pub(super) fn context<'a>(
    position: u64,
    prompt: &'a [u32],
    output: &'a [u32],
) -> SampleContext<'a> {
    SampleContext {
        position,
        prompt_ids: prompt,
        output_ids: output,
        banned_ids: &[],
    }
}

/// A fixed row for the distribution tests; ids are not in value order on purpose.
pub(super) const DISTRIBUTION_LOGITS: [f32; 10] =
    [0.3, 2.0, -1.0, 1.2, 0.0, 1.5, -2.0, 0.6, 1.0, -0.5];

/// The truncated distribution, from its definition (f64, independent of the sampler).
pub(super) fn expected_distribution(params: &SamplingParams) -> Vec<f64> {
    let logits = DISTRIBUTION_LOGITS.map(|v| v as f64 / params.temperature as f64);
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut p: Vec<f64> = logits.iter().map(|v| (v - max).exp()).collect();
    let normalize = |p: &mut Vec<f64>| {
        let z: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= z);
    };
    normalize(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    if params.top_k > 0 {
        order[params.top_k..].iter().for_each(|&i| p[i] = 0.0);
        normalize(&mut p);
    }
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        for &i in &order {
            if cum >= params.top_p as f64 {
                p[i] = 0.0;
            }
            cum += p[i];
        }
        normalize(&mut p);
    }
    let p_max = p[order[0]];
    p.iter_mut()
        .filter(|x| **x < params.min_p as f64 * p_max)
        .for_each(|x| *x = 0.0);
    normalize(&mut p);
    p
}

/// χ² critical values at p = 0.001 by degrees of freedom (NIST/SEMATECH e-Handbook,
/// table 1.3.6.7.4, upper tail).
const CHI2_CRITICAL_0_001: [f64; 10] = [
    f64::NAN,
    10.828,
    13.816,
    16.266,
    18.467,
    20.515,
    22.458,
    24.322,
    26.124,
    27.877,
];

fn assert_samples_match(params: SamplingParams, num_kept: usize) {
    const NUM_DRAWS: u64 = 20_000;
    let want = expected_distribution(&params);
    assert_eq!(
        want.iter().filter(|&&x| x > 0.0).count(),
        num_kept,
        "reference"
    );
    let mut counts = [0u64; 10];
    let mut s = Sampler::default();
    for pos in 0..NUM_DRAWS {
        let t = s.sample_row(&DISTRIBUTION_LOGITS, &params, &context(pos, &[], &[]));
        counts[t.token as usize] += 1;
    }
    let mut chi2 = 0.0;
    for (id, (&count, &p)) in counts.iter().zip(&want).enumerate() {
        if p == 0.0 {
            assert_eq!(count, 0, "{params:?}: token {id} lies outside the kept set");
        } else {
            let expected = p * NUM_DRAWS as f64;
            assert!(expected >= 5.0, "χ² needs ≥ 5 expected per cell");
            chi2 += (count as f64 - expected).powi(2) / expected;
        }
    }
    let critical = CHI2_CRITICAL_0_001[num_kept - 1];
    assert!(
        chi2 < critical,
        "{params:?}: χ² = {chi2:.2} ≥ {critical} (df {}), counts {counts:?}, want {want:?}",
        num_kept - 1
    );
}

#[test]
fn temperature_draws_follow_the_scaled_softmax() {
    assert_samples_match(
        SamplingParams {
            temperature: 0.7,
            seed: 1234,
            ..Default::default()
        },
        10,
    );
}

#[test]
fn top_k_draws_follow_the_truncated_distribution() {
    assert_samples_match(
        SamplingParams {
            temperature: 1.0,
            top_k: 4,
            seed: 1234,
            ..Default::default()
        },
        4,
    );
}

#[test]
fn top_p_draws_follow_the_nucleus() {
    assert_samples_match(
        SamplingParams {
            temperature: 1.0,
            top_p: 0.8,
            seed: 1234,
            ..Default::default()
        },
        5,
    );
}

#[test]
fn min_p_draws_follow_the_truncated_distribution() {
    assert_samples_match(
        SamplingParams {
            temperature: 1.0,
            min_p: 0.1,
            seed: 1234,
            ..Default::default()
        },
        7,
    );
}

#[test]
fn min_p_is_relative_to_the_most_likely_token_after_the_cuts() {
    let logits = [0.0, 0.1, -2.3, -2.4, -5.0];
    let mut s = Sampler::default();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 4,
        min_p: 0.1,
        num_top_logprobs: 20,
        ..Default::default()
    };
    // exp(−2.3 − 0.1) = 0.0907 < 0.1 ≤ exp(−0.1): only tokens 0 and 1 survive.
    let out = s.sample_row(&logits, &params, &context(0, &[], &[]));
    let ids: Vec<u32> = out.top_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![1, 0]);
}
