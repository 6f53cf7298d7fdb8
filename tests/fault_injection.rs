//! Killing and breaking actors while 64 requests are in flight: the supervisor restarts
//! what died, sequences are recomputed, and every request finishes as if nothing happened
//! — or, when a rank cannot come back, ends with a clear error within 5 s.

mod common;

use std::time::Duration;

use common::engine::{
    assert_finished_unchanged, kill_rank_0, random_requests, reference_outputs, tiny_config,
    wait_for_steps,
};
use troupe::engine::{Engine, EngineHandle, RequestOutput, RequestStream};
use troupe::runner::fault::FaultPlan;

const MODEL: &str = "tiny-llama";

async fn submit_all(
    engine: &EngineHandle,
    n: usize,
    seed: u64,
) -> (Vec<RequestStream>, Vec<Vec<u32>>) {
    let requests = random_requests(n, 384, seed);
    let want = reference_outputs(MODEL, &requests);
    let mut streams = Vec::new();
    for r in requests {
        streams.push(engine.generate(r).await.unwrap());
    }
    (streams, want)
}

/// Every stream's output; a recovery that deadlocks fails here instead of hanging CI.
async fn collect(streams: Vec<RequestStream>) -> Vec<RequestOutput> {
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(s.collect()))
        .collect();
    let all = async {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("every request ends within 120 s")
}

async fn assert_recovered(engine: &EngineHandle, got: &[RequestOutput], want: &[Vec<u32>]) {
    let status = assert_finished_unchanged(engine, got, want).await;
    assert!(status.num_resets >= 2, "no restart happened: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_rank_worker_is_restarted_and_requests_finish_unchanged() {
    let engine = Engine::spawn(tiny_config(MODEL)).await.unwrap();
    let (streams, want) = submit_all(&engine, 64, 21).await;
    wait_for_steps(&engine, 4).await;
    kill_rank_0(&engine).await;
    let got = collect(streams).await;
    assert_recovered(&engine, &got, &want).await;
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_worker_panicking_mid_step_is_restarted() {
    let engine = Engine::spawn(tiny_config(MODEL)).await.unwrap();
    let (streams, want) = submit_all(&engine, 64, 22).await;
    wait_for_steps(&engine, 4).await;
    engine.faults().panic_next_step();
    let got = collect(streams).await;
    assert_recovered(&engine, &got, &want).await;
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_readback_restarts_the_rank_and_requests_finish_unchanged() {
    // Without ZOS nothing else is launched while a step's results are awaited: a readback
    // that died silently would leave the engine waiting forever.
    let mut cfg = tiny_config(MODEL);
    cfg.zero_overhead_scheduling = false;
    let engine = Engine::spawn(cfg).await.unwrap();
    let (streams, want) = submit_all(&engine, 64, 26).await;
    wait_for_steps(&engine, 4).await;
    engine.faults().fail_next_readback();
    let got = tokio::time::timeout(Duration::from_secs(60), collect(streams))
        .await
        .expect("requests finish after the rank restarts");
    assert_recovered(&engine, &got, &want).await;
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sampler_is_restarted_and_requests_finish_unchanged() {
    let engine = Engine::spawn(tiny_config(MODEL)).await.unwrap();
    let (streams, want) = submit_all(&engine, 64, 23).await;
    wait_for_steps(&engine, 4).await;
    engine.children().await.unwrap().sampler.get_cell().kill();
    let got = collect(streams).await;
    assert_recovered(&engine, &got, &want).await;
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_cannot_restart_fails_every_request_clearly_and_fast() {
    let faults = FaultPlan::default();
    let engine = Engine::spawn_with_faults(tiny_config(MODEL), faults.clone())
        .await
        .unwrap();
    let (streams, _) = submit_all(&engine, 64, 24).await;
    wait_for_steps(&engine, 2).await;
    faults.fail_next_starts(usize::MAX);
    kill_rank_0(&engine).await;
    let got = tokio::time::timeout(Duration::from_secs(5), collect(streams))
        .await
        .expect("every request ends within 5 s");
    for o in &got {
        if o.finish_reason.is_none() {
            let err = o
                .error
                .as_deref()
                .expect("an unfinished request carries an error");
            assert!(err.contains("rank 0"), "{err}");
        }
    }
    assert!(
        got.iter().any(|o| o.error.is_some()),
        "the failure reached no request"
    );
    let refused = engine.generate(random_requests(1, 384, 1).remove(0)).await;
    let err = refused.err().expect("new requests are refused").to_string();
    assert!(err.contains("no rank worker is left"), "{err}");
    engine.shutdown(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_random_aborts_return_every_block() {
    let engine = Engine::spawn(tiny_config(MODEL)).await.unwrap();
    let requests = random_requests(1000, 384, 25);
    let mut tasks = Vec::new();
    for (i, r) in requests.into_iter().enumerate() {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = engine.generate(r).await.unwrap();
            let h = troupe::sampling::splitmix64(i as u64);
            // Abort after 0–3 outputs, by id or by dropping the stream.
            for _ in 0..h % 4 {
                if s.next().await.is_none_or(|o| o.is_final()) {
                    return;
                }
            }
            if h % 8 < 4 {
                engine.abort(s.request_id);
                let out = s.collect().await;
                assert!(out.error.is_none());
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("every request ends within 120 s");
    let mut status = engine.status().await.unwrap();
    for _ in 0..200 {
        if status.num_free_blocks == status.num_total_blocks
            && status.num_running + status.num_waiting == 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = engine.status().await.unwrap();
    }
    assert_eq!(
        status.num_free_blocks, status.num_total_blocks,
        "blocks leaked: {status:?}"
    );
    assert_eq!(status.num_running + status.num_waiting, 0, "{status:?}");
    engine.shutdown(true).await;
}

/// Kills rank 0 twice, `gap` apart, with a budget of one restart per `window`.
async fn kill_twice(window: Duration, gap: Duration) -> (EngineHandle, Vec<RequestOutput>) {
    let mut cfg = tiny_config(MODEL);
    cfg.max_rank_restarts = 1;
    cfg.rank_restart_window = window;
    let engine = Engine::spawn(cfg).await.unwrap();
    kill_rank_0(&engine).await;
    let first_restart = async {
        while engine.status().await.unwrap().num_resets < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), first_restart)
        .await
        .expect("the first kill is restarted");
    tokio::time::sleep(gap).await;
    let (streams, _) = submit_all(&engine, 16, 27).await;
    wait_for_steps(&engine, engine.status().await.unwrap().num_steps + 2).await;
    kill_rank_0(&engine).await;
    let got = collect(streams).await;
    (engine, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_budget_is_a_rate_that_refills_after_its_window() {
    let (engine, got) = kill_twice(Duration::from_millis(300), Duration::from_millis(600)).await;
    assert!(
        got.iter()
            .all(|o| o.error.is_none() && o.finish_reason.is_some()),
        "a restart after the window was refused: {:?}",
        got.iter().find_map(|o| o.error.clone())
    );
    let status = engine.status().await.unwrap();
    assert_eq!(status.failure, None);
    assert!(status.num_resets >= 3, "{status:?}");
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_failure_inside_the_window_is_permanent_and_says_why() {
    let (engine, got) = kill_twice(Duration::from_secs(600), Duration::ZERO).await;
    assert!(got.iter().any(|o| o.error.is_some()), "the engine went on");
    let failure = engine.status().await.unwrap().failure.expect("a failure");
    assert!(failure.contains("2 times within 600 s"), "{failure}");
    engine.shutdown(false).await;
}
