//! Speculative decoding with a draft model run by the rank worker (`--spec draft`): greedy
//! output equal to the one-at-a-time reference and seeded sampling equal to plain
//! decoding, with the model itself as its draft (nearly every draft accepted) and with
//! another model of the same vocabulary (few accepted), ZOS on and off, fixed and
//! confidence-scheduled verification; a rank killed mid-run rebuilds the draft's cache
//! with the model's; pairs that cannot run are refused by name.

mod common;

use common::engine::{ok_outputs, reference_outputs, run_engine, tiny_config, tokens};
use troupe::engine::{
    Engine, EngineConfig, EngineRequest, EngineStatus, SpecAcceptance, SpecConfig, SpecMethod,
    SpecVerify,
};
use troupe::runner::fault::FaultPlan;
use troupe::sampling::{SamplingParams, splitmix64};

fn draft_config(model: &str, draft: &str, k: usize, verify: SpecVerify) -> EngineConfig {
    let mut cfg = tiny_config(model);
    cfg.speculative = Some(SpecConfig {
        method: SpecMethod::DraftModel,
        num_speculative_tokens: k,
        verify,
        acceptance: SpecAcceptance::Coupled,
    });
    cfg.draft_model_path = Some(common::goldens().join(draft));
    cfg
}

fn requests(n: usize, seed: u64, params: impl Fn(usize) -> SamplingParams) -> Vec<EngineRequest> {
    (0..n)
        .map(|i| {
            let h = |k: u64| splitmix64(seed ^ splitmix64(i as u64 * 1000 + k));
            let prompt_ids = (0..4 + h(0) % 30)
                .map(|j| 3 + (h(10 + j) % 380) as u32)
                .collect();
            let mut r = EngineRequest::new(prompt_ids, 12 + (h(1) % 30) as usize, params(i));
            r.ignore_eos = true;
            r.seed = Some(500 + i as u64);
            r
        })
        .collect()
}

fn acceptance(status: &EngineStatus) -> f64 {
    assert!(
        status.num_spec_verify_rows > 0,
        "nothing was verified: {status:?}"
    );
    assert!(status.num_spec_accepted_tokens <= status.num_spec_verified_tokens);
    status.num_spec_accepted_tokens as f64 / status.num_spec_verified_tokens as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_with_a_draft_model_equals_plain_decoding() {
    let reqs = requests(32, 3, |_| SamplingParams::default());
    let want = reference_outputs("tiny-llama", &reqs);
    for (draft, zos, verify) in [
        ("tiny-llama", true, SpecVerify::Fixed),
        ("tiny-llama", false, SpecVerify::Fixed),
        ("tiny-llama", true, SpecVerify::Confidence),
        ("tiny-qwen3", true, SpecVerify::Fixed),
    ] {
        let mut cfg = draft_config("tiny-llama", draft, 4, verify);
        cfg.zero_overhead_scheduling = zos;
        let (got, status) = run_engine(cfg, reqs.clone()).await;
        assert_eq!(tokens(&got), want, "draft {draft}, zos={zos}, {verify:?}");
        let rate = acceptance(&status);
        if draft == "tiny-llama" {
            // The model drafting for itself: its drafts are its own greedy tokens.
            assert!(rate > 0.9, "{draft}: acceptance {rate}: {status:?}");
        } else {
            assert!(rate < 0.5, "a different model agreed too often ({rate})");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_with_a_draft_model_equals_plain_decoding() {
    let params = |i: usize| SamplingParams {
        temperature: if i.is_multiple_of(2) { 0.2 } else { 0.8 },
        top_p: 0.95,
        repetition_penalty: if i.is_multiple_of(3) { 1.1 } else { 1.0 },
        ..SamplingParams::default()
    };
    let reqs = requests(24, 7, params);
    let mut base = tiny_config("tiny-llama");
    base.batch_invariant = true;
    let (want, _) = run_engine(base.clone(), reqs.clone()).await;
    for verify in [SpecVerify::Fixed, SpecVerify::Confidence] {
        let mut cfg = draft_config("tiny-llama", "tiny-llama", 3, verify);
        cfg.batch_invariant = true;
        // Under ZOS confidence scheduling stops verifying drafts this poor against sampled
        // targets (a verify row costs its sequence the next step): without it they are.
        cfg.zero_overhead_scheduling &= verify == SpecVerify::Fixed;
        let (got, status) = run_engine(cfg, reqs.clone()).await;
        assert_eq!(tokens(&got), tokens(&want), "{verify:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.token_logprobs, w.token_logprobs, "{verify:?}");
        }
        // Greedy drafts against sampled targets: some accepted, not most. Confidence
        // scheduling weighs them against the step times it measures, so how many it
        // verifies depends on the machine's timing: it must verify some, at any rate.
        let rate = acceptance(&status);
        if verify == SpecVerify::Fixed {
            assert!(rate > 0.05, "{status:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_run_rebuilds_the_draft_model_with_it() {
    let reqs = requests(24, 11, |_| SamplingParams::default());
    let want = reference_outputs("tiny-llama", &reqs);
    let faults = FaultPlan::default();
    let cfg = draft_config("tiny-llama", "tiny-llama", 4, SpecVerify::Fixed);
    let engine = Engine::spawn_with_faults(cfg, faults.clone())
        .await
        .unwrap();
    faults.panic_next_step();
    let got = ok_outputs(&engine, reqs).await;
    assert_eq!(tokens(&got), want);
    let status = engine.status().await.unwrap();
    // One reset at start, one after the panic.
    assert!(
        status.num_resets >= 2,
        "the rank never restarted: {status:?}"
    );
    assert!(acceptance(&status) > 0.9, "{status:?}");
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_pairs_that_cannot_run_are_refused_by_name() {
    let spawn_error = |cfg: EngineConfig| async move {
        match Engine::spawn(cfg).await {
            Ok(_) => panic!("the configuration was accepted"),
            Err(e) => e.to_string(),
        }
    };
    // A vocabulary of another size: a copy of the tiny model with its config changed.
    let files = [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    let dir = common::golden_copy("tiny-llama", &files, "draft-vocab");
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::goldens().join("tiny-llama/config.json")).unwrap(),
    )
    .unwrap();
    config["vocab_size"] = 512.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut cfg = draft_config("tiny-llama", "tiny-llama", 4, SpecVerify::Fixed);
    cfg.draft_model_path = Some(dir.clone());
    let err = spawn_error(cfg).await;
    assert!(
        err.contains("vocabulary of 512") && err.contains("384"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let mut cfg = draft_config("tiny-llama", "tiny-llama", 4, SpecVerify::Fixed);
    cfg.draft_model_path = None;
    assert!(spawn_error(cfg).await.contains("--draft-model"));

    let mut cfg = tiny_config("tiny-llama");
    cfg.draft_model_path = Some(common::goldens().join("tiny-qwen3"));
    assert!(spawn_error(cfg).await.contains("without --spec draft"));

    let cfg = draft_config("tiny-llama", "tiny-dsv4-a", 4, SpecVerify::Fixed);
    assert!(spawn_error(cfg).await.contains("DeepSeek-V4"));

    let mut cfg = draft_config("tiny-llama", "tiny-llama", 4, SpecVerify::Fixed);
    cfg.tensor_parallel_size = 2;
    assert!(spawn_error(cfg).await.contains("one rank"));
}
