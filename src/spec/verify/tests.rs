use super::*;
use crate::sampling::{STREAM_DRAFT, SampleContext, SamplingParams, splitmix64};

fn sampled(temperature: f32, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        ..SamplingParams::default()
    }
}

fn dist(logits: &[f32]) -> TargetDistribution {
    TargetDistribution::new(logits, &sampled(1.0, 1.0))
}

#[test]
fn greedy_accepts_the_matching_prefix_then_corrects() {
    let greedy_params = SamplingParams::default();
    let row = |best: usize| {
        let mut l = vec![0.0f32; 8];
        l[best] = 5.0;
        TargetDistribution::new(&l, &greedy_params)
    };
    let targets = [row(3), row(4), row(6), row(1)];
    assert_eq!(
        greedy(&targets, &[3, 4, 5]),
        Verified {
            tokens: vec![3, 4, 6],
            num_accepted: 2
        }
    );
    assert_eq!(
        greedy(&targets, &[3, 4, 6]),
        Verified {
            tokens: vec![3, 4, 6, 1],
            num_accepted: 3
        },
        "all accepted: the bonus token follows"
    );
    assert_eq!(greedy(&targets[..1], &[]).tokens, vec![3]);
}

/// χ² of observed counts against probabilities.
fn chi_squared(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn rejection_sampling_keeps_the_target_distribution() {
    // A context-free toy target, so every emitted token should be distributed as p.
    let p = dist(&[1.5, 0.3, -0.2, 0.9, 0.0, -1.0]);
    let q = dist(&[-0.5, 1.2, 0.8, 0.1, -0.3, 0.4]);
    let probs: Vec<f64> = (0..6).map(|t| p.prob(t)).collect();
    let trials = 40_000u64;
    let (mut first, mut second) = ([0usize; 6], [0usize; 6]);
    let (mut first_det, mut num_accepted) = ([0usize; 6], 0);
    for seed in 0..trials {
        // Three drafts drawn from q with the draft stream.
        let drafts: Vec<u32> = (0..3)
            .map(|i| q.sample(uniform(seed, 10 + i, STREAM_DRAFT)))
            .collect();
        let targets = vec![p.clone(); 4];
        let out = rejection(&targets, &drafts, Some(&vec![q.clone(); 3]), seed, 10);
        first[out.tokens[0] as usize] += 1;
        if out.tokens.len() > 1 {
            second[out.tokens[1] as usize] += 1;
        }
        num_accepted += out.num_accepted;
        // A deterministic drafter that always proposes token 1.
        let out = rejection(&targets, &[1, 1, 1], None, seed, 10);
        first_det[out.tokens[0] as usize] += 1;
    }
    // 5 degrees of freedom: P(χ² > 20.5) = 0.001.
    for (name, counts) in [
        ("first, drafts from q", &first),
        ("second, drafts from q", &second),
        ("first, one-hot drafts", &first_det),
    ] {
        let x2 = chi_squared(counts, &probs);
        assert!(
            x2 < 20.5,
            "{name}: χ² = {x2:.1}, counts {counts:?}, p {probs:?}"
        );
    }
    // Acceptance of the first draft is Σ min(p, q) in expectation.
    let overlap: f64 = (0..6).map(|t| p.prob(t).min(q.prob(t))).sum();
    assert!(num_accepted as f64 / trials as f64 > overlap * 0.9);
}

/// A toy Markov "model": the next token's distribution depends on the previous token.
fn markov(prev: u32, perturbed: bool) -> TargetDistribution {
    let logits: Vec<f32> = (0..16u64)
        .map(|v| {
            let h = splitmix64((prev as u64) << 8 | v ^ if perturbed { 0x55 } else { 0 });
            (h % 1000) as f32 / 250.0
        })
        .collect();
    TargetDistribution::new(&logits, &sampled(0.8, 0.95))
}

/// Generates `len` tokens after `start` with speculation: `k(step)` drafts a step, drawn
/// by `draft(prev, position)`, verified by `coupled`.
fn generate(
    seed: u64,
    len: usize,
    k: impl Fn(usize) -> usize,
    draft: impl Fn(u32, u64) -> u32,
) -> (Vec<u32>, usize, usize) {
    let mut out: Vec<u32> = vec![0];
    let (mut drafted, mut accepted) = (0, 0);
    let mut step = 0;
    while out.len() <= len {
        let position = out.len() as u64;
        let mut drafts = Vec::new();
        let mut prev = *out.last().unwrap();
        for i in 0..k(step) {
            let d = draft(prev, position + i as u64);
            drafts.push(d);
            prev = d;
        }
        let mut targets = vec![markov(*out.last().unwrap(), false)];
        targets.extend(drafts.iter().map(|&d| markov(d, false)));
        let v = coupled(&targets, &drafts, seed, position);
        drafted += drafts.len();
        accepted += v.num_accepted;
        out.extend(v.tokens);
        step += 1;
    }
    out.truncate(len + 1);
    (out, drafted, accepted)
}

#[test]
fn coupled_output_does_not_depend_on_the_verify_length() {
    for seed in [1u64, 2, 99] {
        let (plain, _, _) = generate(seed, 300, |_| 0, |_, _| 0);
        // A draft model: the perturbed chain picked with the same Gumbel noise.
        let model = |prev: u32, pos: u64| gumbel_pick(&markov(prev, true), seed, pos);
        let garbage = |prev: u32, pos: u64| (splitmix64(prev as u64 ^ pos) % 16) as u32;
        for k in 1..=5 {
            assert_eq!(generate(seed, 300, |_| k, model).0, plain, "K = {k}");
            assert_eq!(generate(seed, 300, |_| k, garbage).0, plain, "K = {k}");
        }
        // A verify length that changes every step, as the confidence planner's does.
        let varying = |step: usize| (splitmix64(step as u64) % 6) as usize;
        assert_eq!(generate(seed, 300, varying, model).0, plain);
    }
}

#[test]
fn coupled_acceptance_against_rejection_sampling() {
    // Per draft: rejection accepts with Σ min(p, q) (the best any coupling can do); the
    // Gumbel coupling accepts when both picks agree.
    let mut rows = Vec::new();
    for prev in 0..16u32 {
        let (p, q) = (markov(prev, false), markov(prev, true));
        let overlap: f64 = (0..16).map(|t| p.prob(t).min(q.prob(t))).sum();
        let n = 4_000u64;
        let agree = (0..n)
            .filter(|&pos| gumbel_pick(&p, 5, pos) == gumbel_pick(&q, 5, pos))
            .count() as f64
            / n as f64;
        assert!(agree <= overlap + 0.03, "prev {prev}: {agree} > {overlap}");
        rows.push((overlap, agree));
    }
    let mean = |f: fn(&(f64, f64)) -> f64| rows.iter().map(f).sum::<f64>() / rows.len() as f64;
    let (rejection_rate, coupled_rate) = (mean(|r| r.0), mean(|r| r.1));
    println!(
        "per-draft acceptance: rejection sampling {rejection_rate:.3}, Gumbel coupling {coupled_rate:.3}"
    );
    assert!(coupled_rate > 0.5 * rejection_rate);
}

#[test]
fn sampler_coupled_verification_emits_what_plain_decoding_emits() {
    use crate::sampling::Sampler;
    let vocab = 40;
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 12,
        top_p: 0.9,
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.2,
        seed: 17,
        num_top_logprobs: 3,
        ..SamplingParams::default()
    };
    let prompt = [3u32, 4, 5];
    let generated = [7u32, 7, 9];
    let banned = [1u32, 2];
    // Rows as a model would give them; context-free here: the plain run reads the same.
    let rows: Vec<Vec<f32>> = (0..6u64)
        .map(|r| {
            (0..vocab as u64)
                .map(|v| (splitmix64(r << 16 | v) % 1000) as f32 / 200.0)
                .collect()
        })
        .collect();
    let row_refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
    let history = History {
        prompt_ids: &prompt,
        output_ids: &generated,
        banned_ids: &banned,
        ban_below_len: 5,
        mask: None,
    };
    // Plain decoding, one token a step.
    let mut sampler = Sampler::default();
    let mut plain = Vec::new();
    let mut out_ids = generated.to_vec();
    for (i, row) in rows.iter().enumerate() {
        let ctx = SampleContext {
            position: 20 + i as u64,
            prompt_ids: &prompt,
            output_ids: &out_ids,
            banned_ids: if out_ids.len() < 5 { &banned } else { &[] },
        };
        let o = sampler.sample_row(row, &params, &ctx);
        out_ids.push(o.token);
        plain.push(o);
    }
    for num_right in 0..=5 {
        // The first `num_right` drafts are what plain decoding drew, then a wrong one.
        let mut drafts: Vec<u32> = plain[..num_right].iter().map(|o| o.token).collect();
        if num_right < 5 {
            drafts.push((plain[num_right].token + 1) % vocab as u32);
        }
        let k = drafts.len();
        let got = with_sampler(
            &mut sampler,
            &row_refs[..k + 1],
            &drafts,
            &params,
            20,
            history,
        );
        assert_eq!(
            got.len(),
            num_right + 1,
            "accepted {num_right}, then one more"
        );
        assert_eq!(
            got,
            plain[..num_right + 1],
            "tokens and logprobs as plain decoding"
        );
    }
}
