//! Helpers for the actor-engine scenarios: a tiny model, random greedy requests, and the
//! reference outputs of the synchronous `Generator` run one request at a time.
#![allow(dead_code)]

use super::generate::{GenerateRequest, Generator};
use troupe::engine::{
    Device, Engine, EngineConfig, EngineHandle, EngineRequest, EngineStatus, RequestOutput,
};
use troupe::kernels::cpu::CpuBackend;
use troupe::sampling::{SamplingParams, splitmix64};

/// The device the engine scenarios run on: the CPU, or with `TROUPE_TEST_DEVICE=cuda`
/// (on the GPU machine, `scripts/gpu-check.sh`) GPU 0.
pub fn test_device() -> Device {
    match std::env::var("TROUPE_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => Device::Cpu,
    }
}

pub fn tiny_config(name: &str) -> EngineConfig {
    let mut cfg = EngineConfig::new(super::goldens().join(name));
    cfg.kv_cache_bytes = 64 << 20;
    cfg.device = test_device();
    cfg.batch_invariant = cfg.device != Device::Cpu && compares_tokens();
    cfg
}

/// Whether a scenario can compare a recovered run's tokens with a solo run's. On a GPU only
/// the invariant GEMM makes a row's tokens independent of its batch; `TROUPE_TEST_MODE=default`
/// runs the GPU scenarios in the default mode instead, where a recovery is judged by every
/// request finishing at its full length with nothing leaked.
pub fn compares_tokens() -> bool {
    test_device() == Device::Cpu || std::env::var("TROUPE_TEST_MODE").as_deref() != Ok("default")
}

/// `n` greedy requests with prompts of 3..40 tokens and 8..24 new tokens, from `seed`.
pub fn random_requests(n: usize, vocab: u32, seed: u64) -> Vec<EngineRequest> {
    (0..n)
        .map(|i| {
            let h = |k: u64| splitmix64(seed ^ splitmix64(i as u64 * 1000 + k));
            let len = 3 + (h(0) % 38) as usize;
            let prompt_ids = (0..len)
                .map(|j| 3 + (h(10 + j as u64) % (vocab as u64 - 3)) as u32)
                .collect();
            let max_tokens = 8 + (h(1) % 17) as usize;
            let mut r = EngineRequest::new(prompt_ids, max_tokens, SamplingParams::default());
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// Each request alone through the synchronous reference loop on the CPU; on a GPU, each
/// request alone through a fault-free engine on that GPU (its bf16 weights differ from the
/// CPU's f32 ones, so the CPU is no reference there).
pub fn reference_outputs(model: &str, requests: &[EngineRequest]) -> Vec<Vec<u32>> {
    if test_device() != Device::Cpu {
        let (model, requests) = (model.to_string(), requests.to_vec());
        return std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let engine = Engine::spawn(tiny_config(&model)).await.unwrap();
                let mut out = Vec::new();
                for r in requests {
                    out.push(engine.generate(r).await.unwrap().collect().await.token_ids);
                }
                engine.shutdown(false).await;
                out
            })
        })
        .join()
        .unwrap();
    }
    let loaded = super::load(&super::goldens().join(model));
    let mut generator = Generator::new(CpuBackend::default(), loaded, 16);
    requests
        .iter()
        .map(|r| {
            let req = GenerateRequest {
                prompt_ids: r.prompt_ids.clone(),
                max_tokens: r.max_tokens,
                params: r.params.clone(),
                ignore_eos: r.ignore_eos,
            };
            generator
                .generate(&[req], |_| {})
                .unwrap()
                .remove(0)
                .token_ids
        })
        .collect()
}

pub fn tokens(outputs: &[RequestOutput]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.token_ids.clone()).collect()
}

/// The outputs of `requests` run together on `engine`, every one without an error.
pub async fn ok_outputs(
    engine: &troupe::engine::EngineHandle,
    requests: Vec<EngineRequest>,
) -> Vec<RequestOutput> {
    engine
        .generate_batch(requests)
        .await
        .into_iter()
        .map(|r| {
            let o = r.expect("request accepted");
            assert!(o.error.is_none(), "{:?}", o.error);
            o
        })
        .collect()
}

/// Every request finished without an error and with `want`'s tokens, and every KV block is
/// free again once the engine settles; returns the engine's status then.
pub async fn assert_finished_unchanged(
    engine: &troupe::engine::EngineHandle,
    got: &[RequestOutput],
    want: &[Vec<u32>],
) -> troupe::engine::EngineStatus {
    assert!(
        got.iter().all(|o| o.error.is_none()),
        "{:?}",
        got.iter().find_map(|o| o.error.clone())
    );
    if compares_tokens() {
        assert_eq!(tokens(got), want);
    } else {
        let lens = |t: &[Vec<u32>]| t.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(lens(&tokens(got)), lens(want));
    }
    let mut status = engine.status().await.unwrap();
    for _ in 0..100 {
        if status.num_free_blocks == status.num_total_blocks {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        status = engine.status().await.unwrap();
    }
    assert_eq!(
        status.num_free_blocks, status.num_total_blocks,
        "blocks leaked: {status:?}"
    );
    status
}

/// A fresh engine's outputs for `requests` (all accepted, none failed) and its status
/// after them.
pub async fn run_engine(
    cfg: EngineConfig,
    requests: Vec<EngineRequest>,
) -> (Vec<RequestOutput>, EngineStatus) {
    let engine = Engine::spawn(cfg).await.unwrap();
    let out = ok_outputs(&engine, requests).await;
    let status = engine.status().await.unwrap();
    engine.shutdown(true).await;
    (out, status)
}

/// Waits until the engine has run `n` steps, so a fault lands mid-run (60 s bound).
pub async fn wait_for_steps(engine: &EngineHandle, n: u64) {
    let waiting = async {
        while engine.status().await.unwrap().num_steps < n {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), waiting)
        .await
        .expect("the engine runs steps");
}

/// Kills rank 0's worker actor, as a crash would.
pub async fn kill_rank_0(engine: &EngineHandle) {
    let mut children = engine.children().await.unwrap();
    children.workers.remove(0).get_cell().kill();
}

/// The status once every block and state slot is back (or after 2 s, for the caller's
/// assertion to show what leaked).
pub async fn idle_status(engine: &EngineHandle) -> EngineStatus {
    let mut status = engine.status().await.unwrap();
    for _ in 0..100 {
        if status.num_free_blocks == status.num_total_blocks
            && status.num_free_state_slots == status.num_total_state_slots
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        status = engine.status().await.unwrap();
    }
    status
}
