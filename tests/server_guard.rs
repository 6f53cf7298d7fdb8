//! The server's door, on a live server: API keys on every route (each API's own 401),
//! routes opened by name, CORS preflights from allowed and other origins, the Host
//! allow-list against a DNS-rebinding Host, the served model name, request ids echoed,
//! and `/health` while the model loads.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::server::{Reply, TestServer};
use troupe::engine::EngineConfig;
use troupe::protocol::serve_options::{ServeOptions, default_allowed_hosts};

const CHAT: &[u8] = br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
const MESSAGES: &[u8] =
    br#"{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],"model":"tiny"}"#;

fn tiny() -> EngineConfig {
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-qwen3"));
    cfg.kv_cache_bytes = 16 << 20;
    cfg
}

fn with_keys() -> TestServer {
    let mut opts = ServeOptions::new("tiny");
    opts.api_keys = vec!["sk-first".into(), "sk-second".into()];
    opts.open_health = true;
    common::server::start_with(tiny(), opts)
}

fn assert_openai_error(r: &Reply, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

fn assert_anthropic_error(r: &Reply, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
}

#[test]
fn every_route_but_the_opened_ones_asks_for_a_key_in_its_apis_own_format() {
    let server = with_keys();
    let host = [("host", "t")];
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", CHAT),
        (
            "POST",
            "/v1/completions",
            &br#"{"prompt":[1,2],"max_tokens":2}"#[..],
        ),
        ("GET", "/v1/models", &b""[..]),
        ("GET", "/metrics", &b""[..]),
        (
            "POST",
            "/v1/responses",
            &br#"{"input":"hi","max_output_tokens":2}"#[..],
        ),
    ] {
        let r = server.request_with(method, path, &host, body);
        assert_openai_error(&r, 401, "no API key");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        let wrong = [("host", "t"), ("authorization", "Bearer sk-firs")];
        assert_openai_error(
            &server.request_with(method, path, &wrong, body),
            401,
            "not valid",
        );
    }
    assert_anthropic_error(
        &server.request_with("POST", "/v1/messages", &host, MESSAGES),
        401,
        "authentication_error",
    );
    let wrong = [("host", "t"), ("x-api-key", "sk-second2")];
    assert_anthropic_error(
        &server.request_with("POST", "/v1/messages", &wrong, MESSAGES),
        401,
        "authentication_error",
    );
    // Opened by name: no key needed.
    assert_eq!(
        server.request_with("GET", "/health", &host, b"").status,
        200
    );

    let bearer = [("host", "t"), ("authorization", "Bearer sk-second")];
    let r = server.request_with("POST", "/v1/chat/completions", &bearer, CHAT);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    assert!(r.json()["choices"][0]["message"].is_object());
    let x_api_key = [("host", "t"), ("x-api-key", "sk-first")];
    let r = server.request_with("POST", "/v1/messages", &x_api_key, MESSAGES);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    assert_eq!(r.json()["type"], "message");
    let r = server.request_with("GET", "/metrics", &bearer, b"");
    assert_eq!(r.status, 200);
}

#[test]
fn cors_answers_preflights_for_allowed_origins_only_and_before_the_key_is_asked() {
    let mut opts = ServeOptions::new("tiny");
    opts.api_keys = vec!["sk-k".into()];
    opts.allowed_origins = vec!["https://app.example".into()];
    let server = common::server::start_with(tiny(), opts);
    let preflight = |origin: &str| {
        server.request_with(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("host", "t"),
                ("origin", origin),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "authorization,content-type",
                ),
            ],
            b"",
        )
    };
    let ok = preflight("https://app.example");
    assert_eq!(ok.status, 200, "{:?}", ok.headers);
    assert_eq!(
        ok.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let other = preflight("https://evil.example");
    assert_ne!(other.status, 200);
    assert_eq!(other.header("access-control-allow-origin"), None);
    // A real call from the allowed origin carries the header, and still needs its key.
    let headers = [
        ("host", "t"),
        ("origin", "https://app.example"),
        ("authorization", "Bearer sk-k"),
    ];
    let r = server.request_with("POST", "/v1/chat/completions", &headers, CHAT);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let no_key = [("host", "t"), ("origin", "https://app.example")];
    let r = server.request_with("POST", "/v1/chat/completions", &no_key, CHAT);
    assert_eq!(r.status, 401);
}

#[test]
fn without_allowed_origins_no_cors_header_is_sent() {
    let server = common::server::start(tiny(), "tiny");
    let headers = [("host", "t"), ("origin", "https://app.example")];
    let r = server.request_with("POST", "/v1/chat/completions", &headers, CHAT);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), None);
}

