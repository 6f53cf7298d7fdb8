//! Random and mutated requests from concurrent clients against every route of a live
//! server — bodies, headers, content types, chunked encoding, broken framing: every reply
//! is a 2xx with a well-formed body or a 4xx with the API's own error shape (HTTP-level
//! refusals of broken framing aside) — never a 5xx, a dropped well-formed request or a
//! crash — and afterwards the server is healthy with every KV block free.
//!
//! A vision-language server (the generated Qwen2.5-VL checkpoint) takes the same with image
//! parts: OpenAI data URLs and Anthropic base64 blocks whose image files are mutated byte by
//! byte (truncated, corrupted headers, wrong MIME types) before encoding.
//!
//! `TROUPE_FUZZ_CASES` sets the number of cases (CI runs a few thousand; the long run,
//! `TROUPE_FUZZ_CASES=100000 cargo test --release --test server_fuzz`, a hundred thousand).

mod common;

use std::time::Duration;

use common::Rng;
use serde_json::{Value, json};
use troupe::engine::EngineConfig;

const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/tokenize",
    "/detokenize",
];

/// Valid requests for each route, small enough that they finish quickly.
fn seeds() -> Vec<(&'static str, Value)> {
    let tool = json!({"type": "function", "function": {"name": "f", "description": "d",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, "strict": true}});
    let schema = json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]});
    vec![
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
            "seed": 3, "n": 2, "stop": ["a"], "logprobs": true, "top_logprobs": 2, "logit_bias": {"5": 1.0}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "call"}], "tools": [tool], "tool_choice": "required", "max_tokens": 12}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "json"}], "max_tokens": 10,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "once upon", "max_tokens": 6, "logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3, 4], "max_tokens": 5, "stream": true, "ignore_eos": true, "min_tokens": 2}),
        ),
        (
            "/v1/responses",
            json!({"model": "tiny", "input": "hi", "max_output_tokens": 6}),
        ),
        (
            "/v1/responses",
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "1"}], "stream": true, "max_output_tokens": 5,
            "text": {"format": {"type": "json_object"}}}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 8, "system": [{"type": "text", "text": "s"}], "stream": true,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "2"}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}}),
        ),
        (
            "/tokenize",
            json!({"model": "tiny", "prompt": "once upon", "add_special_tokens": false, "return_token_strs": true}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "auto"}),
        ),
        (
            "/detokenize",
            json!({"model": "tiny", "tokens": [1, 2, 3, 40]}),
        ),
    ]
}

/// Valid requests with images (`png` base64), for the vision-language server.
fn image_seeds(png: &str) -> Vec<(&'static str, Value)> {
    let url = |mime: &str| json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{png}")}});
    let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}});
    vec![
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": [url("image/png"), {"type": "text", "text": "what?"}]}],
            "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [url(""), url("image/png")]},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, url("image/png")]}],
            "max_tokens": 3, "stream": true, "temperature": 0.5, "seed": 1}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [block, {"type": "text", "text": "q"}]}]}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": [url("image/png")]}]}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "once", "max_tokens": 3}),
        ),
    ]
}

/// Replaces each image of `v` with a byte-level mutation of one of `pngs`, validly
/// base64-encoded, so the decoder sees broken files rather than broken base64.
fn mutate_images(rng: &mut Rng, v: &mut Value, pngs: &[Vec<u8>]) {
    use base64::Engine as _;
    let fresh = |rng: &mut Rng| {
        let png = rng.pick(pngs).clone();
        let bytes = mutate_bytes(rng, png);
        base64::engine::general_purpose::STANDARD.encode(bytes)
    };
    match v {
        Value::Object(o) => {
            if o.get("type").and_then(Value::as_str) == Some("base64") && o.contains_key("data") {
                o.insert("data".into(), json!(fresh(rng)));
            }
            o.values_mut().for_each(|x| mutate_images(rng, x, pngs));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| mutate_images(rng, x, pngs)),
        Value::String(s) if s.starts_with("data:") => {
            let head = s
                .split_once(',')
                .map_or("data:image/png;base64", |(h, _)| h)
                .to_string();
            *s = format!("{head},{}", fresh(rng));
        }
        _ => {}
    }
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 2 { 8 } else { 10 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => json!(rng.next() as i64),
        3 => json!(*rng.pick(&[
            -1i64,
            0,
            1,
            2,
            7,
            511,
            512,
            513,
            100_000,
            i64::MAX,
            i64::MIN
        ])),
        4 => json!(*rng.pick(&[-1.5f64, 0.0, 0.5, 1e-9, 2.0, 1e30, -1e30])),
        5 => json!(*rng.pick(&[
            "",
            "user",
            "assistant",
            "tool",
            "system",
            "json_schema",
            "required",
            "none",
            "<|im_start|>",
            "<|im_end|>",
            "\u{F8F0}0\u{F8F1}",
            "<tool_call>",
            "[0-9",
            "start: x"
        ])),
        6 => {
            let n = rng.below(40);
            Value::String(
                (0..n)
                    .map(|_| char::from_u32(rng.below(0x3000) as u32).unwrap_or('?'))
                    .collect(),
            )
        }
        7 => json!("x".repeat(rng.below(3000))),
        8 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "type", "role", "content", "text", "schema", "name", "json", "regex", "grammar",
                "function", "x",
            ];
            Value::Object(
                (0..rng.below(4))
                    .map(|_| (rng.pick(&keys).to_string(), random_value(rng, depth + 1)))
                    .collect(),
            )
        }
    }
}

