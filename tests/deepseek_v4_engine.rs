//! DeepSeek-V4 through the actor engine: continuous batching with chunked prefill, state
//! slots admitted with blocks, preemption by recompute and abort, all checked against
//! transformers' reference outputs for the tiny checkpoints. With `TROUPE_TEST_DEVICE=cuda`
//! (`scripts/gpu-tests.sh`) the single-rank scenarios run on GPU 0 in the batch-invariant
//! mode.

mod common;

use common::dsv4::{CHECKPOINTS, Reference, reference};

use troupe::engine::{Device, Engine, EngineConfig, EngineHandle, EngineRequest, FinishReason};
use troupe::model::deepseek_v4::cache::DsV4Cache;
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::runner::fault::FaultPlan;
use troupe::sampling::SamplingParams;

fn ds_config(name: &str) -> DsV4Config {
    let path = common::goldens().join(name).join("config.json");
    DsV4Config::from_hf_json(&path, &common::read_json(&format!("{name}/config.json"))).unwrap()
}

/// An engine whose cache holds `max_num_seqs` state slots and `num_blocks` blocks of 16
/// source tokens.
fn engine_config(
    name: &str,
    max_num_seqs: usize,
    num_blocks: usize,
    max_step_tokens: usize,
) -> EngineConfig {
    let ds = ds_config(name);
    let mut cfg = EngineConfig::new(common::goldens().join(name));
    cfg.block_size = 16;
    cfg.max_num_seqs = max_num_seqs;
    cfg.max_step_tokens = max_step_tokens;
    cfg.kv_cache_bytes = max_num_seqs * DsV4Cache::bytes_per_slot(&ds)
        + num_blocks * DsV4Cache::bytes_per_block(&ds, 16);
    cfg.device = common::engine::test_device();
    cfg.batch_invariant = cfg.device != Device::Cpu;
    cfg
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    let mut r = EngineRequest::new(prompt, max_tokens, SamplingParams::default());
    r.ignore_eos = true;
    r
}

async fn run_all(engine: &EngineHandle, requests: Vec<EngineRequest>) -> Vec<Vec<u32>> {
    let mut streams = Vec::new();
    for r in requests {
        streams.push(engine.generate(r).await.unwrap());
    }
    let mut out = Vec::new();
    for s in streams {
        let o = s.collect().await;
        assert!(o.error.is_none(), "{:?}", o.error);
        out.push(o.token_ids);
    }
    out
}

