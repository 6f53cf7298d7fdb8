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
        })
        .collect();
    rows.insert(
        17,
        PickRow {
            row: 0,
            params: &p,
            position: 9,
            verified_row: None,
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