/// Replaces, deletes or adds one node somewhere in `v`.
fn mutate_json(rng: &mut Rng, v: &mut Value, depth: usize) {
    let descend = depth < 4 && rng.below(3) != 0;
    match v {
        Value::Object(o) if !o.is_empty() => {
            let keys: Vec<String> = o.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            if descend {
                mutate_json(rng, o.get_mut(&k).unwrap(), depth + 1);
            } else if rng.below(3) == 0 {
                o.remove(&k);
            } else {
                o.insert(k, random_value(rng, depth));
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len());
            if descend {
                mutate_json(rng, &mut a[i], depth + 1);
            } else if rng.below(3) == 0 {
                a.remove(i);
            } else {
                a[i] = random_value(rng, depth);
            }
        }
        _ => *v = random_value(rng, depth),
    }
}

fn mutate_bytes(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(3) {
        if b.is_empty() {
            b.push(b'{');
        }
        let i = rng.below(b.len());
        match rng.below(4) {
            0 => b[i] = rng.next() as u8,
            1 => b.truncate(i),
            2 => {
                let j = (i + rng.below(8)).min(b.len());
                b.drain(i..j);
            }
            _ => {
                let junk: Vec<u8> = (0..rng.below(6))
                    .map(|_| *rng.pick(b"{}[]\",:0-e\\\x00\xff"))
                    .collect();
                b.splice(i..i, junk);
            }
        }
    }
    b
}

/// How a case's request is framed on the wire.
struct Wire {
    bytes: Vec<u8>,
    /// The framing itself was broken (a wrong length, bad chunks): the server may answer
    /// at the HTTP level (a 4xx without the API's JSON) or close the connection.
    framing_broken: bool,
}

fn random_header_value(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 => String::new(),
        1 => "x".repeat(rng.below(9000)),
        2 => (0..rng.below(30))
            .map(|_| char::from(32 + rng.below(95) as u8))
            .collect(),
        _ => rng
            .pick(&[
                "Bearer",
                "Bearer ",
                "bearer sk",
                "\u{e9}t\u{e9}",
                "a\tb",
                "0",
            ])
            .to_string(),
    }
}

