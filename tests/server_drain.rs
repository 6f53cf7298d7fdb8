//! SIGTERM under load, on a real `troupe serve` process: new requests get 503 at once,
//! the requests in flight that can finish within `--shutdown-timeout` do, the rest end
//! with an error their clients see (an SSE error event, or the JSON error object), and
//! the process exits 0. No request silently vanishes.

mod common;

use common::process::{self, HOST};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

/// Sends `body` and reads the reply to its end; tells `started` when the head is in.
fn client(addr: SocketAddr, body: String, started: mpsc::Sender<()>) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(90))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let (mut raw, mut buf, mut told) = (Vec::new(), [0u8; 4096], false);
    loop {
        let n = s.read(&mut buf).unwrap_or(0);
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if !told && raw.windows(4).any(|w| w == b"\r\n\r\n") {
            told = true;
            let _ = started.send(());
        }
    }
    raw
}

#[test]
fn sigterm_under_load_finishes_what_it_can_ends_the_rest_clearly_and_exits_0() {
    let mut server = process::serve(&["--shutdown-timeout", "4s"], &[]);
    let (tx, rx) = mpsc::channel();
    // (streamed, max_tokens): short ones finish within the shutdown timeout, long ones
    // cannot.
    let plan: Vec<(bool, usize)> = (0..10)
        .map(|i: usize| (i % 5 != 4, if i.is_multiple_of(2) { 12 } else { 4000 }))
        .collect();
    let handles: Vec<_> = plan
        .iter()
        .enumerate()
        .map(|(i, &(stream, max_tokens))| {
            let body = format!(
                r#"{{"prompt":[{},2,3],"max_tokens":{max_tokens},"ignore_eos":true,"stream":{stream}}}"#,
                10 + i
            );
            let (addr, tx) = (server.addr, tx.clone());
            std::thread::spawn(move || client(addr, body, tx))
        })
        .collect();
    for _ in &plan {
        rx.recv_timeout(Duration::from_secs(60))
            .expect("every request was answered before the signal");
    }
    server.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(200));
    let late = common::server::raw_request(
        server.addr,
        "POST",
        "/v1/completions",
        &HOST,
        br#"{"prompt":[1,2,3],"max_tokens":2}"#,
    );
    assert_eq!(late.status, 503, "{}", String::from_utf8_lossy(&late.body));
    assert!(String::from_utf8_lossy(&late.body).contains("shutting down"));
    let health = common::server::raw_request(server.addr, "GET", "/health", &HOST, b"");
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["status"], "draining");

    for (h, &(stream, max_tokens)) in handles.into_iter().zip(&plan) {
        let reply = common::server::parse_reply(&h.join().unwrap());
        let text = String::from_utf8_lossy(&reply.payload()).to_string();
        assert_eq!(reply.status, 200, "{text}");
        let finished = max_tokens == 12;
        match (stream, finished) {
            (true, true) => {
                assert!(
                    text.contains("data: [DONE]") && !text.contains("\"error\""),
                    "{text}"
                )
            }
            (true, false) => assert!(
                text.contains("\"error\"") && text.contains("shutting down"),
                "a cut stream ends with an error event: {text}"
            ),
            (false, true) => {
                assert_eq!(
                    reply.json()["choices"][0]["finish_reason"],
                    "length",
                    "{text}"
                )
            }
            (false, false) => {
                let body = reply.json();
                let message = body["error"]["message"].as_str().unwrap_or_default();
                assert!(message.contains("shutting down"), "{body}");
            }
        }
    }
    let status = server.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status:?}");
}
