//! Load on a live server: 200 concurrent streaming clients on loopback, a third of them
//! hanging up mid-stream. Every finished stream is well-formed, the run ends in bounded
//! time, and afterwards every KV block is back and the server still serves.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use troupe::engine::EngineConfig;
use troupe::sampling::splitmix64;

const NUM_CLIENTS: usize = 200;

#[derive(Debug, PartialEq)]
enum Outcome {
    Completed,
    HungUp,
}

/// The token budget of client `i` and, for those that hang up, after how many bytes.
fn plan(i: usize) -> (u64, Option<usize>) {
    let h = |k: u64| splitmix64(0x10ad ^ splitmix64(i as u64 * 31 + k));
    if h(2) % 3 == 0 {
        // Long enough that the hang-up lands while the request is still generating.
        (300 + h(0) % 150, Some(200 + (h(3) % 1500) as usize))
    } else {
        (16 + h(0) % 48, None)
    }
}

fn client(server: &common::server::TestServer, i: usize) -> Result<Outcome, String> {
    let h = |k: u64| splitmix64(0x10ad ^ splitmix64(i as u64 * 31 + k));
    let (max_tokens, hang_up_after) = plan(i);
    let (path, body, end_marker) = match h(1) % 3 {
        0 => (
            "/v1/chat/completions",
            format!(
                r#"{{"messages":[{{"role":"user","content":"client {i}"}}],"max_tokens":{max_tokens},"stream":true,"ignore_eos":true,"temperature":0.8,"seed":{i}}}"#
            ),
            "data: [DONE]",
        ),
        1 => (
            "/v1/completions",
            format!(
                r#"{{"prompt":[{},{},{}],"max_tokens":{max_tokens},"stream":true,"ignore_eos":true}}"#,
                1 + i % 300,
                2 + i % 200,
                3
            ),
            "data: [DONE]",
        ),
        _ => (
            "/v1/messages",
            format!(
                r#"{{"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"client {i}"}}],"stream":true}}"#
            ),
            "event: message_stop",
        ),
    };
    let mut s = server.connect();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body.as_bytes()))
        .map_err(|e| format!("client {i}: send: {e}"))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let n = s
            .read(&mut buf)
            .map_err(|e| format!("client {i}: read: {e}"))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if hang_up_after.is_some_and(|at| raw.len() >= at) {
            // Dropping the socket is the disconnect.
            return Ok(Outcome::HungUp);
        }
    }
    let text = String::from_utf8_lossy(&raw);
    if !text.starts_with("HTTP/1.1 200") {
        return Err(format!("client {i}: {}", &text[..text.len().min(300)]));
    }
    if !text.contains(end_marker) {
        return Err(format!("client {i}: stream ended without `{end_marker}`"));
    }
    Ok(Outcome::Completed)
}

#[test]
fn two_hundred_streaming_clients_with_disconnects_leave_nothing_behind() {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 16 << 20;
    let server = common::server::start(cfg, "tiny");
    let started = Instant::now();
    let outcomes: Vec<Result<Outcome, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..NUM_CLIENTS)
            .map(|i| {
                let server = &server;
                scope.spawn(move || client(server, i))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = started.elapsed();
    let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(
        errors.is_empty(),
        "{} failed: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    let num_hung_up = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Outcome::HungUp)))
        .count();
    assert!(
        num_hung_up > 20 && num_hung_up < NUM_CLIENTS - 20,
        "{num_hung_up} hung up"
    );
    assert!(
        elapsed < Duration::from_secs(120),
        "the load took {elapsed:?}"
    );
    // The hung-up requests were aborted, not run to their budget.
    let budget: u64 = (0..NUM_CLIENTS).map(|i| plan(i).0).sum();
    let metrics = String::from_utf8(server.get("/metrics").1).unwrap();
    let generated: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("troupe_generation_tokens_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("metrics count generated tokens");
    assert!(
        generated < 0.8 * budget as f64,
        "{generated} tokens generated of a {budget} budget: aborts did not stop generation"
    );
    server
        .wait_idle(Duration::from_secs(30))
        .unwrap_or_else(|s| {
            panic!("after {num_hung_up} disconnects, blocks or requests were left: {s:?}")
        });
    assert_eq!(server.get("/health").0, 200);
    let after = server.request(
        "POST",
        "/v1/completions",
        br#"{"prompt":[1,2,3],"max_tokens":4,"ignore_eos":true}"#,
    );
    assert_eq!(
        after.status,
        200,
        "{}",
        String::from_utf8_lossy(&after.body)
    );
}

#[test]
fn a_non_streaming_client_that_hangs_up_aborts_its_request() {
    // The default model: slow enough on a CPU that the request is still generating when
    // the client leaves.
    let server = common::server::start(EngineConfig::new(common::smollm2_path()), "smollm2");
    let body = br#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":1500,"ignore_eos":true}"#;
    let mut s = server.connect();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let started = Instant::now();
    while server.status().num_running == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s);
    // Heartbeats go out every second; the second write after the hang-up fails.
    server
        .wait_idle(Duration::from_secs(10))
        .unwrap_or_else(|st| panic!("still running after the client left: {st:?}"));
    let generated = server.status().num_decode_tokens;
    assert!(generated < 1000, "{generated} tokens: the request ran on");
}