/// The request for `body` with random header and framing mutations in some cases.
fn wire(rng: &mut Rng, method: &str, route: &str, body: &[u8]) -> Wire {
    let mut headers: Vec<(String, String)> = vec![("host".into(), "t".into())];
    let mut framing_broken = false;
    if rng.below(4) == 0 {
        let content_type = *rng.pick(&[
            "application/json",
            "text/plain",
            "application/json; charset=utf-8",
            "multipart/form-data",
            "",
        ]);
        headers.push(("content-type".into(), content_type.into()));
    } else {
        headers.push(("content-type".into(), "application/json".into()));
    }
    for _ in 0..rng.below(3) {
        let name = *rng.pick(&[
            "x-request-id",
            "authorization",
            "x-api-key",
            "accept",
            "origin",
            "x-junk",
            "accept-encoding",
        ]);
        headers.push((name.into(), random_header_value(rng)));
    }
    let chunked = rng.below(6) == 0;
    let mut payload = Vec::new();
    if chunked {
        headers.push(("transfer-encoding".into(), "chunked".into()));
        let mut rest = body;
        while !rest.is_empty() {
            let n = (1 + rng.below(64)).min(rest.len());
            if rng.below(40) == 0 {
                payload.extend_from_slice(b"zz\r\n");
                framing_broken = true;
            } else {
                payload.extend_from_slice(format!("{n:x}\r\n").as_bytes());
            }
            payload.extend_from_slice(&rest[..n]);
            payload.extend_from_slice(b"\r\n");
            rest = &rest[n..];
        }
        if rng.below(30) == 0 {
            framing_broken = true; // no last chunk: the body never ends
        } else {
            payload.extend_from_slice(b"0\r\n\r\n");
        }
    } else {
        let len = match rng.below(40) {
            0 => {
                framing_broken = true;
                body.len() + 1 + rng.below(8)
            }
            1 => {
                framing_broken = true;
                body.len().saturating_sub(1 + rng.below(8))
            }
            _ => body.len(),
        };
        headers.push(("content-length".into(), len.to_string()));
        payload.extend_from_slice(body);
    }
    headers.push(("connection".into(), "close".into()));
    if rng.below(100) == 0 {
        // A header line without a colon.
        headers.push(("broken header line".into(), String::new()));
        framing_broken = true;
    }
    let mut bytes = format!("{method} {route} HTTP/1.1\r\n").into_bytes();
    for (k, v) in &headers {
        if v.is_empty() && k.contains(' ') {
            bytes.extend_from_slice(format!("{k}\r\n").as_bytes());
        } else {
            bytes.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
    }
    bytes.extend_from_slice(b"\r\n");
    bytes.extend_from_slice(&payload);
    Wire {
        bytes,
        framing_broken,
    }
}

fn send(server: &common::server::TestServer, w: &Wire) -> common::server::Reply {
    use std::io::{Read, Write};
    let mut s = server.connect();
    // A chunked body that never ends is answered (408) after the body read timeout, but
    // actix then drains the rest of it and keeps the connection until the client closes:
    // such a client stops reading after a few seconds.
    let patience = if w.framing_broken { 4 } else { 60 };
    s.set_read_timeout(Some(Duration::from_secs(patience)))
        .unwrap();
    let _ = s.write_all(&w.bytes);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    common::server::parse_reply(&raw)
}

/// The API's error shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
/// Anthropic's `{"type": "error", "error": {"type", "message"}}`.
fn check_error_shape(err: &Value, anthropic: bool) -> Result<(), String> {
    let e = &err["error"];
    let message_ok = e["message"].as_str().is_some_and(|m| !m.is_empty());
    let shape_ok = if anthropic {
        err["type"] == "error"
            && e["type"].is_string()
            && e.as_object().is_some_and(|o| o.len() == 2)
    } else {
        e["type"].is_string()
            && e.get("param").is_some()
            && e.get("code").is_some()
            && err.as_object().is_some_and(|o| o.len() == 1)
    };
    (message_ok && shape_ok)
        .then_some(())
        .ok_or_else(|| format!("not the API's error shape: {err}"))
}

/// A successful body: whole JSON, or SSE whose data lines are JSON (or `[DONE]`), and
/// never an error object.
fn check_success(payload: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(payload);
    if text.contains("\"error\"") && !text.contains("\"error\":null") {
        // A failure after the 200 (the engine's): allowed, in the API's shape.
        return Ok(());
    }
    if let Some(first) = text.trim_start().lines().next()
        && (first.starts_with("data:") || first.starts_with("event:"))
    {
        for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line != "[DONE]" {
                serde_json::from_str::<Value>(line).map_err(|e| format!("SSE data {line}: {e}"))?;
            }
        }
        return Ok(());
    }
    serde_json::from_str::<Value>(text.trim())
        .map(|_| ())
        .map_err(|e| format!("body: {e}: {text}"))
}

