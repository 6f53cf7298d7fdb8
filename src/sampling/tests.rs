use std::collections::HashSet;

use super::distribution_tests::{DISTRIBUTION_LOGITS, context, expected_distribution};
use super::*;

/// The sampler as it was before the processors and min-p, verbatim: `Sampler::sample`
/// must keep drawing exactly what it drew (seeded goldens depend on it).
fn legacy_sample(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if params.temperature == 0.0 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v / params.temperature))
        .collect();
    if params.top_k > 0 && params.top_k < c.len() {
        c.select_nth_unstable_by(params.top_k - 1, |a, b| b.1.total_cmp(&a.1));
        c.truncate(params.top_k);
    }
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
    c.last().unwrap().0
}

/// Deterministic pseudo-random logits in [-scale, scale), rounded to a multiple of `step`
/// when it is > 0 (ties on purpose).
fn logits_from(seed: u64, vocab_size: usize, scale: f32, step: f32) -> Vec<f32> {
    (0..vocab_size)
        .map(|i| {
            let v = (2.0 * uniform(seed, i as u64, 7) as f32 - 1.0) * scale;
            if step > 0.0 {
                (v / step).round() * step
            } else {
                v
            }
        })
        .collect()
}

fn log_softmax_f64(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits.iter().map(|&v| v as f64 - max - z.ln()).collect()
}

#[test]
fn greedy_picks_the_maximum() {
    let mut s = Sampler::default();
    assert_eq!(
        s.sample(&[0.1, 3.0, -1.0, 2.9], &SamplingParams::default(), 0),
        1
    );
    assert_eq!(argmax(&[1.0, 2.0, 2.0, 0.0]), 1, "the first of tied maxima");
    assert_eq!(argmax(&[1.0, f32::NAN, 2.0, 2.0]), 2, "NaN never wins");
    assert_eq!(
        argmax(&[f32::NAN, 5.0]),
        0,
        "as the first sampler: nothing beats a NaN at 0"
    );
    assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
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
        a.iter().collect::<HashSet<_>>().len() > 3,
        "draws vary by position: {a:?}"
    );
    let other_seed = SamplingParams { seed: 43, ..p };
    let c: Vec<u32> = (0..20)
        .map(|pos| s.sample(&logits, &other_seed, pos))
        .collect();
    assert_ne!(a, c, "draws vary by seed");
}

#[test]
fn streams_draw_independently() {
    let draws = [STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT].map(|s| uniform(9, 3, s));
    assert_eq!(STREAM_SAMPLE, 0);
    assert!(draws[0] != draws[1] && draws[1] != draws[2] && draws[0] != draws[2]);
    assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
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
fn sample_draws_exactly_what_the_first_sampler_drew() {
    let mut s = Sampler::default();
    let mut num_checked = 0;
    for (case, &(vocab_size, step)) in [(3000, 0.25f32), (49_152, 0.001), (100, 0.0), (7, 1.0)]
        .iter()
        .enumerate()
    {
        let mut logits = logits_from(case as u64, vocab_size, 12.0, step);
        if vocab_size > 100 {
            logits[5] = f32::NEG_INFINITY;
            logits[6] = f32::NEG_INFINITY;
        }
        for temperature in [0.0, 0.37, 1.0, 1.7] {
            for top_k in [0, 1, 3, 50, 2999, 5000] {
                for top_p in [1.0, 0.95, 0.5, 0.05] {
                    let params = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed: 1000 + case as u64,
                        ..Default::default()
                    };
                    let num_positions = if vocab_size > 10_000 { 3 } else { 20 };
                    for pos in 0..num_positions {
                        let want = legacy_sample(&logits, &params, pos);
                        assert_eq!(s.sample(&logits, &params, pos), want, "{params:?} @ {pos}");
                        let row = s.sample_row(&logits, &params, &context(pos, &[], &[]));
                        assert_eq!(row.token, want, "sample_row: {params:?} @ {pos}");
                        num_checked += 1;
                    }
                }
            }
        }
    }
    assert!(num_checked > 5000);
}

