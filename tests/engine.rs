//! The actor engine end to end on the CPU backend: concurrent batches equal one-at-a-time
//! runs, ZOS on and off agree, the prefix cache hits, aborts and disconnects free blocks.

mod common;

use common::engine::{random_requests, reference_outputs, tiny_config, tokens};
use troupe::engine::{Engine, EngineHandle, FinishReason};

async fn ok_outputs(
    engine: &EngineHandle,
    requests: Vec<troupe::engine::EngineRequest>,
) -> Vec<troupe::engine::RequestOutput> {
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

async fn assert_all_blocks_free(engine: &EngineHandle) {
    // Deferred releases land when the last in-flight step reports back.
    for _ in 0..100 {
        let s = engine.status().await.unwrap();
        if s.num_free_blocks == s.num_total_blocks && s.num_running == 0 && s.num_waiting == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let s = engine.status().await.unwrap();
    panic!("blocks leaked: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_requests_equal_one_at_a_time_runs() {
    for model in ["tiny-llama", "tiny-qwen3"] {
        let requests = random_requests(64, 384, 11);
        let want = reference_outputs(model, &requests);
        for zos in [true, false] {
            let mut cfg = tiny_config(model);
            cfg.zero_overhead_scheduling = zos;
            let engine = Engine::spawn(cfg).await.unwrap();
            let got = ok_outputs(&engine, requests.clone()).await;
            assert_eq!(tokens(&got), want, "{model}, zos={zos}");
            assert!(
                got.iter()
                    .all(|o| o.finish_reason == Some(FinishReason::Length))
            );
            assert_all_blocks_free(&engine).await;
            engine.shutdown(true).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_hits_the_prefix_cache_and_generates_the_same() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let mut req = random_requests(1, 384, 5).remove(0);
    req.prompt_ids = (0..70).map(|i| 5 + i * 3).collect();
    let first = ok_outputs(&engine, vec![req.clone()]).await;
    let before = engine.status().await.unwrap();
    let second = ok_outputs(&engine, vec![req]).await;
    let after = engine.status().await.unwrap();
    assert_eq!(tokens(&first), tokens(&second));
    // 70 tokens = 4 full 16-token blocks, all cached by the first run.
    assert_eq!(
        after.num_prefix_hit_blocks - before.num_prefix_hit_blocks,
        4,
        "{after:?}"
    );
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_dropped_streams_free_every_block() {
    let engine = Engine::spawn(tiny_config("tiny-qwen2")).await.unwrap();
    let mut requests = random_requests(8, 384, 9);
    for r in &mut requests {
        r.max_tokens = 400;
    }
    let mut streams = Vec::new();
    for r in requests {
        streams.push(engine.generate(r).await.unwrap());
    }
    // Half are aborted by id after their first token, half dropped (a disconnect).
    let mut kept = Vec::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        let first = s.next().await.unwrap();
        assert!(first.error.is_none());
        if i % 2 == 0 {
            engine.abort(s.request_id);
            kept.push(s);
        }
    }
    for s in kept {
        let out = s.collect().await;
        assert_eq!(out.finish_reason, Some(FinishReason::Abort));
    }
    assert_all_blocks_free(&engine).await;
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_refused_with_the_numbers() {
    let mut cfg = tiny_config("tiny-llama");
    cfg.kv_cache_bytes = 1; // rounds up to a single 16-token block
    let engine = Engine::spawn(cfg).await.unwrap();
    let mut req = random_requests(1, 384, 1).remove(0);
    req.prompt_ids = vec![7; 100];
    let err = engine
        .generate(req)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("blocks"), "{err}");
    engine.shutdown(true).await;
}
