//! Speculative decoding through the actor engine (n-gram drafter, every draft verified or
//! the confidence-scheduled share of them):
//! output equal to plain decoding — greedy against the one-at-a-time reference, seeded
//! sampling (tokens and logprobs) against the engine without speculation — with ZOS on
//! (verify rows continued in the next step, nothing sat out) and off, while drafts are
//! actually proposed and accepted; a sampler killed in the middle
//! of a verification changes nothing; configurations that cannot run are refused by name.

mod common;

use common::engine::{ok_outputs, reference_outputs, run_engine, tiny_config, tokens};
use troupe::engine::{
    Engine, EngineConfig, EngineRequest, EngineStatus, SpecAcceptance, SpecConfig, SpecMethod,
    SpecVerify,
};
use troupe::runner::fault::FaultPlan;
use troupe::sampling::{SamplingParams, splitmix64};

fn ngram(k: usize, verify: SpecVerify) -> Option<SpecConfig> {
    Some(SpecConfig {
        method: SpecMethod::Ngram,
        num_speculative_tokens: k,
        verify,
        acceptance: SpecAcceptance::Coupled,
    })
}

/// Prompts that repeat a random phrase, so prompt lookup has something to propose; the
/// tiny random models also fall into loops of their own, which it then follows.
fn repetitive_requests(
    n: usize,
    seed: u64,
    params: impl Fn(usize) -> SamplingParams,
) -> Vec<EngineRequest> {
    (0..n)
        .map(|i| {
            let h = |k: u64| splitmix64(seed ^ splitmix64(i as u64 * 1000 + k));
            let phrase: Vec<u32> = (0..3 + h(0) % 6)
                .map(|j| 3 + (h(10 + j) % 380) as u32)
                .collect();
            let repeats = 2 + (h(1) % 4) as usize;
            let prompt_ids = phrase
                .iter()
                .copied()
                .cycle()
                .take(phrase.len() * repeats)
                .collect();
            let max_tokens = 16 + (h(2) % 33) as usize;
            let mut r = EngineRequest::new(prompt_ids, max_tokens, params(i));
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// Drafts went through verification and some were kept: otherwise the comparisons above
/// would say nothing about speculation.
fn assert_speculated(status: &EngineStatus, what: &str) {
    assert!(
        status.num_spec_verify_rows > 0 && status.num_spec_accepted_tokens > 0,
        "{what}: no draft was verified and accepted: {status:?}"
    );
    assert!(status.num_spec_accepted_tokens <= status.num_spec_verified_tokens);
    assert!(status.num_spec_verified_tokens <= status.num_spec_draft_tokens);
    // Position 0 is verified on every verify row; acceptance thins out along the drafts.
    let (verified, accepted) = (
        status.spec_verified_by_position,
        status.spec_accepted_by_position,
    );
    assert_eq!(verified[0], status.num_spec_verify_rows);
    assert_eq!(
        verified.iter().sum::<u64>(),
        status.num_spec_verified_tokens
    );
    assert_eq!(
        accepted.iter().sum::<u64>(),
        status.num_spec_accepted_tokens
    );
    assert!(verified.windows(2).all(|w| w[0] >= w[1]) && accepted.windows(2).all(|w| w[0] >= w[1]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_with_ngram_speculation_equals_plain_decoding() {
    for model in ["tiny-llama", "tiny-qwen3"] {
        let requests = repetitive_requests(48, 5, |_| SamplingParams::default());
        let want = reference_outputs(model, &requests);
        for (zos, verify) in [
            (true, SpecVerify::Fixed),
            (false, SpecVerify::Fixed),
            (true, SpecVerify::Confidence),
        ] {
            let mut cfg = tiny_config(model);
            cfg.zero_overhead_scheduling = zos;
            cfg.speculative = ngram(4, verify);
            let (got, status) = run_engine(cfg, requests.clone()).await;
            assert_eq!(tokens(&got), want, "{model}, zos={zos}, {verify:?}");
            // Confidence scheduling verifies what the measured step times say pays, which
            // on these tiny CPU models may be nothing: fixed K must keep drafts.
            if verify == SpecVerify::Fixed {
                assert_speculated(&status, model);
            }
            // Under ZOS a verifying sequence is continued, never left out of a step.
            assert_eq!(status.num_spec_sat_out_rows, 0, "{model}, zos={zos}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_with_speculation_equals_plain_decoding_logprobs_included() {
    // Low temperatures on half the requests: the tiny random models are flat, and only
    // peaked rows accept drafts (the accepted path extends the history mid-row).
    let params = |i: usize| SamplingParams {
        temperature: if i.is_multiple_of(2) { 0.2 } else { 0.7 },
        top_p: 0.95,
        top_k: if i % 4 < 2 { 0 } else { 3 },
        repetition_penalty: if i.is_multiple_of(3) { 1.1 } else { 1.0 },
        ..SamplingParams::default()
    };
    let mut requests = repetitive_requests(32, 9, params);
    for (i, r) in requests.iter_mut().enumerate() {
        r.seed = Some(1000 + i as u64);
    }
    // A verify row's logits come from a multi-token row; outside the batch-invariant mode
    // the CPU's kernels for those round differently in the last bits, so logprobs agree
    // to 1e-4 there and bitwise in the invariant mode.
    for invariant in [false, true] {
        let mut base = tiny_config("tiny-llama");
        base.batch_invariant = invariant;
        let (want, _) = run_engine(base.clone(), requests.clone()).await;
        for (k, verify, zos) in [
            (1, SpecVerify::Fixed, true),
            (5, SpecVerify::Confidence, true),
            (5, SpecVerify::Fixed, false),
        ] {
            let mut cfg = base.clone();
            cfg.speculative = ngram(k, verify);
            cfg.zero_overhead_scheduling = zos;
            let (got, status) = run_engine(cfg, requests.clone()).await;
            // On a GPU outside the invariant mode a verify row's logits (a multi-row GEMM)
            // and a decode row's (a GEMV) round differently in bf16, and a seeded draw near
            // a boundary may flip: the identity holds bitwise in the invariant mode.
            let comparable =
                invariant || common::engine::test_device() == troupe::engine::Device::Cpu;
            if comparable {
                assert_eq!(tokens(&got), tokens(&want), "k={k}, invariant={invariant}");
            }
            for (g, w) in got.iter().zip(&want).filter(|_| comparable) {
                if invariant {
                    assert_eq!(g.token_logprobs, w.token_logprobs, "k={k}");
                } else {
                    let worst = g
                        .token_logprobs
                        .iter()
                        .zip(&w.token_logprobs)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    assert!(worst < 1e-4, "k={k}: logprobs differ by {worst}");
                }
            }
            // Sampled rows are verified by the sampler, so under ZOS their sequences sit
            // out the step after a verify row (their drafts follow known tokens); confidence
            // scheduling verifies what the measured step times say pays, which on these
            // tiny models may be nothing: every draft verified must keep some.
            if verify == SpecVerify::Fixed {
                assert_speculated(&status, "seeded");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_rows_drawn_on_the_device_continue_their_verify_rows_under_zos() {
    // No processors: where the backend draws seeded rows itself, their drafts are verified
    // by its picks, and the row after a verify row is planned at once, its draws' positions
    // moved back on the device by the drafts rejected. Elsewhere the sampler verifies them
    // and the sequence sits out a step.
    let params = |i: usize| SamplingParams {
        temperature: if i.is_multiple_of(2) { 0.2 } else { 0.6 },
        top_p: if i.is_multiple_of(3) { 1.0 } else { 0.9 },
        top_k: if i % 4 < 2 { 0 } else { 4 },
        ..SamplingParams::default()
    };
    let mut requests = repetitive_requests(24, 31, params);
    for (i, r) in requests.iter_mut().enumerate() {
        r.seed = Some(7000 + i as u64);
    }
    let mut base = tiny_config("tiny-llama");
    base.batch_invariant = true;
    let (want, _) = run_engine(base.clone(), requests.clone()).await;
    for verify in [SpecVerify::Fixed, SpecVerify::Confidence] {
        let mut cfg = base.clone();
        cfg.speculative = ngram(4, verify);
        let (got, status) = run_engine(cfg, requests.clone()).await;
        assert_eq!(tokens(&got), tokens(&want), "{verify:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.token_logprobs, w.token_logprobs, "{verify:?}");
        }
        if verify == SpecVerify::Fixed {
            assert_speculated(&status, "seeded, no processors");
            if common::engine::test_device() == troupe::engine::Device::Cpu {
                assert!(status.num_spec_sat_out_rows > 0, "{status:?}");
            }
        }
        if common::engine::test_device() != troupe::engine::Device::Cpu {
            assert_eq!(status.num_spec_sat_out_rows, 0, "{verify:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampler_killed_mid_verification_changes_no_output() {
    let requests = repetitive_requests(32, 21, |_| SamplingParams::default());
    let want = reference_outputs("tiny-llama", &requests);
    let faults = FaultPlan::default();
    let mut cfg = tiny_config("tiny-llama");
    cfg.speculative = ngram(4, SpecVerify::Fixed);
    let engine = Engine::spawn_with_faults(cfg, faults.clone())
        .await
        .unwrap();
    faults.panic_next_verify();
    let got = ok_outputs(&engine, requests).await;
    assert_eq!(tokens(&got), want);
    let status = engine.status().await.unwrap();
    assert!(
        status.num_resets >= 2,
        "the sampler was never restarted: {status:?}"
    );
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configurations_that_cannot_run_are_refused_by_name() {
    for (spec, needle) in [
        (
            SpecConfig {
                method: SpecMethod::DraftModel,
                num_speculative_tokens: 4,
                verify: SpecVerify::Fixed,
                acceptance: SpecAcceptance::Coupled,
            },
            "draft",
        ),
        (
            SpecConfig {
                method: SpecMethod::Mtp,
                num_speculative_tokens: 4,
                verify: SpecVerify::Fixed,
                acceptance: SpecAcceptance::Coupled,
            },
            "mtp",
        ),
        (
            SpecConfig {
                method: SpecMethod::Ngram,
                num_speculative_tokens: 0,
                verify: SpecVerify::Fixed,
                acceptance: SpecAcceptance::Coupled,
            },
            "num_speculative_tokens",
        ),
    ] {
        let mut cfg = tiny_config("tiny-llama");
        cfg.speculative = Some(spec);
        let err = match Engine::spawn(cfg).await {
            Ok(_) => panic!("{spec:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{spec:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_acceptance_keeps_greedy_output_and_is_reproducible_when_sampling() {
    let rejection = |k| {
        ngram(k, SpecVerify::Fixed).map(|s| SpecConfig {
            acceptance: SpecAcceptance::Rejection,
            ..s
        })
    };
    // Greedy targets are one-hot: rejection sampling accepts exactly the argmax drafts.
    let greedy = repetitive_requests(24, 31, |_| SamplingParams::default());
    let want = reference_outputs("tiny-llama", &greedy);
    let mut cfg = tiny_config("tiny-llama");
    cfg.speculative = rejection(4);
    let (got, status) = run_engine(cfg.clone(), greedy).await;
    assert_eq!(tokens(&got), want);
    assert_speculated(&status, "greedy, rejection");
    // Sampled: the same seeds give the same tokens run after run (the acceptance draws
    // are counter-hashed too), with drafts accepted.
    let mut sampled = repetitive_requests(24, 33, |_| SamplingParams {
        temperature: 0.3,
        ..SamplingParams::default()
    });
    for (i, r) in sampled.iter_mut().enumerate() {
        r.seed = Some(77 + i as u64);
    }
    let (zos_first, zos_status) = run_engine(cfg.clone(), sampled.clone()).await;
    let (zos_second, _) = run_engine(cfg.clone(), sampled.clone()).await;
    assert_eq!(tokens(&zos_first), tokens(&zos_second));
    // Where the backend draws the rows, it decides each draft in that draw: the row after
    // a verify row is planned at once, as a greedy one's is.
    if common::engine::test_device() != troupe::engine::Device::Cpu {
        assert_eq!(zos_status.num_spec_sat_out_rows, 0, "{zos_status:?}");
        assert!(zos_status.num_spec_verify_rows > 0, "{zos_status:?}");
    }
    // Drafts that follow known tokens (no ZOS guess) are accepted at this temperature.
    cfg.zero_overhead_scheduling = false;
    let (first, status) = run_engine(cfg.clone(), sampled.clone()).await;
    let (second, _) = run_engine(cfg.clone(), sampled.clone()).await;
    assert_eq!(tokens(&first), tokens(&second));
    assert_speculated(&status, "sampled, rejection");
    // Its draws are its own (the acceptance stream), not plain decoding's: the tokens part
    // from the coupled run's somewhere, which shows the rejection path ran.
    cfg.speculative = ngram(4, SpecVerify::Fixed);
    let (coupled, _) = run_engine(cfg, sampled).await;
    assert_ne!(tokens(&first), tokens(&coupled));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confidence_verification_measures_the_decode_curve_once_and_keeps_it() {
    let dir = common::scratch_path("curves");
    let mut cfg = tiny_config("tiny-llama");
    cfg.speculative = ngram(4, SpecVerify::Confidence);
    cfg.latency_curve_dir = Some(dir.clone());
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default()
    };
    let points = |cfg: EngineConfig| async move {
        let engine = Engine::spawn(cfg).await.unwrap();
        let n = engine.status().await.unwrap().num_decode_curve_points;
        engine.shutdown(true).await;
        n
    };
    let first = points(cfg.clone()).await;
    assert!(first > 1, "no curve measured: {first} points");
    let stored = files();
    assert_eq!(stored.len(), 1, "{stored:?}");
    let written = std::fs::read_to_string(&stored[0]).unwrap();
    // The next start loads it: same points, the file untouched.
    assert_eq!(points(cfg.clone()).await, first);
    assert_eq!(std::fs::read_to_string(&stored[0]).unwrap(), written);
    // A damaged file is measured again and rewritten.
    std::fs::write(&stored[0], "{not json").unwrap();
    assert_eq!(points(cfg.clone()).await, first);
    assert!(
        std::fs::read_to_string(&stored[0])
            .unwrap()
            .contains("points")
    );
    // Another model keeps its own curve.
    let mut other = cfg;
    other.model_path = common::goldens().join("tiny-qwen3");
    assert!(points(other).await > 1);
    assert_eq!(files().len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
