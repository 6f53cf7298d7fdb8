//! A cluster of real processes on loopback: `troupe router` and engines joining it, and
//! the router's view and counters read back (each wait with a time bound).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::process::{HOST, ServeProcess, free_port, serve_model};
use super::server::raw_request;

/// `troupe router` for `model` on cluster port `cluster_port`, `extra` flags after; not
/// waited for (`router_up`).
pub fn router(model: &Path, cluster_port: u16, extra: &[&str]) -> ServeProcess {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["router", "--model"])
        .arg(model)
        .args(["--listen", &format!("127.0.0.1:{cluster_port}")])
        .args(["--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("troupe router starts");
    ServeProcess {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    }
}

/// The router's HTTP port answers (503 until an engine joins): its node is up.
pub fn router_up(router: &ServeProcess) {
    let started = Instant::now();
    while raw_request(router.addr, "GET", "/health", &HOST, b"").status != 503 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the router did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `troupe serve` on `model`, joined to the cluster as `name`, once it answers.
pub fn engine(model: &Path, cluster_port: u16, name: &str, extra: &[&str]) -> ServeProcess {
    let cluster = format!("127.0.0.1:{cluster_port}");
    let mut args = vec!["--cluster", &cluster, "--node-name", name];
    args.extend_from_slice(extra);
    serve_model(model, &args, &[])
}

pub fn get(addr: SocketAddr, path: &str) -> Value {
    let r = raw_request(addr, "GET", path, &HOST, b"");
    assert_eq!(r.status, 200, "{path}");
    r.json()
}

/// The router's view, once `ready` holds of it (within `limit`).
pub fn wait_for(router: SocketAddr, limit: Duration, ready: impl Fn(&Value) -> bool) -> Value {
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

/// The engines of the router's view, by name (sorted as the router lists them).
pub fn names(v: &Value) -> Vec<String> {
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["node_name"].as_str().unwrap().to_string())
        .collect()
}

pub fn engine_view<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["node_name"] == name)
        .unwrap()
}

/// A counter of `addr`'s `/metrics` (summed over its labels).
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let r = raw_request(addr, "GET", "/metrics", &HOST, b"");
    assert_eq!(r.status, 200);
    String::from_utf8_lossy(&r.payload())
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(key, _)| {
            let key = key.split('{').next().unwrap();
            key == name || key == format!("{name}_total")
        })
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum()
}

/// Prompt blocks an engine found in its host-memory prefix store (handed-over KV).
pub fn host_hit_blocks(addr: SocketAddr) -> u64 {
    let r = raw_request(addr, "GET", "/metrics", &HOST, b"");
    let text = String::from_utf8(r.payload()).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("troupe_prefix_hit_blocks_total{tier=\"host\"} "))
        .map_or(0, |v| v.trim().parse().unwrap())
}
