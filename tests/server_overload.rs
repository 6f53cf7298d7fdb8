//! Overload on a live server: two thousand concurrent clients against a gate of a few
//! dozen places — the excess is turned away at once with 429 and Retry-After in the API's
//! error format, every admitted request completes, memory stays bounded, the server
//! still serves afterwards. And the deadlines: a request past `--request-timeout`, one
//! that waited past `--queue-timeout`, a body that never finishes arriving.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use troupe::engine::EngineConfig;
use troupe::protocol::serve_options::ServeOptions;

const NUM_CLIENTS: usize = 2000;

/// The tests of this file one at a time: the first measures the process's RSS, which
/// another test's engine loading beside it would grow.
static SERIAL: troupe::sync::Mutex<()> = troupe::sync::Mutex::new(());

fn serial() -> troupe::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn tiny(max_num_seqs: usize) -> EngineConfig {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 16 << 20;
    cfg.max_num_seqs = max_num_seqs;
    cfg
}

/// Raises the open-file limit to its hard limit (each client holds two descriptors in
/// this process, its own and the server's); the clients that fit it.
fn raise_fd_limit() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain getrlimit/setrlimit on this process with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    ((lim.rlim_cur as usize).saturating_sub(256) / 2).min(NUM_CLIENTS)
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

async fn client(addr: std::net::SocketAddr, i: usize) -> Result<common::server::Reply, String> {
    let stream = i.is_multiple_of(2);
    let body = format!(
        r#"{{"prompt":[{},{},3],"max_tokens":8,"ignore_eos":true,"stream":{stream}}}"#,
        1 + i % 300,
        2 + i % 100
    );
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("client {i}: connect: {e}"))?;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes())
        .await
        .map_err(|e| format!("client {i}: send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .await
        .map_err(|e| format!("client {i}: read: {e}"))?;
    Ok(common::server::parse_reply(&raw))
}

#[test]
fn thousands_of_clients_at_a_small_gate_get_429s_and_every_admitted_one_completes() {
    let _serial = serial();
    let num_clients = raise_fd_limit();
    assert!(
        num_clients >= 500,
        "only {num_clients} descriptors' worth of clients"
    );
    let mut opts = ServeOptions::new("tiny");
    opts.max_queued_requests = 16;
    let server = common::server::start_with(tiny(4), opts);
    let rss_before = rss_bytes();
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Admissions bounded from above too: the gate's and the engine's counts, sampled
    // through the burst, never pass running + queued (4 + 16).
    let limit = 4 + 16;
    let burst_over = troupe::sync::atomic::AtomicBool::new(false);
    let started = Instant::now();
    let (replies, most_inside, most_in_engine) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let (mut inside, mut in_engine) = (0, 0);
            while !burst_over.load(troupe::sync::atomic::Ordering::Relaxed) {
                inside = inside.max(server.engine_gate_inside());
                let st = server.status();
                in_engine = in_engine.max(st.num_running + st.num_waiting);
                std::thread::sleep(Duration::from_millis(2));
            }
            (inside, in_engine)
        });
        let replies = run_clients(&clients, &server, num_clients);
        burst_over.store(true, troupe::sync::atomic::Ordering::Relaxed);
        let (inside, in_engine) = sampler.join().unwrap();
        (replies, inside, in_engine)
    });
    assert!(
        most_inside <= limit && most_in_engine <= limit,
        "admitted past the gate: {most_inside} inside it, {most_in_engine} in the engine (limit {limit})"
    );
    assert!(most_inside > 4, "the queue never filled: {most_inside}");
    let rss_growth = rss_bytes().saturating_sub(rss_before);
    let (mut admitted, mut refused) = (0, 0);
    for (i, r) in replies.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{e}"));
        match r.status {
            200 if i.is_multiple_of(2) => {
                let text = String::from_utf8_lossy(&r.payload()).to_string();
                assert!(text.contains("data: [DONE]"), "client {i}: {text}");
                assert!(!text.contains("\"error\""), "client {i}: {text}");
                admitted += 1;
            }
            200 => {
                let body = r.json();
                assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
                admitted += 1;
            }
            429 => {
                assert_eq!(r.header("retry-after"), Some("1"), "client {i}");
                let body = r.json();
                assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
                assert!(
                    body["error"]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("--max-queued-requests")),
                    "{body}"
                );
                refused += 1;
            }
            other => panic!(
                "client {i}: status {other}: {}",
                String::from_utf8_lossy(&r.body)
            ),
        }
    }
    eprintln!(
        "{num_clients} clients in {:?}: {admitted} admitted, {refused} refused; RSS +{} MiB",
        started.elapsed(),
        rss_growth >> 20
    );
    assert!(admitted >= 20, "{admitted} admitted");
    assert!(refused > 0, "nothing was refused: the gate let everyone in");
    assert!(
        rss_growth < 512 << 20,
        "RSS grew by {} MiB",
        rss_growth >> 20
    );
    server
        .wait_idle(Duration::from_secs(30))
        .unwrap_or_else(|s| panic!("requests or blocks were left: {s:?}"));
    assert_eq!(server.get("/health").0, 200);
}

