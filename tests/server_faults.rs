//! The server's health when the engine fails for good: `/health` turns 503 within a
//! second, with the reason in its body, and generation requests are refused with it.

mod common;

use std::time::{Duration, Instant};

use troupe::engine::EngineConfig;
use troupe::protocol::serve_options::ServeOptions;
use troupe::runner::fault::FaultPlan;

#[test]
fn a_permanent_rank_loss_turns_health_503_within_a_second_with_the_reason() {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-llama"));
    cfg.kv_cache_bytes = 16 << 20;
    let faults = FaultPlan::default();
    let server = common::server::start_with_faults(cfg, ServeOptions::new("tiny"), faults.clone());
    assert_eq!(server.get("/health").0, 200);
    faults.fail_next_starts(usize::MAX);
    let children = server.runtime.block_on(server.engine.children()).unwrap();
    children.workers[0].get_cell().kill();
    let lost = Instant::now();
    let (status, body) = loop {
        let (status, body) = server.get("/health");
        if status != 200 || lost.elapsed() > Duration::from_secs(1) {
            break (status, body);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        status,
        503,
        "still healthy {:?} after the loss",
        lost.elapsed()
    );
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["status"], "failed", "{body}");
    let reason = body["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("rank 0"), "{body}");
    let r = server.request(
        "POST",
        "/v1/completions",
        br#"{"prompt":[1,2,3],"max_tokens":2}"#,
    );
    assert_eq!(r.status, 503);
    assert!(String::from_utf8_lossy(&r.body).contains("no rank worker is left"));
}
