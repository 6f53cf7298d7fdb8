//! The CUDA backend's sampling kernel against the CPU sampler (the reference): the same
//! logits and parameters must give the same tokens and logprobs. Needs a GPU: it runs on
//! the device machine (`scripts/gpu-tests.sh`); CI compiles it.
#![cfg(feature = "cuda")]

use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::{Backend, PickRow};
use troupe::sampling::{SampleContext, Sampler, SamplingParams, splitmix64};

/// Roughly normal logits (a sum of four uniforms), scaled; `step` > 0 rounds them to
/// multiples of it, so many values tie.
fn logits(seed: u64, vocab: usize, scale: f32, step: f32) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            let mut z = 0.0f32;
            for k in 0..4 {
                let h = splitmix64(seed ^ splitmix64(i * 4 + k));
                z += (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            let v = z * scale;
            if step > 0.0 {
                (v / step).round() * step
            } else {
                v
            }
        })
        .collect()
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        ..SamplingParams::default()
    }
}

/// Every combination of cuts, on distributions flat and peaked, with and without ties.
fn cases() -> Vec<(Vec<f32>, SamplingParams, u64)> {
    let mut out = Vec::new();
    let vocabs = [151_936, 32_000, 1000];
    let mut n = 0u64;
    for (v, &vocab) in vocabs.iter().enumerate() {
        for (scale, step) in [(1.0, 0.0), (12.0, 0.0), (6.0, 0.25)] {
            for (t, k, p, m) in [
                (1.0, 0, 1.0, 0.0),
                (0.7, 0, 0.9, 0.0),
                (1.3, 0, 1.0, 0.05),
                (0.6, 0, 0.95, 0.02),
                (0.0, 0, 1.0, 0.0),
            ] {
                n += 1;
                let x = logits(n * 7919 + v as u64, vocab, scale, step);
                out.push((x, params(t, k, p, m, n), 100 + n));
            }
            // top-k cuts on values without ties (which tied ids a cut keeps is the
            // CPU select's choice, not a contract).
            if step == 0.0 {
                for (t, k, p) in [(0.8, 50, 1.0), (1.0, 1, 1.0), (0.9, 40, 0.8)] {
                    n += 1;
                    let x = logits(n * 7919 + v as u64, vocab, scale, step);
                    out.push((x, params(t, k, p, 0.0, n), 100 + n));
                }
            }
        }
    }
    out
}