/// One client's cases from `seeds` (their images mutated from `pngs`, where given): how
/// many succeeded, or the first failure.
fn client(
    server: &common::server::TestServer,
    seeds: &[(&'static str, Value)],
    pngs: &[Vec<u8>],
    client_seed: u64,
    num_cases: usize,
) -> Result<usize, String> {
    let mut rng = Rng(client_seed);
    let mut num_ok = 0usize;
    for case in 0..num_cases {
        let (route, mut seed) = rng.pick(seeds).clone();
        if !pngs.is_empty() && rng.below(3) == 0 {
            mutate_images(&mut rng, &mut seed, pngs);
        }
        let route = if rng.below(10) == 0 {
            *rng.pick(ROUTES)
        } else {
            route
        };
        let body = match rng.below(10) {
            0 => (0..rng.below(64)).map(|_| rng.next() as u8).collect(),
            1..=3 => mutate_bytes(&mut rng, serde_json::to_vec(&seed).unwrap()),
            4 => serde_json::to_vec(&seed).unwrap(),
            _ => {
                let mut v = seed.clone();
                for _ in 0..1 + rng.below(3) {
                    mutate_json(&mut rng, &mut v, 0);
                }
                serde_json::to_vec(&v).unwrap()
            }
        };
        let method = if rng.below(50) == 0 { "GET" } else { "POST" };
        let w = wire(&mut rng, method, route, &body);
        let reply = send(server, &w);
        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).to_string();
        let fail = |what: String| {
            format!("client {client_seed:x} case {case}: {method} {route} {shown}: {what}")
        };
        let status = reply.status;
        if status == 0 && w.framing_broken {
            continue;
        }
        if !((200..300).contains(&status) || (400..500).contains(&status)) {
            return Err(fail(format!(
                "{status} {}",
                String::from_utf8_lossy(&reply.body)
            )));
        }
        if status >= 400 {
            let payload = reply.payload();
            if payload.is_empty() && w.framing_broken {
                continue;
            }
            // actix answers bad framing and oversized headers itself, without a body.
            if payload.is_empty() && matches!(status, 400 | 431) {
                continue;
            }
            let err: Value = serde_json::from_slice(&payload).map_err(|e| {
                fail(format!(
                    "{status}: error body is not JSON ({e}): {}",
                    String::from_utf8_lossy(&payload)
                ))
            })?;
            check_error_shape(&err, route == "/v1/messages").map_err(fail)?;
        } else {
            check_success(&reply.payload()).map_err(fail)?;
            num_ok += 1;
        }
    }
    Ok(num_ok)
}

fn num_cases(default: usize) -> usize {
    std::env::var("TROUPE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `num_cases` from `seeds` by four concurrent clients against `server`; then the server
/// is healthy with nothing left behind.
fn fuzz(
    server: &common::server::TestServer,
    seeds: &[(&'static str, Value)],
    pngs: &[Vec<u8>],
    num_cases: usize,
) {
    const NUM_CLIENTS: usize = 4;
    let results: Vec<Result<usize, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..NUM_CLIENTS)
            .map(|c| {
                let seed = 0x5eed + c as u64;
                scope.spawn(move || client(server, seeds, pngs, seed, num_cases / NUM_CLIENTS))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut num_ok = 0;
    for r in results {
        num_ok += r.unwrap_or_else(|e| panic!("{e}"));
    }
    // The mutations keep a fair share of requests valid, so generation paths are exercised.
    assert!(
        num_ok * 20 > num_cases,
        "only {num_ok} of {num_cases} requests succeeded"
    );
    assert_eq!(server.get("/health").0, 200);
    server
        .wait_idle(Duration::from_secs(30))
        .unwrap_or_else(|s| panic!("blocks or requests left behind: {s:?}"));
}

fn options(name: &str) -> troupe::protocol::serve_options::ServeOptions {
    let mut opts = troupe::protocol::serve_options::ServeOptions::new(name);
    // Bodies that never end are cut off soon.
    opts.body_read_timeout = Duration::from_secs(1);
    opts
}

#[test]
fn every_route_answers_random_and_mutated_requests_without_a_server_error() {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 32 << 20;
    let server = common::server::start_with(cfg, options("tiny"));
    fuzz(&server, &seeds(), &[], num_cases(2000));
}

#[test]
fn image_parts_mutated_down_to_their_bytes_are_refused_or_served() {
    use base64::Engine as _;
    let dir = common::vision::case_dir("a");
    let pngs: Vec<Vec<u8>> = (0..4)
        .map(|i| std::fs::read(dir.join(format!("images/{i}.png"))).unwrap())
        .collect();
    let png = base64::engine::general_purpose::STANDARD.encode(&pngs[0]);
    let mut cfg = EngineConfig::new(dir);
    cfg.kv_cache_bytes = 16 << 20;
    cfg.block_size = 4;
    let server = common::server::start_with(cfg, options("tiny"));
    fuzz(&server, &image_seeds(&png), &pngs, num_cases(2000) / 2);
}
