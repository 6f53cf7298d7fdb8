//! `/tokenize`, `/detokenize` and `/version` on the default model, against Hugging Face
//! tokenizers' encodings and transformers' chat-templated prompts (the goldens of
//! `scripts/make_tokenizer_goldens.py`).

mod common;

use common::server::TestServer;
use serde_json::{Value, json};
use troupe::engine::EngineConfig;

fn server() -> TestServer {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 16 << 20;
    common::server::start(cfg, "smollm2")
}

fn post(server: &TestServer, path: &str, body: Value) -> (u16, Value) {
    let r = server.request("POST", path, body.to_string().as_bytes());
    (r.status, r.json())
}

fn assert_refused(server: &TestServer, path: &str, body: Value, param: &str, needle: &str) {
    let (status, reply) = post(server, path, body.clone());
    assert_eq!(status, 400, "{body} → {reply}");
    assert_eq!(reply["error"]["param"], param, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{body} → {message}");
}

#[test]
fn tokenize_and_detokenize_agree_with_hugging_face() {
    let server = server();
    let tokens = common::read_json("tokenizer_smollm2.json");
    let mut num_with_control_tokens = 0;
    for case in tokens["cases"].as_array().unwrap() {
        // Hugging Face reads control-token strings in text as those tokens: the opt-in.
        let body = json!({"prompt": case["text"], "parse_special_tokens": true});
        let (status, reply) = post(&server, "/tokenize", body);
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["tokens"], case["ids"], "{}", case["text"]);
        assert_eq!(reply["count"], case["ids"].as_array().unwrap().len());
        assert!(reply["max_model_len"].as_u64().unwrap() >= 2048, "{reply}");
        assert_eq!(reply["token_strs"], Value::Null);
        // By default such text stays text, as `/v1/completions` would encode it.
        let (_, guarded) = post(&server, "/tokenize", json!({"prompt": case["text"]}));
        let ids: Vec<u64> = guarded["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        if guarded["tokens"] != case["ids"] {
            // SmolLM2's control tokens are ids 0..=16: none comes from text by default,
            // and the text survives the round trip.
            num_with_control_tokens += 1;
            assert!(!ids.iter().any(|&id| id <= 16), "{}: {ids:?}", case["text"]);
            let (_, back) = post(&server, "/detokenize", json!({"tokens": ids}));
            assert_eq!(back["prompt"], case["text"]);
        }
    }
    assert!(
        num_with_control_tokens > 0,
        "no golden case has control tokens"
    );
    for case in tokens["decode"].as_array().unwrap() {
        let (status, reply) = post(&server, "/detokenize", json!({"tokens": case["ids"]}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["prompt"], case["text"]);
    }
    // Each token's own string, as the tokenizer's vocabulary spells it.
    let (_, reply) = post(
        &server,
        "/tokenize",
        json!({"prompt": "Hello world", "return_token_strs": true, "model": "smollm2"}),
    );
    assert_eq!(reply["token_strs"], json!(["Hello", "Ġworld"]));
}

#[test]
fn chat_messages_tokenize_as_transformers_renders_them() {
    let server = server();
    let golden = common::read_json("smollm2.json");
    let chats: Vec<&Value> = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["chat"] == true)
        .collect();
    assert!(chats.len() >= 3);
    for p in chats {
        let messages = json!([{"role": "user", "content": p["text"]}]);
        let (status, reply) = post(&server, "/tokenize", json!({"messages": messages}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["tokens"], p["prompt_ids"], "{}", p["name"]);
        // The same ids the chat route feeds the engine: its usage counts them.
        let (status, chat) = post(
            &server,
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 1}),
        );
        assert_eq!(status, 200, "{chat}");
        assert_eq!(chat["usage"]["prompt_tokens"], reply["count"]);
    }
}

#[test]
fn what_tokenize_cannot_do_is_refused_by_name() {
    let server = server();
    let hi = json!([{"role": "user", "content": "hi"}]);
    assert_refused(
        &server,
        "/tokenize",
        json!({"prompt": "a", "messages": hi}),
        "prompt",
        "exactly one",
    );
    assert_refused(&server, "/tokenize", json!({}), "prompt", "exactly one");
    assert_refused(
        &server,
        "/tokenize",
        json!({"prompt": "a", "chat_template": "x"}),
        "chat_template",
        "not a field",
    );
    assert_refused(
        &server,
        "/tokenize",
        json!({"messages": hi, "add_generation_prompt": false}),
        "add_generation_prompt",
        "only `true`",
    );
    assert_refused(
        &server,
        "/tokenize",
        json!({"messages": [{"role": "wizard", "content": "hi"}]}),
        "messages[0]",
        "unknown role",
    );
    assert_refused(
        &server,
        "/detokenize",
        json!({"tokens": [1, 49152]}),
        "tokens[1]",
        "outside the vocabulary",
    );
    assert_refused(
        &server,
        "/detokenize",
        json!({"tokens": "hi"}),
        "tokens",
        "tokens",
    );
    let (status, reply) = post(
        &server,
        "/tokenize",
        json!({"prompt": "a", "model": "other"}),
    );
    assert_eq!(status, 404, "{reply}");
}

#[test]
fn version_names_the_build() {
    let server = server();
    let r = server.request("GET", "/version", b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["version"], env!("CARGO_PKG_VERSION"));
}

const TEMPLATE: &str = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";

#[test]
fn a_chat_template_given_replaces_the_models_own() {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 16 << 20;
    cfg.chat_template = Some(TEMPLATE.into());
    let server = common::server::start(cfg, "smollm2");
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]);
    let (status, chat) = post(&server, "/tokenize", json!({"messages": messages}));
    assert_eq!(status, 200, "{chat}");
    let rendered = "[system] Be brief.\n[user] Hi there\n[assistant]";
    let (_, text) = post(&server, "/tokenize", json!({"prompt": rendered}));
    assert_eq!(chat["tokens"], text["tokens"]);
    let (_, back) = post(&server, "/detokenize", json!({"tokens": chat["tokens"]}));
    assert_eq!(back["prompt"], rendered);
}

#[test]
fn a_chat_template_that_cannot_be_used_is_refused_by_name() {
    let dir = common::scratch_dir("template");
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}{{ m.content }").unwrap();
    let smollm2 = common::smollm2_path().display().to_string();
    let dsv4 = common::cli::tiny("tiny-dsv4-a");
    let cases = [
        (smollm2.as_str(), "no/such/template.jinja", "no such file"),
        (
            smollm2.as_str(),
            broken.to_str().unwrap(),
            "--chat-template",
        ),
        (dsv4.as_str(), TEMPLATE, "DeepSeek-V4"),
    ];
    for (model, template, needle) in cases {
        let args = [
            "generate",
            "--model",
            model,
            "--chat",
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--chat-template",
            template,
        ];
        let out = common::cli::troupe(&args);
        common::cli::assert_clear_error(&out, needle);
    }
    // A good file is read and used.
    let good = dir.join("good.jinja");
    std::fs::write(&good, TEMPLATE).unwrap();
    let out = common::cli::troupe(&[
        "generate",
        "--model",
        &smollm2,
        "--chat",
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--chat-template",
        good.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: Value =
        serde_json::from_slice(out.stdout.split(|&b| b == b'\n').next().unwrap()).unwrap();
    let server = server();
    let (_, want) = post(
        &server,
        "/tokenize",
        json!({"prompt": "[user] hi\n[assistant]"}),
    );
    assert_eq!(line["prompt_ids"], want["tokens"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