#[test]
fn device_sampling_draws_what_the_cpu_sampler_draws() {
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let cases = cases();
    let mut mismatches = Vec::new();
    // One launch per vocabulary size, every case of it a row.
    for vocab in [151_936, 32_000, 1000] {
        let group: Vec<_> = cases.iter().filter(|c| c.0.len() == vocab).collect();
        let flat: Vec<f32> = group.iter().flat_map(|c| c.0.iter().copied()).collect();
        let logits_d = backend.upload(&flat);
        // Rows in reverse so that row index and pick index differ.
        let rows: Vec<PickRow<'_>> = (0..group.len())
            .rev()
            .map(|i| PickRow {
                row: i,
                params: &group[i].1,
                position: group[i].2,
                verified_row: None,
                draft: None,
                mask: None,
            })
            .collect();
        let picks = backend.pick_rows(&logits_d, vocab, &rows)();
        let mut sampler = Sampler::default();
        for (r, &(token, logprob)) in rows.iter().zip(&picks) {
            let (x, p, position) = group[r.row];
            let want = sampler.sample_row(
                x,
                p,
                &SampleContext {
                    position: *position,
                    ..Default::default()
                },
            );
            if token != want.token || (logprob - want.logprob).abs() > 1e-4 {
                mismatches.push(format!(
                    "vocab {vocab} row {} ({p:?}): device ({token}, {logprob}), cpu ({}, {})",
                    r.row, want.token, want.logprob
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} rows differ:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
}

#[test]
fn device_sampling_of_one_row_follows_its_seed_and_position_only() {
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let vocab = 32_000;
    let x = logits(5, vocab, 1.0, 0.0);
    let p = params(1.0, 0, 0.95, 0.0, 42);
    // The same row alone, then among 40 copies with other seeds.
    let alone = {
        let d = backend.upload(&x);
        backend.pick_rows(
            &d,
            vocab,
            &[PickRow {
                row: 0,
                params: &p,
                position: 9,
                verified_row: None,
                draft: None,
                mask: None,
            }],
        )()
    };
    let others: Vec<SamplingParams> = (0..40).map(|s| params(1.0, 0, 0.95, 0.0, s)).collect();
    let flat: Vec<f32> = (0..41).flat_map(|_| x.iter().copied()).collect();
    let d = backend.upload(&flat);
    let mut rows: Vec<PickRow<'_>> = others
        .iter()
        .enumerate()
        .map(|(i, q)| PickRow {
            row: i + 1,
            params: q,
            position: 9,
            verified_row: None,
            draft: None,
            mask: None,
        })
        .collect();
    rows.insert(
        17,
        PickRow {
            row: 0,
            params: &p,
            position: 9,
            verified_row: None,
            draft: None,
            mask: None,
        },
    );
    let picks = backend.pick_rows(&d, vocab, &rows)();
    assert_eq!(picks[17], alone[0]);
    // Other seeds draw other tokens (a flat distribution: 40 equal draws would mean the
    // seed is ignored).
    let distinct: std::collections::HashSet<u32> = picks.iter().map(|p| p.0).collect();
    assert!(
        distinct.len() > 10,
        "{} distinct tokens of 41",
        distinct.len()
    );
}

/// Rejection acceptance at one position (an n-gram draft, q one-hot): the device keeps the
/// draft or draws from the rest as `spec::verify::rejection_pick` does.
#[test]
fn device_rejection_keeps_or_replaces_each_draft_as_the_cpu_verifier_does() {
    use troupe::spec::TargetDistribution;
    use troupe::spec::verify::rejection_pick;
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let cases: Vec<_> = cases().into_iter().filter(|c| !c.1.is_greedy()).collect();
    let (mut mismatches, mut kept, mut replaced) = (Vec::new(), 0, 0);
    for vocab in [151_936, 32_000, 1000] {
        let group: Vec<_> = cases.iter().filter(|c| c.0.len() == vocab).collect();
        let flat: Vec<f32> = group.iter().flat_map(|c| c.0.iter().copied()).collect();
        let logits_d = backend.upload(&flat);
        let mut sampler = Sampler::default();
        // Per case: the most likely token, the plain draw at this position (the residual
        // walk then passes the draft), and an arbitrary id.
        let mut rows = Vec::new();
        for (i, (x, p, position)) in group.iter().enumerate() {
            let argmax = troupe::sampling::argmax(x);
            let plain = sampler
                .sample_row(
                    x,
                    p,
                    &SampleContext {
                        position: *position,
                        ..Default::default()
                    },
                )
                .token;
            let other = (splitmix64(*position) % vocab as u64) as u32;
            for draft in [argmax, plain, other] {
                rows.push(PickRow {
                    row: i,
                    params: p,
                    position: *position,
                    verified_row: None,
                    draft: Some(draft),
                    mask: None,
                });
            }
        }
        let picks = backend.pick_rows(&logits_d, vocab, &rows)();
        for (r, &(token, logprob)) in rows.iter().zip(&picks) {
            let (x, p, position) = group[r.row];
            let draft = r.draft.expect("every row has a draft");
            let target = TargetDistribution::new(x, p);
            let q = TargetDistribution::one_hot(draft);
            let want = rejection_pick(&target, draft, &q, p.seed, *position);
            let want_lp = target.prob(want).ln() as f32;
            if want == draft {
                kept += 1;
            } else {
                replaced += 1;
            }
            if token != want || (logprob - want_lp).abs() > 1e-4 {
                mismatches.push(format!(
                    "vocab {vocab} row {} draft {draft} ({p:?}): device ({token}, {logprob}), cpu ({want}, {want_lp})",
                    r.row
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} rows differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    assert!(
        kept > 10 && replaced > 10,
        "kept {kept}, replaced {replaced}"
    );
}

/// Whatever the draft, rejection sampling's output is distributed as the target: counts
/// over many seeds against the softmax computed here, by a χ² statistic.
#[test]
fn device_rejection_leaves_the_target_distribution_unchanged() {
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let x = [2.0f32, 1.5, 1.2, 0.4, 0.0, -0.7, -1.0, -2.5];
    let logits_d = backend.upload(&x);
    let n = 40_000u64;
    for (temperature, top_k, draft) in [(0.8f32, 0usize, 1u32), (1.0, 5, 0), (1.3, 0, 6)] {
        let params: Vec<SamplingParams> = (0..n)
            .map(|s| params(temperature, top_k, 1.0, 0.0, 1000 + s))
            .collect();
        let rows: Vec<PickRow<'_>> = params
            .iter()
            .map(|p| PickRow {
                row: 0,
                params: p,
                position: 3,
                verified_row: None,
                draft: Some(draft),
                mask: None,
            })
            .collect();
        let picks = backend.pick_rows(&logits_d, x.len(), &rows)();
        let kept = if top_k > 0 { top_k } else { x.len() };
        let weights: Vec<f64> = x[..kept]
            .iter()
            .map(|&v| (v as f64 / temperature as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut counts = vec![0u64; x.len()];
        for &(t, _) in &picks {
            counts[t as usize] += 1;
        }
        assert!(
            counts[kept..].iter().all(|&c| c == 0),
            "cut tokens drawn: {counts:?}"
        );
        let chi2: f64 = weights
            .iter()
            .zip(&counts)
            .map(|(w, &c)| {
                let e = w / total * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        // 7 degrees of freedom at most: P(χ² > 30) < 1e-4.
        assert!(
            chi2 < 30.0,
            "t {temperature} top_k {top_k} draft {draft}: χ² {chi2}, counts {counts:?}"
        );
    }
}

/// Rows under a grammar's mask (a bit per allowed id): the device draws what the CPU
/// sampler draws from the same logits with the forbidden ids at −∞, greedy or sampled, a
/// draft verified by rejection included.
#[test]
fn device_sampling_under_a_mask_draws_what_the_cpu_sampler_draws_from_masked_logits() {
    use troupe::spec::TargetDistribution;
    use troupe::spec::verify::rejection_pick;
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let (mut mismatches, mut total) = (Vec::new(), 0);
    for vocab in [151_936, 32_000, 1000] {
        let group: Vec<_> = cases().into_iter().filter(|c| c.0.len() == vocab).collect();
        let flat: Vec<f32> = group.iter().flat_map(|c| c.0.iter().copied()).collect();
        let logits_d = backend.upload(&flat);
        // Per case a mask keeping every id with probability 1/3, or only 5 ids.
        let masks: Vec<Vec<u32>> = (0..group.len())
            .map(|i| {
                let mut bits = vec![0u32; vocab.div_ceil(32)];
                for id in 0..vocab {
                    let h = splitmix64((i as u64) << 32 | id as u64);
                    let keep = if i % 2 == 0 {
                        h.is_multiple_of(3)
                    } else {
                        h.is_multiple_of(vocab as u64 / 5) || id == 0
                    };
                    if keep {
                        bits[id / 32] |= 1 << (id % 32);
                    }
                }
                bits
            })
            .collect();
        let masked: Vec<Vec<f32>> = group
            .iter()
            .zip(&masks)
            .map(|((x, _, _), bits)| {
                x.iter()
                    .enumerate()
                    .map(|(id, &v)| {
                        if bits[id / 32] >> (id % 32) & 1 == 1 {
                            v
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect()
            })
            .collect();
        let mut sampler = Sampler::default();
        let mut rows = Vec::new();
        let mut want = Vec::new();
        for (i, (_, p, position)) in group.iter().enumerate() {
            let plain = sampler.sample_row(
                &masked[i],
                p,
                &SampleContext {
                    position: *position,
                    ..Default::default()
                },
            );
            want.push((plain.token, plain.logprob));
            rows.push(PickRow {
                row: i,
                params: p,
                position: *position,
                verified_row: None,
                draft: None,
                mask: Some(&masks[i]),
            });
            if !p.is_greedy() {
                // Id 0 (forbidden by some masks: then always replaced) and the masked argmax.
                for draft in [0u32, troupe::sampling::argmax(&masked[i])] {
                    let target = TargetDistribution::new(&masked[i], p);
                    let q = TargetDistribution::one_hot(draft);
                    let token = rejection_pick(&target, draft, &q, p.seed, *position);
                    want.push((token, target.prob(token).ln() as f32));
                    rows.push(PickRow {
                        row: i,
                        params: p,
                        position: *position,
                        verified_row: None,
                        draft: Some(draft),
                        mask: Some(&masks[i]),
                    });
                }
            }
        }
        let picks = backend.pick_rows(&logits_d, vocab, &rows)();
        for ((r, &(token, logprob)), &(want_token, want_lp)) in rows.iter().zip(&picks).zip(&want) {
            total += 1;
            let allowed = masks[r.row][token as usize / 32] >> (token % 32) & 1 == 1;
            if !allowed || token != want_token || (logprob - want_lp).abs() > 1e-4 {
                mismatches.push(format!(
                    "vocab {vocab} row {} draft {:?} ({:?}): device ({token}, {logprob}), cpu ({want_token}, {want_lp}), allowed {allowed}",
                    r.row, r.draft, r.params
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {total} rows differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

/// A draft model's greedy rows: the argmax and its log-softmax, any rows in any order,
/// without touching the picks the next step's embedding reads.
#[test]
fn greedy_rows_pick_the_argmax_and_leave_the_last_picks_alone() {
    let backend = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let vocab = 32_000;
    let rows: Vec<Vec<f32>> = (0..7).map(|i| logits(900 + i, vocab, 4.0, 0.0)).collect();
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    let d = backend.upload(&flat);
    let greedy = SamplingParams::default();
    let before = backend.pick_rows(
        &d,
        vocab,
        &[PickRow {
            row: 3,
            params: &greedy,
            position: 0,
            verified_row: None,
            draft: None,
            mask: None,
        }],
    )();
    let wanted = [5usize, 0, 6, 2];
    let got = backend.greedy_rows(&d, vocab, &wanted);
    assert_eq!(got.len(), wanted.len());
    for (&(token, logprob), &r) in got.iter().zip(&wanted) {
        let x = &rows[r];
        let want = troupe::sampling::argmax(x);
        let want_lp = x[want as usize] - troupe::sampling::log_sum_exp(x);
        assert_eq!(token, want, "row {r}");
        assert!(
            (logprob - want_lp).abs() < 1e-4,
            "row {r}: {logprob} vs {want_lp}"
        );
    }
    assert_eq!(
        backend.device_picks().unwrap().read_picks(0, 1),
        vec![before[0].0]
    );
}
