//! Tensor parallelism without GPUs: ranks on CPU threads joined by in-process channels run
//! the same rank protocol, sharding and rank-loss recovery a GPU group runs over NCCL.
//! The shards' logits are checked against transformers' (not against troupe's own
//! unsharded run); engines with two ranks against the one-request-at-a-time reference
//! loop, through rank deaths and device losses. With `TROUPE_TEST_DEVICE=cuda` the engine
//! tests run the same on GPUs 0 and 1 (`scripts/gpu-tests.sh` on a two-GPU machine).

mod common;

use std::time::Duration;

use common::engine::{
    assert_finished_unchanged, ok_outputs, random_requests, reference_outputs, tiny_config, tokens,
};
use troupe::engine::{Engine, EngineConfig, EngineHandle, RequestOutput};
use troupe::kernels::Backend;
use troupe::kernels::collective::ChannelCollective;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::llama::SeqStep;
use troupe::model::tensor_parallel::TpShard;
use troupe::runner::fault::FaultPlan;

const LOGIT_TOLERANCE: f32 = 1e-3;
const MODEL: &str = "tiny-llama";

/// The last prompt position's logits from each rank of a group of `size`, each rank on its
/// own thread with its shard of `model`.
fn sharded_last_logits(model: &str, size: usize, prompt: &[u32]) -> Vec<Vec<f32>> {
    let path = common::goldens().join(model);
    let block_size = 16;
    let handles: Vec<_> = ChannelCollective::group(size)
        .into_iter()
        .enumerate()
        .map(|(rank, member)| {
            let (path, prompt) = (path.clone(), prompt.to_vec());
            std::thread::spawn(move || {
                // Transformers' goldens hold with f32 activations.
                let backend = CpuBackend {
                    exact_activations: true,
                    ..Default::default()
                };
                let shard = TpShard { rank, size };
                let mut model = troupe::model::load_shard(&path, &backend, shard)
                    .unwrap()
                    .model;
                model.set_collective(Box::new(member));
                let num_blocks = prompt.len().div_ceil(block_size);
                let mut cache =
                    backend.alloc_kv_cache(model.kv_cache_shape(num_blocks, block_size));
                let table: Vec<u32> = (0..num_blocks as u32).collect();
                let step = SeqStep {
                    token_ids: &prompt,
                    num_cached_tokens: 0,
                    block_table: &table,
                    num_logit_rows: 1,
                    state: None,
                };
                model.forward(&backend, &mut cache, block_size, &[step])
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check_shards_against_transformers(model: &str, reference: &str) {
    let reference = common::read_json(reference);
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = common::ids(&case["prompt_ids"]);
        let want = common::floats(&case["last_logits"]);
        let ranks = sharded_last_logits(model, 2, &prompt);
        assert_eq!(ranks[0], ranks[1], "{model} case {i}: ranks disagree");
        let err = common::relative_error(&ranks[0], &want);
        assert!(
            err < LOGIT_TOLERANCE,
            "{model} case {i}: two ranks' logits off transformers' by {err}"
        );
    }
}

#[test]
fn two_ranks_of_tiny_llama_match_transformers() {
    check_shards_against_transformers("tiny-llama", "tiny-llama/reference.json");
}

#[test]
fn two_ranks_with_sharded_qkv_biases_match_transformers() {
    check_shards_against_transformers("tiny-qwen2", "tiny-qwen2/reference.json");
}

#[test]
fn two_ranks_with_per_head_qk_norm_match_transformers() {
    check_shards_against_transformers("tiny-qwen3", "tiny-qwen3/reference.json");
}

#[test]
fn two_ranks_of_a_q8_0_gguf_keep_packed_shards_and_match_transformers() {
    check_shards_against_transformers("tiny-llama-q8.gguf", "tiny-llama-q8.reference.json");
}

fn tp_config(size: usize) -> EngineConfig {
    let mut cfg = tiny_config(MODEL);
    cfg.tensor_parallel_size = size;
    cfg
}

async fn wait_for_steps(engine: &EngineHandle, n: u64) {
    while engine.status().await.unwrap().num_steps < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Submits `n` requests, injects `fault` once `steps_first` steps have run, and collects
/// every output.
async fn collect_all(
    engine: &EngineHandle,
    n: usize,
    seed: u64,
    steps_first: u64,
    fault: impl FnOnce(),
) -> (Vec<RequestOutput>, Vec<Vec<u32>>) {
    let requests = random_requests(n, 384, seed);
    let want = reference_outputs(MODEL, &requests);
    let mut streams = Vec::new();
    for r in requests {
        streams.push(engine.generate(r).await.unwrap());
    }
    wait_for_steps(engine, steps_first).await;
    fault();
    let mut got = Vec::new();
    for s in streams {
        got.push(
            tokio::time::timeout(Duration::from_secs(120), s.collect())
                .await
                .expect("every request finishes"),
        );
    }
    (got, want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_two_ranks_generates_the_reference_tokens() {
    let engine = Engine::spawn(tp_config(2)).await.unwrap();
    let requests = random_requests(24, 384, 31);
    let want = reference_outputs(MODEL, &requests);
    let got = ok_outputs(&engine, requests).await;
    assert_eq!(tokens(&got), want);
    let status = engine.status().await.unwrap();
    assert_eq!(status.tensor_parallel_size, 2);
    assert_eq!(engine.children().await.unwrap().workers.len(), 2);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_dying_mid_step_rebuilds_the_group_at_full_size() {
    let faults = FaultPlan::default();
    let engine = Engine::spawn_with_faults(tp_config(2), faults.clone())
        .await
        .unwrap();
    let (got, want) = collect_all(&engine, 48, 32, 4, || faults.panic_next_step()).await;
    assert_finished_unchanged(&engine, &got, &want).await;
    let status = engine.status().await.unwrap();
    assert!(status.num_resets >= 2, "no rebuild happened: {status:?}");
    assert_eq!(status.tensor_parallel_size, 2);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_actor_rebuilds_the_group() {
    let engine = Engine::spawn(tp_config(2)).await.unwrap();
    let children = engine.children().await.unwrap();
    let (got, want) =
        collect_all(&engine, 48, 33, 4, || children.workers[1].get_cell().kill()).await;
    assert_finished_unchanged(&engine, &got, &want).await;
    assert!(engine.status().await.unwrap().num_resets >= 2);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_device_shrinks_the_group_and_every_request_finishes() {
    let faults = FaultPlan::default();
    let engine = Engine::spawn_with_faults(tp_config(2), faults.clone())
        .await
        .unwrap();
    let (got, want) = collect_all(&engine, 48, 34, 4, || faults.lose_device(1)).await;
    assert_finished_unchanged(&engine, &got, &want).await;
    let status = engine.status().await.unwrap();
    assert_eq!(status.tensor_parallel_size, 1, "{status:?}");
    assert_eq!(engine.children().await.unwrap().workers.len(), 1);
    // The shrunk group serves new requests too.
    let requests = random_requests(8, 384, 35);
    let want = reference_outputs(MODEL, &requests);
    assert_eq!(tokens(&ok_outputs(&engine, requests).await), want);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_every_device_fails_every_request_with_the_reason() {
    let faults = FaultPlan::default();
    let engine = Engine::spawn_with_faults(tp_config(2), faults.clone())
        .await
        .unwrap();
    // At once: a request needs at least 8 steps, so none can finish before the loss
    // (after a few steps, a fast group could finish some first).
    let (got, _) = collect_all(&engine, 16, 36, 0, || {
        faults.lose_device(0);
        faults.lose_device(1);
    })
    .await;
    for o in &got {
        let e = o.error.as_deref().expect("no device is left to finish on");
        assert!(e.contains("no tensor-parallel group fits"), "{e}");
    }
    engine.shutdown(false).await;
}

#[tokio::test]
async fn a_group_size_the_model_cannot_split_into_is_refused_by_name() {
    let Err(e) = Engine::spawn(tp_config(3)).await else {
        panic!("3 ranks of a model with 4 heads started");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("does not divide the model's 4 attention heads"),
        "{msg}"
    );
}
