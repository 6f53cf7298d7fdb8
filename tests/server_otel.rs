//! `troupe serve --otlp-traces-endpoint`, a real process against a stand-in OTLP/HTTP
//! collector: a request's span reaches the collector as protobuf, inside the caller's
//! trace when it sent a `traceparent`, with the engine's account of the request as span
//! events; the spans still buffered at SIGTERM are flushed before the exit.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use common::process::{self, HOST};

/// One POST the collector took: its head (lower-cased) and body.
struct Export {
    head: String,
    body: Vec<u8>,
}

/// A collector on a free port that answers every POST with an empty success and hands
/// over what it got.
fn collector() -> (u16, mpsc::Receiver<Export>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            loop {
                let mut head = String::new();
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 2 {
                    head.push_str(&line.to_ascii_lowercase());
                    line.clear();
                }
                if head.is_empty() {
                    break;
                }
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                let mut body = vec![0; len];
                reader.read_exact(&mut body).unwrap();
                // Handed over before the reply: the server may exit as soon as it has one.
                if tx.send(Export { head, body }).is_err() {
                    return;
                }
                let reply = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                conn.write_all(reply.as_bytes()).unwrap();
            }
        }
    });
    (port, rx)
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn request_spans_reach_the_collector_inside_the_callers_trace() {
    let (port, exports) = collector();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut server = process::serve(
        &["--otlp-traces-endpoint", &endpoint],
        // Longer than the test: only the flush at the exit can deliver the spans.
        &[
            ("OTEL_BSP_SCHEDULE_DELAY", "600000"),
            ("OTEL_SERVICE_NAME", "troupe-under-test"),
        ],
    );
    let seed = std::process::id() as u64 * 0x9e37_79b9_7f4a_7c15;
    let trace_id = format!("{:016x}{:016x}", seed, seed.rotate_left(17) | 1);
    let parent_id = format!("{:016x}", seed.rotate_left(31) | 1);
    let request_id = format!("otel-probe-{}", seed % 100_000);
    let traceparent = format!("00-{trace_id}-{parent_id}-01");
    let headers = [
        HOST[0],
        ("content-type", "application/json"),
        ("x-request-id", request_id.as_str()),
        ("traceparent", traceparent.as_str()),
    ];
    let reply = common::server::raw_request(
        server.addr,
        "POST",
        "/v1/completions",
        &headers,
        br#"{"prompt":[1,2,3],"max_tokens":4,"ignore_eos":true}"#,
    );
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(
        exports.recv_timeout(Duration::from_millis(500)).is_err(),
        "spans were exported before the batch was due"
    );
    server.signal(libc::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0));

    let got: Vec<Export> = exports.try_iter().collect();
    assert!(!got.is_empty(), "no spans reached the collector");
    for e in &got {
        assert!(e.head.starts_with("post /v1/traces "), "{}", e.head);
        assert!(
            e.head.contains("content-type: application/x-protobuf"),
            "{}",
            e.head
        );
    }
    let body: Vec<u8> = got.into_iter().flat_map(|e| e.body).collect();
    for (what, needle) in [
        ("the service name", b"troupe-under-test".to_vec()),
        ("the span's name", b"request".to_vec()),
        ("the request id", request_id.clone().into_bytes()),
        ("the caller's trace id", hex_bytes(&trace_id)),
        ("the caller's span as parent", hex_bytes(&parent_id)),
        (
            "the admission event",
            b"admitted to the running batch".to_vec(),
        ),
        ("the finish event", b"finished".to_vec()),
    ] {
        assert!(
            contains(&body, &needle),
            "{what} is not in the exported spans"
        );
    }
}

#[test]
fn an_endpoint_that_cannot_be_exported_to_is_refused_by_name() {
    for (endpoint, why) in [
        ("https://collector:4318", "TLS is not built in"),
        ("collector:4318", "not a URL"),
    ] {
        let out = common::cli::troupe(&["serve", "--otlp-traces-endpoint", endpoint]);
        common::cli::assert_clear_error(&out, why);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--otlp-traces-endpoint"), "{err}");
    }
}
