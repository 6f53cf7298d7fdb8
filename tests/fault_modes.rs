//! Rank faults in every mode the engine serves, not only greedy decoding: seeded sampled
//! requests, speculation (n-gram drafts verified fixed and by confidence), the prefix
//! store with a disk tier, and DeepSeek-V4 with its state slots. A rank is killed mid-run
//! while requests are in flight; every request finishes with the tokens the same
//! requests get from an engine no fault touched, and every block and state slot comes
//! back. (On a GPU the scenarios run in the invariant mode, as `fault_injection.rs`'s do.)

mod common;

use std::time::Duration;

use common::engine::{
    compares_tokens, idle_status, kill_rank_0, random_requests, tiny_config, wait_for_steps,
};
use troupe::engine::{
    Engine, EngineConfig, EngineRequest, EngineStatus, SpecAcceptance, SpecConfig, SpecMethod,
    SpecVerify,
};
use troupe::model::deepseek_v4::cache::DsV4Cache;
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::sampling::splitmix64;

/// Every request's tokens from a fresh engine of `cfg`, after a kill of rank 0 once
/// `kill_after_steps` steps have run (`None`: no fault), and the engine's status once idle.
async fn run(
    cfg: EngineConfig,
    requests: &[EngineRequest],
    kill_after_steps: Option<u64>,
) -> (Vec<Vec<u32>>, EngineStatus) {
    let engine = Engine::spawn(cfg).await.unwrap();
    let mut streams = Vec::new();
    for r in requests {
        streams.push(engine.generate(r.clone()).await.unwrap());
    }
    if let Some(steps) = kill_after_steps {
        wait_for_steps(&engine, steps).await;
        let before = engine.status().await.unwrap();
        assert!(
            before.num_running + before.num_waiting > 0,
            "the kill would land after the work: {before:?}"
        );
        kill_rank_0(&engine).await;
    }
    let all = async {
        let mut out = Vec::new();
        for s in streams {
            let o = s.collect().await;
            assert!(o.error.is_none(), "{:?}", o.error);
            out.push(o.token_ids);
        }
        out
    };
    let out = tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("every request ends within 120 s");
    let status = idle_status(&engine).await;
    engine.shutdown(true).await;
    (out, status)
}

/// The faulted run equals the unfaulted one, a restart happened, nothing leaked; the
/// faulted run's status, for what the mode itself must show.
async fn assert_survives(
    what: &str,
    cfg: EngineConfig,
    requests: Vec<EngineRequest>,
) -> EngineStatus {
    let (want, _) = run(cfg.clone(), &requests, None).await;
    let (got, status) = run(cfg, &requests, Some(4)).await;
    assert!(
        status.num_resets >= 2,
        "{what}: no restart happened: {status:?}"
    );
    assert_eq!(
        (status.num_free_blocks, status.num_free_state_slots),
        (status.num_total_blocks, status.num_total_state_slots),
        "{what}: blocks or slots leaked: {status:?}"
    );
    if compares_tokens() {
        assert_eq!(got, want, "{what}");
    } else {
        let lens = |t: &[Vec<u32>]| t.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(lens(&got), lens(&want), "{what}");
    }
    status
}

/// Sampled at a temperature with nucleus and top-k cuts, each with its own seed.
fn seeded(n: usize, seed: u64) -> Vec<EngineRequest> {
    let mut requests = random_requests(n, 384, seed);
    for (i, r) in requests.iter_mut().enumerate() {
        r.params.temperature = 0.9;
        r.params.top_p = 0.95;
        r.params.top_k = 40;
        r.seed = Some(splitmix64(seed ^ i as u64));
    }
    requests
}

/// Prompts that repeat themselves, so n-gram drafts are proposed and some accepted; half
/// greedy, half seeded.
fn copy_friendly(n: usize, seed: u64) -> Vec<EngineRequest> {
    let mut requests = random_requests(n, 384, seed);
    for (i, r) in requests.iter_mut().enumerate() {
        let motif: Vec<u32> = r.prompt_ids.iter().take(5).copied().collect();
        r.prompt_ids = motif
            .iter()
            .cycle()
            .take(5 * (3 + i % 4))
            .copied()
            .collect();
        if i % 2 == 1 {
            r.params.temperature = 0.7;
            r.seed = Some(i as u64);
        }
    }
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampled_requests_survive_a_rank_kill_unchanged() {
    assert_survives("seeded", tiny_config("tiny-llama"), seeded(48, 61)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_fixed_and_by_confidence_survives_a_rank_kill_unchanged() {
    for verify in [SpecVerify::Fixed, SpecVerify::Confidence] {
        let mut cfg = tiny_config("tiny-llama");
        cfg.speculative = Some(SpecConfig {
            method: SpecMethod::Ngram,
            num_speculative_tokens: 3,
            verify,
            acceptance: SpecAcceptance::Coupled,
        });
        let status = assert_survives(&format!("{verify:?}"), cfg, copy_friendly(32, 62)).await;
        assert!(
            status.num_spec_accepted_tokens > 0,
            "{verify:?}: no draft accepted: {status:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_store_survives_a_rank_kill_unchanged() {
    let dir = common::scratch_dir("fault-store");
    let mut cfg = tiny_config("tiny-llama");
    cfg.kv_store.host_bytes = 8 << 20;
    cfg.kv_store.dir = Some(dir);
    cfg.kv_store.disk_bytes = 64 << 20;
    // Shared prefixes, so blocks are stored and hit while the rank dies.
    let mut requests = seeded(40, 63);
    let shared: Vec<u32> = (0..48).map(|t| 7 + t % 300).collect();
    for (i, r) in requests.iter_mut().enumerate() {
        if i % 2 == 0 {
            r.prompt_ids.splice(0..0, shared.iter().copied());
        }
    }
    let status = assert_survives("prefix store", cfg, requests).await;
    assert!(
        status.num_prefix_hit_blocks > 0,
        "no prefix hit: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v4_with_state_slots_survives_a_rank_kill_unchanged() {
    let name = "tiny-dsv4-a";
    let path = common::goldens().join(name).join("config.json");
    let ds = DsV4Config::from_hf_json(&path, &common::read_json(&format!("{name}/config.json")))
        .unwrap();
    let mut cfg = EngineConfig::new(common::goldens().join(name));
    cfg.block_size = 16;
    cfg.max_num_seqs = 6;
    cfg.max_step_tokens = 64;
    cfg.kv_cache_bytes =
        6 * DsV4Cache::bytes_per_slot(&ds) + 96 * DsV4Cache::bytes_per_block(&ds, 16);
    cfg.device = common::engine::test_device();
    cfg.batch_invariant = cfg.device != troupe::engine::Device::Cpu;
    let vocab = ds.generic_config().vocab_size as u64;
    let mut requests = Vec::new();
    for (i, mut r) in random_requests(12, vocab as u32, 64)
        .into_iter()
        .enumerate()
    {
        if i % 2 == 1 {
            r.params.temperature = 0.8;
            r.seed = Some(i as u64);
        }
        requests.push(r);
    }
    let status = assert_survives("DeepSeek-V4", cfg, requests).await;
    assert!(status.num_total_state_slots > 0, "{status:?}");
}
