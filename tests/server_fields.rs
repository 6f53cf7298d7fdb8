//! Request fields on a live server: a field no codec reads is a 400 naming it on every API
//! (it used to be dropped with a 200), a `null` or a reply field sent back with its message
//! passes, vLLM's older `guided_*` fields constrain the output as `structured_outputs`
//! does, and an out-of-range sampling parameter is named in `param`.

mod common;

use common::server::TestServer;
use serde_json::{Value, json};
use troupe::engine::EngineConfig;

fn server() -> TestServer {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 16 << 20;
    common::server::start(cfg, "tiny")
}

fn post(server: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let r = server.request("POST", path, body.to_string().as_bytes());
    (r.status, r.json())
}

/// The error's `param` (OpenAI) or message (Anthropic, which has no `param`).
fn named(reply: &Value) -> String {
    reply["error"]["param"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| reply["error"]["message"].as_str().unwrap_or("").to_string())
}

#[test]
fn unknown_fields_are_refused_by_name_on_every_api() {
    let server = server();
    let user = json!([{"role": "user", "content": "hi"}]);
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 2}),
        ),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 2}),
        ),
        ("/v1/messages", json!({"messages": user, "max_tokens": 2})),
    ];
    for (path, body) in &bodies {
        let (status, reply) = post(&server, path, body);
        assert_eq!(status, 200, "{path}: {reply}");
        // A typo of a real field, and one no API has.
        for field in ["frobnicate", "temprature"] {
            let mut bad = body.clone();
            bad[field] = json!(1);
            let (status, reply) = post(&server, path, &bad);
            assert_eq!(status, 400, "{path} with {field}: {reply}");
            assert!(named(&reply).contains(field), "{path}: {reply}");
        }
        // Left out the way client libraries leave fields out.
        let mut nulled = body.clone();
        nulled["frobnicate"] = Value::Null;
        assert_eq!(post(&server, path, &nulled).0, 200, "{path}");
    }
    // Inside a message: a typo is refused by its path; what a reply carried, sent back with
    // the assistant's message, passes.
    let typo = json!({"max_tokens": 2, "messages": [{"role": "user", "contnet": "hi"}]});
    let (status, reply) = post(&server, "/v1/chat/completions", &typo);
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "messages[0].contnet", "{reply}");
    let echoed = json!({"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": null, "annotations": [], "audio": null},
        {"role": "user", "content": "again"}]});
    let (status, reply) = post(&server, "/v1/chat/completions", &echoed);
    assert_eq!(status, 200, "{reply}");
    // What an API documents and troupe cannot honour is refused by name too.
    let serial = json!({"messages": user, "max_tokens": 2, "parallel_tool_calls": false});
    let (status, reply) = post(&server, "/v1/chat/completions", &serial);
    assert_eq!(
        (status, named(&reply).as_str()),
        (400, "parallel_tool_calls")
    );
    let with_user = json!({"messages": user, "max_tokens": 2, "user": "u-1",
        "parallel_tool_calls": true});
    assert_eq!(post(&server, "/v1/chat/completions", &with_user).0, 200);
}

#[test]
fn vllms_guided_fields_constrain_the_output() {
    let server = server();
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 24, "temperature": 1.0, "seed": 3, "n": 3});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, reply) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{extra}: {reply}");
        reply["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    for text in chat(json!({"guided_regex": "[ab]{2,5}"})) {
        assert!(
            (2..=5).contains(&text.len()) && text.chars().all(|c| c == 'a' || c == 'b'),
            "{text:?}"
        );
    }
    let choices = ["yes", "no", "a.b (c)"];
    for via in [
        json!({"guided_choice": choices}),
        json!({"structured_outputs": {"choice": choices}}),
    ] {
        for text in chat(via.clone()) {
            assert!(choices.contains(&text.as_str()), "{via}: {text:?}");
        }
    }
    let schema =
        json!({"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]});
    for text in chat(json!({"guided_json": schema})) {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v == json!({"k": 1}) || v == json!({"k": 2}), "{text}");
    }
    // Two ways of constraining at once, or an empty choice, are refused by name.
    let both = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "guided_regex": "a", "guided_choice": ["b"]});
    let (status, reply) = post(&server, "/v1/chat/completions", &both);
    assert_eq!(
        (status, named(&reply).as_str()),
        (400, "guided_choice"),
        "{reply}"
    );
    let empty = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "guided_choice": []});
    let (status, reply) = post(&server, "/v1/chat/completions", &empty);
    assert_eq!(
        (status, named(&reply).as_str()),
        (400, "guided_choice"),
        "{reply}"
    );
}

#[test]
fn an_out_of_range_sampling_parameter_is_named_in_param() {
    let server = server();
    for (field, value) in [
        ("temperature", json!(-1)),
        ("top_p", json!(7)),
        ("presence_penalty", json!(40)),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body[field] = value;
        let (status, reply) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{reply}");
        assert_eq!(reply["error"]["param"], field, "{reply}");
    }
}

/// Anthropic's `count_tokens`: the prompt `/v1/messages` renders from the same body, tools
/// and system included, counted as its reply's `usage.input_tokens`; `max_tokens` (no part
/// of it) and unknown fields are refused by name.
#[test]
fn anthropic_count_tokens_counts_the_prompt_messages_would_send() {
    let server = server();
    let tool = json!({"name": "get_weather", "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}});
    for body in [
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        json!({"system": "Be brief.", "messages": [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking."}, {"role": "user", "content": "Well?"}],
            "tools": [tool]}),
    ] {
        let (status, counted) = post(&server, "/v1/messages/count_tokens", &body);
        assert_eq!(status, 200, "{counted}");
        let mut sent = body.clone();
        sent["max_tokens"] = json!(1);
        let (status, reply) = post(&server, "/v1/messages", &sent);
        assert_eq!(status, 200, "{reply}");
        assert_eq!(
            counted["input_tokens"], reply["usage"]["input_tokens"],
            "{body}"
        );
        assert!(counted["input_tokens"].as_u64().unwrap() > 1);
    }
    let (status, reply) = post(
        &server,
        "/v1/messages/count_tokens",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
    );
    assert_eq!(status, 400);
    assert!(named(&reply).contains("max_tokens"), "{reply}");
    let (status, reply) = post(
        &server,
        "/v1/messages/count_tokens",
        &json!({"messages": [{"role": "user", "content": "hi"}], "stream_mode": 1}),
    );
    assert_eq!(status, 400);
    assert!(named(&reply).contains("stream_mode"), "{reply}");
}