/// The default model: slow enough on a CPU that a long request is still generating when
/// its deadline passes.
fn smollm2(max_num_seqs: usize) -> EngineConfig {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.max_num_seqs = max_num_seqs;
    cfg
}

fn wait_until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_request_past_its_timeout_ends_with_an_error_and_frees_its_place() {
    let _serial = serial();
    let mut opts = ServeOptions::new("smollm2");
    opts.request_timeout = Some(Duration::from_millis(400));
    let server = common::server::start_with(smollm2(4), opts);
    let long = br#"{"prompt":[1,2,3],"max_tokens":2000,"ignore_eos":true,"stream":true}"#;
    let started = Instant::now();
    let r = server.request("POST", "/v1/completions", long);
    let elapsed = started.elapsed();
    let text = String::from_utf8_lossy(&r.payload()).to_string();
    assert_eq!(r.status, 200, "{text}");
    assert!(text.contains("--request-timeout"), "{text}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let whole = br#"{"prompt":[1,2,3],"max_tokens":2000,"ignore_eos":true}"#;
    let body = server.request("POST", "/v1/completions", whole).json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--request-timeout")),
        "{body}"
    );
    server
        .wait_idle(Duration::from_secs(10))
        .unwrap_or_else(|s| panic!("the timed-out requests ran on: {s:?}"));
    wait_until("the gate emptying", Duration::from_secs(5), || {
        server.engine_gate_inside() == 0
    });
}

#[test]
fn a_request_that_waits_past_the_queue_timeout_gets_a_clear_error() {
    let _serial = serial();
    let mut cfg = smollm2(1);
    cfg.queue_timeout = Some(Duration::from_millis(300));
    let server = common::server::start(cfg, "smollm2");
    // One place in the batch, held by a long request on its own connection.
    let body = br#"{"prompt":[1,2,3],"max_tokens":3000,"ignore_eos":true,"stream":true}"#;
    let mut holder = server.connect();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    holder.write_all(head.as_bytes()).unwrap();
    holder.write_all(body).unwrap();
    wait_until("the first request running", Duration::from_secs(30), || {
        server.status().num_running == 1
    });
    let started = Instant::now();
    let waiter = server.request(
        "POST",
        "/v1/completions",
        br#"{"prompt":[4,5,6],"max_tokens":4,"ignore_eos":true,"stream":true}"#,
    );
    let text = String::from_utf8_lossy(&waiter.payload()).to_string();
    assert!(text.contains("--queue-timeout"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(server.status().num_running, 1, "the holder was not touched");
    drop(holder);
    server
        .wait_idle(Duration::from_secs(10))
        .unwrap_or_else(|s| panic!("{s:?}"));
}

#[test]
fn a_body_that_never_finishes_arriving_is_refused_after_the_read_timeout() {
    let _serial = serial();
    let mut opts = ServeOptions::new("tiny");
    opts.body_read_timeout = Duration::from_millis(500);
    let server = common::server::start_with(tiny(4), opts);
    let mut s = server.connect();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"",
    )
    .unwrap();
    let started = Instant::now();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let r = common::server::parse_reply(&raw);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&raw));
}

#[test]
fn a_percent_encoded_route_takes_a_ticket_like_its_plain_spelling() {
    let _serial = serial();
    let mut opts = ServeOptions::new("smollm2");
    opts.max_queued_requests = 1;
    let server = common::server::start_with(smollm2(1), opts);
    // Two places (one running, one queued), both held by long streams.
    let body = br#"{"prompt":[1,2,3],"max_tokens":3000,"ignore_eos":true,"stream":true}"#;
    let holders: Vec<_> = (0..2)
        .map(|_| {
            let mut s = server.connect();
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).unwrap();
            s.write_all(body).unwrap();
            s
        })
        .collect();
    wait_until("both places taken", Duration::from_secs(30), || {
        server.engine_gate_inside() == 2
    });
    let short = br#"{"prompt":[1,2,3],"max_tokens":2}"#;
    for path in [
        "/v1/completions",
        "/v1/%63ompletions",
        "/v1/chat/%63ompletions",
    ] {
        let r = server.request("POST", path, short);
        assert_eq!(
            r.status,
            429,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    drop(holders);
    wait_until("the gate emptying", Duration::from_secs(10), || {
        server.engine_gate_inside() == 0
    });
    assert_eq!(
        server.request("POST", "/v1/%63ompletions", short).status,
        200
    );
}

/// Every client at once; each reply within its bound.
fn run_clients(
    clients: &tokio::runtime::Runtime,
    server: &common::server::TestServer,
    num_clients: usize,
) -> Vec<Result<common::server::Reply, String>> {
    let addr = server.addr;
    clients.block_on(async {
        let tasks: Vec<_> = (0..num_clients)
            .map(|i| tokio::spawn(client(addr, i)))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(
                tokio::time::timeout(Duration::from_secs(240), t)
                    .await
                    .expect("every client is answered within 240 s")
                    .unwrap(),
            );
        }
        out
    })
}
