//! Soak: the default model served for a while under mixed traffic — chat and completions,
//! streamed and not, clients that hang up mid-stream or before any byte, a prefix store
//! whose host and disk tiers are full (every save evicts), and a rank killed every few
//! seconds — then everything back where it started: every request the clients waited
//! for answered, every KV block and state slot free, resident memory and open files flat
//! against where they stood after the warm-up.
//!
//! Bounded for CI (`TROUPE_SOAK_SECS`, default 75 s, a kill every `TROUPE_SOAK_KILL_SECS`,
//! default 20 s); the long mode is an hour with a kill every three minutes:
//! `TROUPE_SOAK_SECS=3600 TROUPE_SOAK_KILL_SECS=180 cargo test --release --test soak`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Rng;
use serde_json::json;
use troupe::engine::EngineConfig;
use troupe::store::KvStoreConfig;

const CLIENTS: usize = 3;

fn secs(var: &str, default: u64) -> Duration {
    Duration::from_secs(
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

/// Resident bytes and open descriptors of this process.
fn footprint() -> (u64, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    (rss_kib << 10, fds)
}

/// Prompts that share beginnings, so the prefix cache and store are used and evicted.
fn prompt(rng: &mut Rng) -> String {
    const OPENINGS: [&str; 4] = [
        "You are a careful assistant. Answer in one sentence.",
        "Summarise the following notes for a busy reader.",
        "Translate to French, keeping names as they are.",
        "List three facts about the topic below.",
    ];
    const TOPICS: [&str; 6] = ["rivers", "the moon", "bread", "trains", "owls", "glass"];
    format!(
        "{} Topic: {} #{}",
        rng.pick(&OPENINGS),
        rng.pick(&TOPICS),
        rng.below(50)
    )
}

enum Outcome {
    Answered,
    HungUp,
}

/// One client request of a random kind; an error names what went wrong.
fn one_request(addr: std::net::SocketAddr, rng: &mut Rng) -> Result<Outcome, String> {
    let text = prompt(rng);
    let max_tokens = 1 + rng.below(24);
    let chat = json!([{"role": "user", "content": text}]);
    let (path, body, hang_up) = match rng.below(5) {
        0 => (
            "/v1/chat/completions",
            json!({"messages": chat, "max_tokens": max_tokens}),
            None,
        ),
        1 => (
            "/v1/completions",
            json!({"prompt": text, "max_tokens": max_tokens, "stream": true}),
            None,
        ),
        // Hangs up after the first bytes of the stream.
        2 => (
            "/v1/chat/completions",
            json!({"messages": chat, "max_tokens": 64, "stream": true}),
            Some(1),
        ),
        3 => (
            "/v1/completions",
            json!({"prompt": text, "max_tokens": max_tokens, "n": 2, "seed": rng.below(1000),
                "temperature": 0.8}),
            None,
        ),
        // Hangs up before anything comes back.
        _ => (
            "/v1/chat/completions",
            json!({"messages": chat, "max_tokens": 48}),
            Some(0),
        ),
    };
    let body = body.to_string();
    if let Some(after_bytes) = hang_up {
        let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
        if after_bytes > 0 {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut first = [0u8; 64];
            s.read(&mut first)
                .map_err(|e| format!("no first bytes: {e}"))?;
        } else {
            std::thread::sleep(Duration::from_millis(rng.below(30) as u64));
        }
        drop(s);
        return Ok(Outcome::HungUp);
    }
    let reply =
        common::server::raw_request(addr, "POST", path, &[("host", "soak")], body.as_bytes());
    let text = String::from_utf8_lossy(&reply.payload()).to_string();
    if reply.status != 200 {
        return Err(format!("{path}: {} {text}", reply.status));
    }
    let finished = if body.contains("\"stream\":true") {
        text.contains("[DONE]") && !text.contains("\"error\"")
    } else {
        text.contains("\"finish_reason\":\"length\"") || text.contains("\"finish_reason\":\"stop\"")
    };
    if !finished {
        return Err(format!("{path}: unfinished reply {text}"));
    }
    Ok(Outcome::Answered)
}

#[test]
fn mixed_traffic_with_hang_ups_a_full_store_and_rank_kills_leaves_nothing_behind() {
    let duration = secs("TROUPE_SOAK_SECS", 75);
    let kill_every = secs("TROUPE_SOAK_KILL_SECS", 20);
    let store_dir = common::scratch_dir("soak-store");
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 48 << 20;
    cfg.max_num_seqs = 8;
    // A few blocks' room in each tier: every save past the first few evicts.
    cfg.kv_store = KvStoreConfig {
        host_bytes: 2 << 20,
        dir: Some(store_dir),
        disk_bytes: 4 << 20,
        ttl: None,
    };
    let server = common::server::start(cfg, "smollm2");
    let addr = server.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let hung_up = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (stop, answered, hung_up, failures) = (
                stop.clone(),
                answered.clone(),
                hung_up.clone(),
                failures.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = Rng(0x50a4 + c as u64);
                while !stop.load(Ordering::Relaxed) {
                    match one_request(addr, &mut rng) {
                        Ok(Outcome::Answered) => answered.fetch_add(1, Ordering::Relaxed),
                        Ok(Outcome::HungUp) => hung_up.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            failures.lock().unwrap().push(e);
                            0
                        }
                    };
                }
            })
        })
        .collect();

    let start = Instant::now();
    let warm_up = duration / 5;
    std::thread::sleep(warm_up);
    let (rss_warm, fds_warm) = footprint();
    let mut kills = 0;
    let mut next_kill = start + kill_every;
    while start.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(200));
        if Instant::now() >= next_kill {
            server
                .runtime
                .block_on(common::engine::kill_rank_0(&server.engine));
            kills += 1;
            next_kill += kill_every;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let status = server
        .runtime
        .block_on(common::engine::idle_status(&server.engine));
    // Connections the server closed are gone from the descriptor table a moment later.
    std::thread::sleep(Duration::from_millis(500));
    let (rss_end, fds_end) = footprint();
    let failures = failures.lock().unwrap();
    let (answered, hung_up) = (
        answered.load(Ordering::Relaxed),
        hung_up.load(Ordering::Relaxed),
    );
    let store = &status.kv_store;
    eprintln!(
        "soak: {duration:?}, {answered} answered, {hung_up} hung up, {kills} kills, {} resets; \
         RSS {} -> {} MiB, fds {fds_warm} -> {fds_end}; store: {} host and {} disk evictions",
        status.num_resets,
        rss_warm >> 20,
        rss_end >> 20,
        store.host_evictions,
        store.disk_evictions
    );
    assert!(
        failures.is_empty(),
        "{} failed, first: {}",
        failures.len(),
        failures[0]
    );
    assert!(
        answered >= 20 && hung_up >= 5,
        "too little traffic: {answered} answered, {hung_up} hung up"
    );
    assert!(
        kills >= 1 && status.num_resets > kills,
        "{kills} kills, {status:?}"
    );
    assert_eq!(
        (status.num_free_blocks, status.num_free_state_slots),
        (status.num_total_blocks, status.num_total_state_slots),
        "blocks or slots leaked: {status:?}"
    );
    assert!(status.num_running + status.num_waiting == 0, "{status:?}");
    assert!(
        store.host_evictions > 0,
        "the store never filled: {store:?}"
    );
    // Flat: the allocator keeps some of what it was given, not a request's worth each.
    assert!(
        rss_end <= rss_warm + rss_warm / 5 + (32 << 20),
        "RSS grew from {} to {} MiB",
        rss_warm >> 20,
        rss_end >> 20
    );
    assert!(fds_end <= fds_warm + 4, "open files {fds_warm} → {fds_end}");
}