#[test]
fn top_logprobs_are_normalized_and_sorted() {
    let lp = top_logprobs(&[0.0, 1.0, 2.0], 3);
    assert_eq!(lp.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 1, 0]);
    let total: f32 = lp.iter().map(|e| e.1.exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    let tied = top_logprobs(&[1.0, 2.0, 1.0, 2.0, 1.0], 3);
    assert_eq!(tied.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3, 0]);
}

#[test]
fn logit_bias_forces_and_excludes_tokens() {
    let logits = [0.0, 5.0, 1.0, -3.0];
    let mut s = Sampler::default();
    let force = SamplingParams {
        temperature: 1.0,
        logit_bias: vec![(3, 100.0)],
        ..Default::default()
    };
    let exclude = SamplingParams {
        temperature: 1.0,
        logit_bias: vec![(1, -100.0)],
        ..Default::default()
    };
    let mut seen = HashSet::new();
    for pos in 0..2000 {
        assert_eq!(
            s.sample_row(&logits, &force, &context(pos, &[], &[])).token,
            3
        );
        let t = s
            .sample_row(&logits, &exclude, &context(pos, &[], &[]))
            .token;
        assert_ne!(t, 1);
        seen.insert(t);
    }
    assert_eq!(seen.len(), 3, "the other tokens still appear: {seen:?}");
    let greedy = SamplingParams {
        logit_bias: vec![(1, -100.0)],
        ..Default::default()
    };
    assert_eq!(
        s.sample_row(&logits, &greedy, &context(0, &[], &[])).token,
        2
    );
}

#[test]
fn banned_ids_are_never_sampled() {
    let logits = logits_from(3, 64, 4.0, 0.0001);
    let top = argmax(&logits);
    let banned = [top, 0, 1, 2, 3];
    let mut s = Sampler::default();
    for params in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.5,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 3,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_p: 0.3,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.5,
            min_p: 0.5,
            ..Default::default()
        },
    ] {
        for pos in 0..3000 {
            let ctx = SampleContext {
                position: pos,
                banned_ids: &banned,
                ..Default::default()
            };
            let out = s.sample_row(&logits, &params, &ctx);
            assert!(
                !banned.contains(&out.token),
                "{params:?} drew banned {}",
                out.token
            );
        }
    }
}

#[test]
fn greedy_is_the_argmax_of_the_processed_logits() {
    let logits = [3.0, 2.9, 1.0];
    let mut s = Sampler::default();
    let presence = SamplingParams {
        presence_penalty: 0.5,
        num_top_logprobs: 3,
        ..Default::default()
    };
    let out = s.sample_row(&logits, &presence, &context(0, &[], &[0]));
    assert_eq!(out.token, 1);
    // Logprobs of softmax([2.5, 2.9, 1.0]): no temperature, the penalty included.
    let want = log_softmax_f64(&[2.5, 2.9, 1.0]);
    assert!((out.logprob as f64 - want[1]).abs() < 1e-6);
    let ids: Vec<u32> = out.top_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![1, 0, 2]);
    for &(id, lp) in &out.top_logprobs {
        assert!((lp as f64 - want[id as usize]).abs() < 1e-6);
    }
    let repetition = SamplingParams {
        repetition_penalty: 1.2,
        ..Default::default()
    };
    assert_eq!(
        s.sample_row(&logits, &repetition, &context(0, &[0], &[]))
            .token,
        1
    );
    assert_eq!(
        s.sample(&logits, &repetition, 0),
        0,
        "sample has no history"
    );
}