async fn assert_everything_free(engine: &EngineHandle) {
    for _ in 0..200 {
        let s = engine.status().await.unwrap();
        if s.num_running == 0
            && s.num_free_blocks == s.num_total_blocks
            && s.num_free_state_slots == s.num_total_state_slots
        {
            assert!(s.num_total_state_slots > 0);
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!(
        "blocks or state slots still held: {:?}",
        engine.status().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_chunked_prefill_match_transformers() {
    for name in CHECKPOINTS {
        let r = reference(name);
        // 8-token steps: every prompt past 8 tokens is prefilled in chunks beside others'
        // decode rows.
        let engine = Engine::spawn(engine_config(name, 6, 64, 8)).await.unwrap();
        let mut requests = vec![greedy(r.greedy_prompt.clone(), r.greedy_tokens.len())];
        let mut expected = vec![r.greedy_tokens.clone()];
        for (p, prompt) in r.prompts.iter().enumerate() {
            for len in [1, 2, 4, 5, 8, 9, 13, 17, 24, 29] {
                requests.push(greedy(prompt[..len].to_vec(), 1));
                expected.push(vec![r.argmax()[p][len - 1]]);
            }
        }
        let got = run_all(&engine, requests).await;
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "{name}: request {i}");
        }
        assert_everything_free(&engine).await;
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_sequences_are_recomputed_to_the_same_tokens() {
    for name in CHECKPOINTS {
        let r = reference(name);
        // Six sequences of 35 tokens need 18 blocks; the pool has 8.
        let engine = Engine::spawn(engine_config(name, 6, 8, 64)).await.unwrap();
        let requests = (0..6)
            .map(|_| greedy(r.greedy_prompt.clone(), r.greedy_tokens.len()))
            .collect();
        for (i, got) in run_all(&engine, requests).await.iter().enumerate() {
            assert_eq!(got, &r.greedy_tokens, "{name}: request {i}");
        }
        let status = engine.status().await.unwrap();
        assert!(
            status.num_preemptions > 0,
            "{name}: nothing was preempted: {status:?}"
        );
        assert_everything_free(&engine).await;
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_requests_give_back_their_blocks_and_slots() {
    let r = reference("tiny-dsv4-a");
    let engine = Engine::spawn(engine_config("tiny-dsv4-a", 4, 64, 64))
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(
            engine
                .generate(greedy(r.greedy_prompt.clone(), 500))
                .await
                .unwrap(),
        );
    }
    for s in &mut streams {
        assert!(s.next().await.unwrap().error.is_none());
        engine.abort(s.request_id);
    }
    for s in streams {
        assert_eq!(s.collect().await.finish_reason, Some(FinishReason::Abort));
    }
    assert_everything_free(&engine).await;
    // The engine still serves: a fresh request equals the reference.
    let got = run_all(
        &engine,
        vec![greedy(r.greedy_prompt.clone(), r.greedy_tokens.len())],
    )
    .await;
    assert_eq!(got[0], r.greedy_tokens);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_deepseek_v4_cannot_do_yet_is_refused_by_name() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    let mut tp = engine_config("tiny-dsv4-a", 2, 8, 64);
    tp.device = Device::Cpu;
    tp.tensor_parallel_size = 3;
    let mut cuda_group = engine_config("tiny-dsv4-a", 2, 8, 64);
    cuda_group.device = Device::Cuda(0);
    cuda_group.tensor_parallel_size = 2;
    let mut draft = engine_config("tiny-dsv4-a", 2, 8, 64);
    draft.speculative = Some(SpecConfig {
        method: SpecMethod::DraftModel,
        num_speculative_tokens: 2,
        verify: SpecVerify::Fixed,
        acceptance: SpecAcceptance::Coupled,
    });
    draft.draft_model_path = Some(common::goldens().join("tiny-llama"));
    let mut cuda_budget = engine_config("tiny-dsv4-a", 2, 8, 64);
    cuda_budget.device = Device::Cuda(0);
    cuda_budget.kv_cache_bytes = 0;
    let mut tiny = engine_config("tiny-dsv4-a", 2, 8, 64);
    tiny.device = Device::Cpu;
    tiny.kv_cache_bytes = 100;
    let mut too_many_saved = engine_config("tiny-dsv4-a", 2, 8, 64);
    too_many_saved.swa_saved_states = Some(1000);
    let mut saved_no_cache = engine_config("tiny-dsv4-a", 2, 8, 64);
    saved_no_cache.swa_saved_states = Some(2);
    saved_no_cache.enable_prefix_cache = false;
    let mut llama_saved = EngineConfig::new(common::goldens().join("tiny-llama"));
    llama_saved.swa_saved_states = Some(2);
    for (cfg, want) in [
        (
            tp,
            "expert parallel size 3 does not divide the model's 4 routed experts",
        ),
        (cuda_group, "DeepSeek-V4: on CUDA runs on one GPU"),
        (
            draft,
            "DeepSeek-V4 models draft with --spec ngram or --spec mtp",
        ),
        (cuda_budget, "give kv_cache_bytes"),
        (tiny, "more than the cache budget of 100"),
        (
            too_many_saved,
            "--swa-saved-states 1000: 1000 saved states of",
        ),
        (saved_no_cache, "--swa-saved-states with --no-prefix-cache"),
        (
            llama_saved,
            "--swa-saved-states: this model keeps no sliding-window state",
        ),
    ] {
        let err = Engine::spawn(cfg).await.err().expect("refused").to_string();
        assert!(err.contains(want), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hits_resume_or_replay_to_the_tokens_of_cold_runs() {
    // No saved states: every hit replays. The default: hits on a block whose state was
    // saved (the prompt's 64-token chunk ended there) resume from it.
    for (name, saved_states) in CHECKPOINTS.iter().flat_map(|n| [(n, Some(0)), (n, None)]) {
        let r = reference(name);
        let prompt = &r.prompts[0];
        let mut cfg = engine_config(name, 4, 64, 64);
        cfg.swa_saved_states = saved_states;
        let engine = Engine::spawn(cfg).await.unwrap();
        // The whole prompt first, so its blocks are registered; then prefixes that hit
        // them (48 or 64 tokens of blocks).
        let first = run_all(&engine, vec![greedy(prompt.clone(), 1)]).await;
        assert_eq!(
            first[0],
            vec![r.argmax()[0][prompt.len() - 1]],
            "{name}: cold run"
        );
        let lens = [50, 57, 66, 71];
        let got = run_all(
            &engine,
            lens.iter()
                .map(|&l| greedy(prompt[..l].to_vec(), 1))
                .collect(),
        )
        .await;
        for (&len, g) in lens.iter().zip(&got) {
            assert_eq!(
                g,
                &vec![r.argmax()[0][len - 1]],
                "{name}: prefix of {len} tokens"
            );
        }
        let status = engine.status().await.unwrap();
        assert!(
            status.num_prefix_hit_blocks >= 2 * lens.len() as u64,
            "{name}: {status:?}"
        );
        let hits = (status.num_resumed_hits, status.num_replayed_hits);
        match saved_states {
            Some(0) => assert_eq!(hits, (0, lens.len() as u64), "{name}"),
            _ => assert!(hits.0 >= 2, "{name}: {hits:?} (resumed, replayed)"),
        }
        assert_everything_free(&engine).await;
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eplb_plans_from_the_routed_loads_and_reports_moe_lb() {
    let r = reference("tiny-dsv4-a");
    let mut cfg = engine_config("tiny-dsv4-a", 2, 64, 64);
    cfg.eplb = Some(troupe::eplb::EplbSettings {
        num_ranks: 2,
        num_redundant_experts: 2,
        window_steps: 8,
        period_steps: 8,
    });
    let engine = Engine::spawn(cfg).await.unwrap();
    let status = engine.status().await.unwrap();
    assert_eq!(
        (status.moe_lb, status.num_eplb_rebalances),
        (0.0, 0),
        "nothing routed yet"
    );
    let got = run_all(
        &engine,
        vec![greedy(r.greedy_prompt.clone(), r.greedy_tokens.len())],
    )
    .await;
    assert_eq!(
        got[0], r.greedy_tokens,
        "EPLB only plans: tokens are unchanged"
    );
    let status = engine.status().await.unwrap();
    // 25 steps (one prefill, 24 decodes): rebalances after steps 2, 10, 18.
    assert_eq!(status.num_eplb_rebalances, 3, "{status:?}");
    assert!(status.moe_lb >= 1.0 && status.moe_lb <= 2.0, "{status:?}");
    engine.shutdown(true).await;

    // 4 experts + 1 replica do not divide over 2 ranks; a dense model has no experts.
    let mut bad = engine_config("tiny-dsv4-a", 2, 64, 64);
    bad.eplb = Some(troupe::eplb::EplbSettings {
        num_ranks: 2,
        num_redundant_experts: 1,
        window_steps: 8,
        period_steps: 8,
    });
    let err = Engine::spawn(bad).await.err().expect("refused").to_string();
    assert!(
        err.contains("5 physical experts (4 logical + 1 redundant) do not divide over 2 ranks"),
        "{err}"
    );
    let mut dense = EngineConfig::new(common::goldens().join("tiny-llama"));
    dense.kv_cache_bytes = 8 << 20;
    dense.eplb = Some(troupe::eplb::EplbSettings {
        num_ranks: 2,
        num_redundant_experts: 0,
        window_steps: 8,
        period_steps: 8,
    });
    let err = Engine::spawn(dense)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("this model has none"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_gives_the_tokens_of_plain_decoding() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    for name in CHECKPOINTS {
        let r = reference(name);
        // Prompts that repeat themselves give the prompt-lookup drafter matches, and the
        // random model rejects most of them: rewinds of the window and compressor state.
        let prompts = [
            r.greedy_prompt.clone(),
            r.prompts[1][..9].repeat(4),
            [&r.prompts[0][..20], &r.prompts[0][..20]].concat(),
        ];
        let requests = || {
            prompts
                .iter()
                .map(|p| greedy(p.clone(), 24))
                .collect::<Vec<_>>()
        };
        let engine = Engine::spawn(engine_config(name, 4, 64, 64)).await.unwrap();
        let plain = run_all(&engine, requests()).await;
        engine.shutdown(true).await;
        assert_eq!(plain[0], r.greedy_tokens, "{name}: plain decoding");
        for verify in [SpecVerify::Fixed, SpecVerify::Confidence] {
            let mut cfg = engine_config(name, 4, 64, 64);
            cfg.speculative = Some(SpecConfig {
                method: SpecMethod::Ngram,
                num_speculative_tokens: 4,
                verify,
                acceptance: SpecAcceptance::Coupled,
            });
            let engine = Engine::spawn(cfg).await.unwrap();
            let got = run_all(&engine, requests()).await;
            assert_eq!(got, plain, "{name} {verify:?}");
            let s = engine.status().await.unwrap();
            assert!(
                s.num_spec_verified_tokens > s.num_spec_accepted_tokens,
                "{name} {verify:?}: no draft was rejected: {s:?}"
            );
            assert_everything_free(&engine).await;
            engine.shutdown(true).await;
        }
    }
}

/// `--spec mtp`: the checkpoint's MTP layer drafts (tiny-dsv4-a ships one; its drafts
/// are checked against the reference in `deepseek_v4_mtp.rs` and the rank's unit tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_speculation_gives_the_tokens_of_plain_decoding() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    let name = "tiny-dsv4-a";
    let r = reference(name);
    let requests = || {
        let mut rs = vec![greedy(r.greedy_prompt.clone(), 24)];
        rs.extend(r.prompts.iter().map(|p| greedy(p[..25].to_vec(), 16)));
        let mut seeded = EngineRequest::new(
            r.prompts[1].clone(),
            16,
            SamplingParams {
                temperature: 0.8,
                ..SamplingParams::default()
            },
        );
        seeded.ignore_eos = true;
        seeded.seed = Some(5);
        rs.push(seeded);
        rs
    };
    let engine = Engine::spawn(engine_config(name, 4, 64, 64)).await.unwrap();
    let plain = run_all(&engine, requests()).await;
    engine.shutdown(true).await;
    assert_eq!(plain[0], r.greedy_tokens, "plain decoding");
    for verify in [SpecVerify::Fixed, SpecVerify::Confidence] {
        let mut cfg = engine_config(name, 4, 64, 64);
        cfg.speculative = Some(SpecConfig {
            method: SpecMethod::Mtp,
            num_speculative_tokens: 3,
            verify,
            acceptance: SpecAcceptance::Coupled,
        });
        let engine = Engine::spawn(cfg).await.unwrap();
        let got = run_all(&engine, requests()).await;
        assert_eq!(got, plain, "{verify:?}");
        let s = engine.status().await.unwrap();
        assert!(s.num_spec_verified_tokens > 0, "{verify:?}: {s:?}");
        assert_everything_free(&engine).await;
        engine.shutdown(true).await;
    }

    // A checkpoint without an MTP layer is refused by name.
    let mut cfg = engine_config("tiny-dsv4-b", 4, 64, 64);
    cfg.speculative = Some(SpecConfig {
        method: SpecMethod::Mtp,
        num_speculative_tokens: 3,
        verify: SpecVerify::Fixed,
        acceptance: SpecAcceptance::Coupled,
    });
    let err = Engine::spawn(cfg)
        .await
        .err()
        .expect("no MTP layer")
        .to_string();
    assert!(err.contains("mtp.0.") && err.contains("missing"), "{err}");
}

/// The greedy prompt's continuation and each prompt's next token at several lengths, with
/// what transformers says they are.
fn reference_batch(r: &Reference) -> (Vec<EngineRequest>, Vec<Vec<u32>>) {
    let mut requests = vec![greedy(r.greedy_prompt.clone(), r.greedy_tokens.len())];
    let mut expected = vec![r.greedy_tokens.clone()];
    for (p, prompt) in r.prompts.iter().enumerate() {
        for len in [1, 5, 9, 17, 29] {
            requests.push(greedy(prompt[..len].to_vec(), 1));
            expected.push(vec![r.argmax()[p][len - 1]]);
        }
    }
    (requests, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expert_parallel_groups_give_the_tokens_of_transformers() {
    // Group sizes dividing each model's routed experts (4 and 6); EPLB placing experts
    // for the group moves work between ranks every 8 steps.
    for (name, size, eplb_redundant) in [
        ("tiny-dsv4-a", 2, None),
        ("tiny-dsv4-a", 4, None),
        ("tiny-dsv4-b", 3, None),
        ("tiny-dsv4-a", 2, Some(2)),
    ] {
        let r = reference(name);
        let mut cfg = engine_config(name, 6, 64, 8);
        cfg.tensor_parallel_size = size;
        cfg.eplb = eplb_redundant.map(|num_redundant_experts| troupe::eplb::EplbSettings {
            num_ranks: size,
            num_redundant_experts,
            window_steps: 8,
            period_steps: 8,
        });
        let engine = Engine::spawn(cfg).await.unwrap();
        let (requests, expected) = reference_batch(&r);
        let got = run_all(&engine, requests).await;
        assert_eq!(
            got, expected,
            "{name}, {size} ranks, EPLB {eplb_redundant:?}"
        );
        let status = engine.status().await.unwrap();
        assert_eq!(status.tensor_parallel_size, size, "{status:?}");
        if eplb_redundant.is_some() {
            // The tokens above were computed with the experts the rebalances moved.
            assert!(status.num_eplb_rebalances > 0, "{status:?}");
            assert!(status.num_eplb_moved_experts > 0, "{status:?}");
            assert!(status.measured_moe_lb >= 1.0, "{status:?}");
        }
        assert_everything_free(&engine).await;
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_of_an_expert_parallel_group_holds_only_its_experts() {
    // Every rank holds everything but the routed experts, which are split: with R the
    // routed experts' bytes and S one rank's whole, a group of n holds n·(S − R) + R.
    let mut resident = Vec::new();
    for size in [1, 2, 4] {
        let mut cfg = engine_config("tiny-dsv4-a", 2, 16, 8);
        cfg.tensor_parallel_size = size;
        let engine = Engine::spawn(cfg).await.unwrap();
        let status = engine.status().await.unwrap();
        engine.shutdown(true).await;
        assert_eq!(status.tensor_parallel_size, size);
        resident.push(status.resident_weight_bytes as i64);
    }
    let [one, two, four] = resident[..] else {
        unreachable!()
    };
    let routed = 2 * one - two;
    assert!(0 < routed && routed < one, "{resident:?}");
    assert_eq!(four, 4 * one - 3 * routed, "{resident:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_rank_shrinks_the_expert_parallel_group_and_every_request_finishes() {
    let r = reference("tiny-dsv4-a");
    let faults = FaultPlan::default();
    let mut cfg = engine_config("tiny-dsv4-a", 6, 64, 8);
    cfg.tensor_parallel_size = 4;
    let engine = Engine::spawn_with_faults(cfg, faults.clone())
        .await
        .unwrap();
    let (requests, expected) = reference_batch(&r);
    let mut streams = Vec::new();
    for q in requests {
        streams.push(engine.generate(q).await.unwrap());
    }
    // The rank on the last device dies at its next step and that device never starts
    // again: of the three left, two ranks divide the 4 experts.
    faults.lose_device(3);
    for (i, (s, want)) in streams.into_iter().zip(&expected).enumerate() {
        let o = s.collect().await;
        assert!(o.error.is_none(), "request {i}: {:?}", o.error);
        assert_eq!(&o.token_ids, want, "request {i}");
    }
    let status = engine.status().await.unwrap();
    assert_eq!(status.tensor_parallel_size, 2, "{status:?}");
    assert!(status.num_resets >= 2, "{status:?}");
    assert_everything_free(&engine).await;
    engine.shutdown(true).await;
}