#[test]
fn a_loopback_server_refuses_a_rebound_host_name() {
    let mut opts = ServeOptions::new("tiny");
    opts.allowed_hosts = default_allowed_hosts("127.0.0.1");
    let server = common::server::start_with(tiny(), opts);
    let port = server.addr.port().to_string();
    for host in ["evil.example", &format!("evil.example:{port}"), "127.0.0.2"] {
        let r = server.request_with("POST", "/v1/chat/completions", &[("host", host)], CHAT);
        assert_openai_error(&r, 403, "is not served here");
    }
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let r = server.request_with("POST", "/v1/chat/completions", &[("host", &host)], CHAT);
        assert_eq!(r.status, 200, "{host}");
    }
}

#[test]
fn the_served_model_name_is_listed_and_asked_for() {
    let server = common::server::start(tiny(), "my-model");
    let models = server.request("GET", "/v1/models", b"");
    assert_eq!(models.json()["data"][0]["id"], "my-model");
    let right = br#"{"model":"my-model","prompt":[1,2],"max_tokens":2}"#;
    assert_eq!(server.request("POST", "/v1/completions", right).status, 200);
    let wrong = br#"{"model":"tiny-qwen3","prompt":[1,2],"max_tokens":2}"#;
    let r = server.request("POST", "/v1/completions", wrong);
    assert_openai_error(&r, 404, "my-model");
    // OpenAI's `models.retrieve`: the listed object by its id, a 404 for any other.
    let one = server.request("GET", "/v1/models/my-model", b"");
    assert_eq!(one.status, 200);
    assert_eq!(one.json(), models.json()["data"][0]);
    let r = server.request("GET", "/v1/models/gpt-4o", b"");
    assert_openai_error(&r, 404, "gpt-4o");
}

#[test]
fn request_ids_are_echoed_or_made_and_never_taken_unchecked() {
    let server = common::server::start(tiny(), "tiny");
    let mine = [("host", "t"), ("x-request-id", "trace-42")];
    let r = server.request_with("POST", "/v1/chat/completions", &mine, CHAT);
    assert_eq!(r.header("x-request-id"), Some("trace-42"));
    let made: Vec<String> = (0..3)
        .map(|_| {
            let r = server.request("GET", "/health", b"");
            r.header("x-request-id").expect("an id is made").to_string()
        })
        .collect();
    assert!(made[0] != made[1] && made[1] != made[2], "{made:?}");
    let long = "x".repeat(300);
    let r = server.request_with(
        "GET",
        "/health",
        &[("host", "t"), ("x-request-id", &long)],
        b"",
    );
    let id = r.header("x-request-id").unwrap();
    assert!(id.len() < 100 && id != long, "{id}");
}

#[test]
fn health_is_503_while_the_model_loads_and_200_once_it_has() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let state = troupe::protocol::server::state(ServeOptions::new("tiny"));
    let serving = state.clone();
    std::thread::spawn(move || troupe::protocol::server::serve_on(serving, listener, None));
    let get = |path: &str, body: &[u8]| {
        let method = if body.is_empty() { "GET" } else { "POST" };
        common::server::raw_request(addr, method, path, &[("host", "t")], body)
    };
    let mut r = get("/health", b"");
    for _ in 0..100 {
        if r.status != 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        r = get("/health", b"");
    }
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], "loading");
    let r = get("/v1/chat/completions", CHAT);
    assert_openai_error(&r, 503, "loading");
    let engine = runtime
        .block_on(troupe::engine::Engine::spawn(tiny()))
        .unwrap();
    state.set_engine(engine);
    assert_eq!(get("/health", b"").status, 200);
    assert_eq!(get("/v1/chat/completions", CHAT).status, 200);
}

#[test]
fn completions_text_is_text_unless_the_request_opts_in_and_special_tokens_show_when_asked() {
    let server = common::server::start(EngineConfig::new(common::smollm2_path()), "smollm2");
    let tok = server.engine.text().tokenizer.clone().unwrap();
    let prompt = "<|im_start|>user\nhi<|im_end|>";
    let usage = |extra: &str| {
        let body = format!(r#"{{"prompt":{prompt:?},"max_tokens":1{extra}}}"#);
        let r = server.request("POST", "/v1/completions", body.as_bytes());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize
    };
    let guarded = usage("");
    let parsed = usage(r#","parse_special_tokens":true"#);
    assert_eq!(
        guarded,
        tok.encode_request_prompt(prompt, false, true)
            .unwrap()
            .len()
    );
    assert_eq!(
        parsed,
        tok.encode_request_prompt(prompt, true, true).unwrap().len()
    );
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert!(
        !tok.encode_request_prompt(prompt, false, true)
            .unwrap()
            .contains(&im_start)
    );
    assert!(guarded > parsed, "{guarded} vs {parsed}");

    // A reply forced onto <|im_end|>: its text shows it only with skip_special_tokens false.
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    let text = |skip: &str| {
        let body = format!(
            r#"{{"prompt":[1,2,3],"max_tokens":2,"ignore_eos":true,"logit_bias":{{"{im_end}":100}}{skip}}}"#
        );
        let r = server.request("POST", "/v1/completions", body.as_bytes());
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(text(""), "");
    assert_eq!(
        text(r#","skip_special_tokens":false"#),
        "<|im_end|><|im_end|>"
    );
}
