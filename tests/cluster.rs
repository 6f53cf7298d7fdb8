//! A router and two engines as real processes on loopback (`troupe router`,
//! `troupe serve --cluster`): the engines are seen joining and, killed, leaving; requests
//! through the router equal one engine's; a prompt goes to the engine whose cache holds
//! it; with an engine killed with SIGKILL, every request still gets its answer.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::cluster::{self, engine_view, get, names, router_up, wait_for};
use common::process::{HOST, ServeProcess, free_port, serve};
use common::server::raw_request;
use serde_json::{Value, json};

fn router(cluster_port: u16) -> ServeProcess {
    router_with(cluster_port, &[])
}

fn router_with(cluster_port: u16, extra: &[&str]) -> ServeProcess {
    // Every prompt of the tests' is handed over, however short.
    let mut args = vec!["--min-hand-off-tokens", "0"];
    args.extend_from_slice(extra);
    cluster::router(&common::smollm2_path(), cluster_port, &args)
}

fn engine(cluster_port: u16, name: &str, extra: &[&str]) -> ServeProcess {
    cluster::engine(&common::smollm2_path(), cluster_port, name, extra)
}

/// A completion's reply, as `body` asks it.
fn post(addr: SocketAddr, body: &Value) -> Value {
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let r = raw_request(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    r.json()
}

fn token_ids(reply: &Value) -> Vec<u64> {
    reply["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// Each body through `addr`, all at once.
fn burst(addr: SocketAddr, bodies: &[Value]) -> Vec<Vec<u64>> {
    std::thread::scope(|s| {
        let runs: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || token_ids(&post(addr, b))))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn greedy(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn complete(addr: SocketAddr, prompt: &[u32], max_tokens: usize) -> Vec<u64> {
    token_ids(&post(addr, &greedy(prompt, max_tokens)))
}

fn random_prompts(n: usize, seed: u64, len: usize) -> Vec<Vec<u32>> {
    let mut rng = common::Rng(seed);
    (0..n)
        .map(|_| (0..len).map(|_| 17 + rng.below(40_000) as u32).collect())
        .collect()
}

#[test]
fn a_router_over_two_engines() {
    let cluster_port = free_port();
    let router = router(cluster_port);
    // Its HTTP port opens after its cluster node: engines started now find the node.
    router_up(&router);
    let e1 = engine(cluster_port, "e1", &["--kv-cache-mib", "64"]);
    let mut e2 = engine(cluster_port, "e2", &["--kv-cache-mib", "64"]);
    let limit = Duration::from_secs(30);
    wait_for(router.addr, limit, |v| names(v) == ["e1", "e2"]);

    // 64 requests through the router at once: the burst spreads over both engines (each
    // request in flight counts until its reply ends), and each answer is one engine's.
    let prompts = random_prompts(64, 5, 24);
    let bodies: Vec<Value> = prompts.iter().map(|p| greedy(p, 8)).collect();
    let got = burst(router.addr, &bodies);
    let want: Vec<Vec<u64>> = prompts.iter().map(|p| complete(e1.addr, p, 8)).collect();
    assert_eq!(got, want);
    let view = get(router.addr, "/router/engines");
    for name in ["e1", "e2"] {
        assert!(
            engine_view(&view, name)["routed"].as_u64().unwrap() > 0,
            "{view}"
        );
    }

    // A long prompt e2 has computed goes to e2, whatever e1's load.
    let long = random_prompts(1, 9, 400).remove(0);
    complete(e2.addr, &long, 1);
    let before = wait_for(router.addr, limit, |v| {
        engine_view(v, "e2")["num_cached_blocks"].as_u64().unwrap() >= 24
    });
    complete(router.addr, &long, 1);
    let after = get(router.addr, "/router/engines");
    let routed = |v: &Value, n: &str| engine_view(v, n)["routed"].as_u64().unwrap();
    assert_eq!(routed(&after, "e2"), routed(&before, "e2") + 1, "{after}");
    assert_eq!(routed(&after, "e1"), routed(&before, "e1"), "{after}");

    // e2 killed with requests running on it: each request gets its whole answer (the
    // router sends it to e1, which prefills it again), e2 is gone from the view within a
    // second or so, and the router's metrics count what it re-routed.
    let long_runs: Vec<Value> = prompts[..12].iter().map(|p| greedy(p, 48)).collect();
    let streams: Vec<Value> = prompts[12..18].iter().map(|p| greedy(p, 48)).collect();
    let (got, streamed) = std::thread::scope(|s| {
        let runs = s.spawn(|| burst(router.addr, &long_runs));
        let streamed: Vec<_> = streams
            .iter()
            .map(|b| s.spawn(|| stream_events(router.addr, b)))
            .collect();
        wait_for(router.addr, limit, |v| {
            engine_view(v, "e2")["num_running"].as_u64().unwrap() > 0
        });
        e2.signal(libc::SIGKILL);
        let killed = Instant::now();
        e2.wait_exit(Duration::from_secs(10));
        wait_for(router.addr, limit, |v| names(v) == ["e1"]);
        assert!(
            killed.elapsed() < Duration::from_secs(3),
            "{:?}",
            killed.elapsed()
        );
        let streamed: Vec<_> = streamed.into_iter().map(|r| r.join().unwrap()).collect();
        (runs.join().unwrap(), streamed)
    });
    // Only a stream e2 had already sent events on may end with an error event (and
    // [DONE]): one that had sent nothing is re-run on e1 and comes back whole, as every
    // non-streamed request does.
    for (body, events) in streams.iter().zip(streamed) {
        match events {
            Ok(text) => {
                let want = post(e1.addr, body)["choices"][0]["text"].clone();
                assert_eq!(json!(text), want);
            }
            Err((error, sent)) => {
                assert!(error.contains("failed mid-reply"), "{error}");
                assert!(sent > 0, "a stream that had sent nothing was lost: {error}");
            }
        }
    }
    let want: Vec<Vec<u64>> = long_runs
        .iter()
        .map(|b| token_ids(&post(e1.addr, b)))
        .collect();
    assert_eq!(got, want);
    let view = get(router.addr, "/router/engines");
    assert!(view["rerouted"].as_u64().unwrap() > 0, "{view}");
    let metrics = raw_request(router.addr, "GET", "/metrics", &HOST, b"");
    let text = String::from_utf8(metrics.payload()).unwrap();
    let rerouted = format!("troupe_router_rerouted_total {}", view["rerouted"]);
    assert!(text.contains(&rerouted), "{text}");
    assert!(
        text.contains("troupe_router_engine_running{engine=\"e1\",role=\"both\"}"),
        "{text}"
    );

    drop(e1);
    wait_for(router.addr, limit, |v| names(v).is_empty());
    let r = raw_request(router.addr, "GET", "/health", &HOST, b"");
    assert_eq!(r.status, 503, "no engine left");
}

#[test]
fn a_prefill_engine_hands_its_kv_to_a_decode_engine() {
    let cluster_port = free_port();
    let router = router(cluster_port);
    router_up(&router);
    let (mut p, _d, solo) = hand_offs(&router, cluster_port, "auto", 64);
    let view = get(router.addr, "/router/engines");
    // The two engines share this host: the KV went through shared memory.
    assert_eq!(view["hand_offs_by_transport"]["shm"], 64, "{view}");

    // The router killed and started again on the same cluster address: the engines
    // connect to it again on their own, and the cluster answers as before.
    let mut router = router;
    router.signal(libc::SIGKILL);
    router.wait_exit(Duration::from_secs(10));
    let router = self::router(cluster_port);
    wait_for(router.addr, Duration::from_secs(30), |v| {
        names(v) == ["d1", "p1"]
    });
    let again = random_prompts(1, 99, 100).remove(0);
    let got = complete(router.addr, &again, 8);
    assert_eq!(get(router.addr, "/router/engines")["hand_offs"], 1);
    assert_eq!(got, complete(solo.addr, &again, 8));

    // With the prefill engine gone, the decode engine prefills prompts itself.
    p.signal(libc::SIGKILL);
    p.wait_exit(Duration::from_secs(10));
    wait_for(router.addr, Duration::from_secs(30), |v| names(v) == ["d1"]);
    let alone = random_prompts(1, 98, 300).remove(0);
    assert_eq!(
        complete(router.addr, &alone, 8),
        complete(solo.addr, &alone, 8)
    );
    assert_eq!(get(router.addr, "/router/engines")["hand_offs"], 1);
}

/// A prefill engine (`--kv-transport transport`) and a decode engine behind `router`,
/// and `n` requests at once, of drawn lengths, greedy and seeded: prefilled on the one,
/// their KV handed to the other, which answers as one engine alone does. The two
/// engines and the engine alone.
fn hand_offs(
    router: &ServeProcess,
    cluster_port: u16,
    transport: &str,
    n: u64,
) -> (ServeProcess, ServeProcess, ServeProcess) {
    let p = engine(
        cluster_port,
        "p1",
        &[
            "--role",
            "prefill",
            "--kv-cache-mib",
            "256",
            "--kv-transport",
            transport,
        ],
    );
    let d = engine(
        cluster_port,
        "d1",
        &["--role", "decode", "--kv-cache-mib", "256"],
    );
    wait_for(router.addr, Duration::from_secs(30), |v| {
        names(v) == ["d1", "p1"]
    });
    let mut rng = common::Rng(21 + n);
    let bodies: Vec<Value> = (0..n)
        .map(|i| {
            let len = 20 + rng.below(100);
            let prompt = &random_prompts(1, 100 + i, len)[0];
            match i % 2 {
                0 => greedy(prompt, 8),
                _ => json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.9,
                            "seed": i, "ignore_eos": true}),
            }
        })
        .collect();
    let got = burst(router.addr, &bodies);
    let view = get(router.addr, "/router/engines");
    assert_eq!(view["hand_offs"], n, "{view}");
    assert_eq!(view["failed_hand_offs"], 0, "{view}");
    assert_eq!(engine_view(&view, "d1")["routed"], n, "{view}");
    assert_eq!(engine_view(&view, "p1")["routed"], 0, "{view}");
    // Every full block of every prompt moved, and d1 computed none of them again.
    let full_blocks: u64 = bodies
        .iter()
        .map(|b| (b["prompt"].as_array().unwrap().len() as u64 - 1) / 16)
        .sum();
    assert_eq!(view["kv_blocks_moved"], full_blocks, "{view}");
    assert!(view["kv_bytes_moved"].as_u64().unwrap() > 0, "{view}");
    assert_eq!(cluster::host_hit_blocks(d.addr), full_blocks);
    let solo = serve(&["--kv-cache-mib", "256"], &[]);
    let want: Vec<Vec<u64>> = bodies
        .iter()
        .map(|b| token_ids(&post(solo.addr, b)))
        .collect();
    assert_eq!(got, want);
    (p, d, solo)
}

#[test]
fn kv_told_to_keep_to_tcp_goes_over_tcp_with_the_same_answers() {
    let cluster_port = free_port();
    let router = router(cluster_port);
    router_up(&router);
    let _engines = hand_offs(&router, cluster_port, "tcp", 12);
    let view = get(router.addr, "/router/engines");
    assert_eq!(view["hand_offs_by_transport"]["tcp"], 12, "{view}");
    assert!(
        view["hand_offs_by_transport"].get("shm").is_none(),
        "{view}"
    );
    let metrics = raw_request(router.addr, "GET", "/metrics", &HOST, b"");
    let metrics = String::from_utf8(metrics.payload()).unwrap();
    assert!(
        metrics.contains("troupe_router_hand_offs_by_transport_total{transport=\"tcp\"} 12"),
        "{metrics}"
    );
}

/// A streamed completion's text, from its events (an error event fails the test).
fn streamed_text(addr: SocketAddr, body: &Value) -> String {
    stream_events(addr, body).unwrap()
}

/// A streamed completion's text, or the message of the error event that ended it; the
/// stream must end with [DONE] either way.
/// A stream's whole text, or its error and how many events came before it.
fn stream_events(addr: SocketAddr, body: &Value) -> Result<String, (String, usize)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let r = raw_request(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200);
    let payload = String::from_utf8(r.payload()).unwrap();
    let mut text = String::new();
    let (mut done, mut error_message, mut num_events) = (false, None, 0);
    for data in payload.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let event: Value = serde_json::from_str(data).unwrap();
        if let Some(error) = event.get("error") {
            let message = error["message"].as_str().unwrap_or_default().to_string();
            error_message = Some((message, num_events));
            continue;
        }
        num_events += 1;
        text.push_str(event["choices"][0]["text"].as_str().unwrap_or_default());
    }
    assert!(done, "the stream ended without [DONE]: {payload}");
    error_message.map_or(Ok(text), Err)
}

#[test]
fn a_draining_engine_moves_its_requests_to_a_peer() {
    let cluster_port = free_port();
    let router = router(cluster_port);
    router_up(&router);
    // A loaded CI machine may take a while: the moved streams are not cut short.
    let flags = [
        "--kv-cache-mib",
        "64",
        "--drain-to",
        "auto",
        "--shutdown-timeout",
        "100",
    ];
    // e1's log says what moved and what stayed.
    let log = common::scratch_dir("drain").join("e1.log");
    let cluster = format!("127.0.0.1:{cluster_port}");
    let smollm2 = common::smollm2_path().display().to_string();
    let mut e1_args = vec![
        "--model",
        &smollm2,
        "--cluster",
        &cluster,
        "--node-name",
        "e1",
    ];
    e1_args.extend_from_slice(&flags);
    let mut e1 = common::process::serve_logging_to(
        &e1_args,
        &[],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let e2 = engine(cluster_port, "e2", &flags);
    let limit = Duration::from_secs(30);
    wait_for(router.addr, limit, |v| names(v) == ["e1", "e2"]);

    // Streams through the router, greedy and seeded; e1 gets SIGTERM while it runs some
    // of them: they move to e2 with their KV, and every stream goes on to its end.
    let prompts = random_prompts(12, 31, 40);
    let bodies: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| match i % 2 {
            0 => greedy(p, 128),
            _ => json!({"prompt": p, "max_tokens": 128, "temperature": 0.8, "seed": i,
                        "ignore_eos": true}),
        })
        .collect();
    let got: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(|| streamed_text(router.addr, b)))
            .collect();
        // Running there with their prompts computed (blocks in its cache), so there is
        // KV to move whatever the machine's load.
        wait_for(router.addr, limit, |v| {
            let e1 = engine_view(v, "e1");
            e1["num_running"].as_u64().unwrap() > 0 && e1["num_cached_blocks"].as_u64().unwrap() > 0
        });
        e1.signal(libc::SIGTERM);
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let status = e1.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    // Every request on e1 could move (greedy or seeded, one completion, no grammar):
    // all of them did, none stayed.
    let said = std::fs::read_to_string(&log).unwrap();
    let line = said
        .lines()
        .find(|l| l.starts_with("troupe: draining:"))
        .unwrap_or_else(|| panic!("no drain line: {said}"));
    let moved: usize = line
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(moved > 0, "{line}");
    assert!(line.ends_with(", 0 staying to finish here"), "{line}");
    // e2 found the moved requests' blocks in its store: they came with them.
    assert!(cluster::host_hit_blocks(e2.addr) > 0);
    let want: Vec<String> = bodies
        .iter()
        .map(|b| {
            post(e2.addr, b)["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(got, want);
}

/// With `--api-key` the router's own routes ask for the key as `serve`'s do (they answered
/// anyone: `/router/engines` names every engine and its load), in `serve`'s error shape for
/// each API; `/health` stays open to the load balancer.
#[test]
fn the_routers_own_routes_ask_for_its_key() {
    let router = router_with(free_port(), &["--api-key", "sk-router"]);
    router_up(&router);
    let keyed = [("host", "127.0.0.1"), ("authorization", "Bearer sk-router")];
    let wrong = [("host", "127.0.0.1"), ("x-api-key", "sk-other")];
    for path in ["/router/engines", "/metrics", "/v1/completions"] {
        for headers in [&HOST[..], &wrong[..]] {
            let r = raw_request(router.addr, "GET", path, headers, b"");
            assert_eq!(r.status, 401, "{path}");
            let body = r.json();
            assert_eq!(body["error"]["code"], "invalid_api_key", "{path}: {body}");
            assert_eq!(
                body["error"]["type"], "invalid_request_error",
                "{path}: {body}"
            );
        }
    }
    assert_eq!(
        raw_request(router.addr, "GET", "/router/engines", &keyed, b"").status,
        200
    );
    assert_eq!(
        raw_request(router.addr, "GET", "/metrics", &keyed, b"").status,
        200
    );
    let r = raw_request(router.addr, "POST", "/v1/messages", &HOST, b"{}");
    assert_eq!(r.status, 401);
    assert_eq!(
        r.json()["error"]["type"],
        "authentication_error",
        "Anthropic's shape"
    );
    // Keyed, a request with no engine to take it is a 503 in the same shape.
    let r = raw_request(router.addr, "POST", "/v1/completions", &keyed, b"{}");
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["type"], "server_error");
}
