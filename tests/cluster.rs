//! A router and two engines as real processes on loopback (`troupe router`,
//! `troupe serve --cluster`): the engines are seen joining and, killed, leaving; requests
//! through the router equal one engine's; a prompt goes to the engine whose cache holds
//! it; with an engine killed with SIGKILL, every request still gets its answer.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{HOST, ServeProcess, free_port, serve};
use common::server::raw_request;
use serde_json::{Value, json};

fn router(cluster_port: u16) -> ServeProcess {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["router", "--model"])
        .arg(common::smollm2_path())
        .args(["--listen", &format!("127.0.0.1:{cluster_port}")])
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("troupe router starts");
    ServeProcess {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    }
}

fn engine(cluster_port: u16, name: &str) -> ServeProcess {
    let cluster = format!("127.0.0.1:{cluster_port}");
    serve(
        &[
            "--cluster",
            &cluster,
            "--node-name",
            name,
            "--kv-cache-mib",
            "64",
        ],
        &[],
    )
}

fn get(addr: SocketAddr, path: &str) -> Value {
    let r = raw_request(addr, "GET", path, &HOST, b"");
    assert_eq!(r.status, 200, "{path}");
    r.json()
}

fn complete(addr: SocketAddr, prompt: &[u32], max_tokens: usize) -> Vec<u64> {
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let r = raw_request(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    let v = r.json();
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The router's view, once `ready` holds of it (within `limit`).
fn wait_for(router: SocketAddr, limit: Duration, ready: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let r = raw_request(router, "GET", "/router/engines", &HOST, b"");
        if r.status == 200 {
            let v = r.json();
            if ready(&v) {
                return v;
            }
        }
        assert!(
            started.elapsed() < limit,
            "the router's view did not settle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn names(v: &Value) -> Vec<String> {
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["node_name"].as_str().unwrap().to_string())
        .collect()
}

fn engine_view<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["node_name"] == name)
        .unwrap()
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
    let started = Instant::now();
    while raw_request(router.addr, "GET", "/health", &HOST, b"").status != 503 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the router did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let e1 = engine(cluster_port, "e1");
    let mut e2 = engine(cluster_port, "e2");
    let limit = Duration::from_secs(30);
    wait_for(router.addr, limit, |v| names(v) == ["e1", "e2"]);

    // Through the router, concurrently: the burst spreads over both engines (each request
    // in flight counts until its reply ends), and each answer is one engine's alone.
    let prompts = random_prompts(12, 5, 24);
    let got: Vec<Vec<u64>> = std::thread::scope(|s| {
        let runs: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| complete(router.addr, p, 8)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let want: Vec<Vec<u64>> = prompts.iter().map(|p| complete(e1.addr, p, 8)).collect();
    assert_eq!(got, want);
    let burst = get(router.addr, "/router/engines");
    for name in ["e1", "e2"] {
        assert!(
            engine_view(&burst, name)["routed"].as_u64().unwrap() > 0,
            "{burst}"
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

    // e2 killed: gone from the view within a second or so, and e1 answers everything.
    e2.signal(libc::SIGKILL);
    e2.wait_exit(Duration::from_secs(10));
    let killed = Instant::now();
    wait_for(router.addr, limit, |v| names(v) == ["e1"]);
    assert!(
        killed.elapsed() < Duration::from_secs(3),
        "{:?}",
        killed.elapsed()
    );
    for p in &prompts[..4] {
        assert_eq!(complete(router.addr, p, 8), complete(e1.addr, p, 8));
    }
    drop(e1);
    wait_for(router.addr, limit, |v| names(v).is_empty());
    let r = raw_request(router.addr, "GET", "/health", &HOST, b"");
    assert_eq!(r.status, 503, "no engine left");
}
