//! Random and mutated bodies against every route of a live server: every reply is a 2xx
//! or a 4xx with the API's error JSON — never a 5xx, a dropped connection or a crash — and
//! afterwards the server is healthy with every KV block free.
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
    ]
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

#[test]
fn every_route_answers_random_and_mutated_bodies_without_a_server_error() {
    let num_cases: usize = std::env::var("TROUPE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 32 << 20;
    let server = common::server::start(cfg, "tiny");
    let seeds = seeds();
    let mut rng = Rng(0x5eed);
    let mut num_ok = 0usize;
    for case in 0..num_cases {
        let (route, seed) = rng.pick(&seeds).clone();
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
        let reply = server.request(method, route, &body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(400)]).to_string();
        assert!(
            (200..300).contains(&reply.status) || (400..500).contains(&reply.status),
            "case {case}: {method} {route} {shown} -> {} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
        if reply.status >= 400 {
            let err: Value = serde_json::from_slice(&reply.body).unwrap_or_else(|e| {
                panic!("case {case}: {route} {shown}: error body is not JSON ({e})")
            });
            let message = if route == "/v1/messages" && method == "POST" {
                err["error"]["message"]
                    .as_str()
                    .filter(|_| err["type"] == "error")
            } else {
                err["error"]["message"].as_str()
            };
            assert!(
                message.is_some_and(|m| !m.is_empty()),
                "case {case}: {route} {shown}: {err}"
            );
        } else {
            num_ok += 1;
        }
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