#[test]
fn sampled_logprobs_sum_to_one_over_the_kept_set() {
    let logits = DISTRIBUTION_LOGITS;
    let mut s = Sampler::default();
    for (params, num_kept) in [
        (
            SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
            10,
        ),
        (
            SamplingParams {
                temperature: 1.0,
                top_k: 4,
                ..Default::default()
            },
            4,
        ),
        (
            SamplingParams {
                temperature: 1.0,
                top_p: 0.8,
                ..Default::default()
            },
            5,
        ),
        (
            SamplingParams {
                temperature: 1.0,
                min_p: 0.1,
                ..Default::default()
            },
            7,
        ),
    ] {
        let params = SamplingParams {
            num_top_logprobs: 20,
            ..params
        };
        for pos in 0..20 {
            let out = s.sample_row(&logits, &params, &context(pos, &[], &[]));
            assert_eq!(out.top_logprobs.len(), num_kept, "{params:?}");
            let total: f64 = out.top_logprobs.iter().map(|e| (e.1 as f64).exp()).sum();
            assert!((total - 1.0).abs() < 1e-5, "{params:?}: Σp = {total}");
            let listed = out.top_logprobs.iter().find(|e| e.0 == out.token).unwrap();
            assert_eq!(listed.1, out.logprob);
            let want = expected_distribution(&params);
            for &(id, lp) in &out.top_logprobs {
                assert!((lp.exp() as f64 - want[id as usize]).abs() < 1e-5);
            }
            assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
        }
    }
}

#[test]
fn raw_logprobs_are_the_log_softmax_of_the_unprocessed_logits() {
    let logits = logits_from(11, 1000, 8.0, 0.0001);
    let want = log_softmax_f64(&logits);
    let mut s = Sampler::default();
    for greedy in [true, false] {
        let params = SamplingParams {
            temperature: if greedy { 0.0 } else { 0.8 },
            top_k: 10,
            presence_penalty: 1.0,
            logit_bias: vec![(5, 3.0)],
            num_top_logprobs: 20,
            raw_logprobs: true,
            seed: 5,
            ..Default::default()
        };
        let out = s.sample_row(&logits, &params, &context(4, &[], &[1, 2, 3]));
        assert!((out.logprob as f64 - want[out.token as usize]).abs() < 1e-5);
        assert_eq!(out.top_logprobs, top_logprobs(&logits, 20));
        assert_eq!(out.top_logprobs.len(), 20);
        for &(id, lp) in &out.top_logprobs {
            assert!((lp as f64 - want[id as usize]).abs() < 1e-5);
        }
        let processed_out = s.sample_row(
            &logits,
            &SamplingParams {
                raw_logprobs: false,
                ..params
            },
            &context(4, &[], &[1, 2, 3]),
        );
        assert_eq!(
            processed_out.token, out.token,
            "raw_logprobs does not change the draw"
        );
        assert_ne!(processed_out.top_logprobs, out.top_logprobs);
    }
}

#[test]
fn results_do_not_depend_on_earlier_calls() {
    let logits = logits_from(21, 5000, 6.0, 0.01);
    let prompt: Vec<u32> = (0..300).map(|i| (i * 7) % 5000).collect();
    let output: Vec<u32> = (0..100).map(|i| (i * 13) % 700).collect();
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.9,
        min_p: 0.01,
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: -0.3,
        logit_bias: vec![(17, 4.0)],
        num_top_logprobs: 5,
        seed: 77,
        ..Default::default()
    };
    let ctx = context(12, &prompt, &output);
    let fresh = Sampler::default().sample_row(&logits, &params, &ctx);
    let mut used = Sampler::default();
    for (i, vocab_size) in [9000, 10, 5000, 70_000].into_iter().enumerate() {
        let other = logits_from(i as u64, vocab_size, 3.0, 0.5);
        let other_params = SamplingParams {
            temperature: 1.1,
            top_k: 7,
            repetition_penalty: 0.7,
            frequency_penalty: 1.0,
            ..Default::default()
        };
        used.sample_row(
            &other,
            &other_params,
            &context(i as u64, &[1, 2, 9], &[3, 3, 4, 9999]),
        );
    }
    assert_eq!(used.sample_row(&logits, &params, &ctx), fresh);
    assert_eq!(used.sample_row(&logits, &params, &ctx), fresh, "and again");
}
