//! `/v1/completions` as lm-evaluation-harness uses it, on the default model: `echo` with
//! the prompt's logprobs, `max_tokens: 0`, batches of prompts, streaming with `echo`, and
//! `/tokenizer_info`. The prompts are drawn from a seeded generator over the vocabulary.

mod common;

use common::server::TestServer;
use serde_json::{Value, json};
use troupe::engine::EngineConfig;

fn server() -> TestServer {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 32 << 20;
    common::server::start(cfg, "smollm2")
}

fn post(server: &TestServer, body: Value) -> (u16, Value) {
    let r = server.request("POST", "/v1/completions", body.to_string().as_bytes());
    (r.status, r.json())
}

/// A streamed completion: its whole payload and its chunks before `[DONE]`.
fn stream(server: &TestServer, body: &Value) -> (String, Vec<Value>) {
    let r = server.request("POST", "/v1/completions", body.to_string().as_bytes());
    assert_eq!(r.status, 200);
    let payload = String::from_utf8(r.payload()).unwrap();
    let chunks = payload
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (payload, chunks)
}

/// Ordinary vocabulary ids (SmolLM2's control tokens are 0..=16).
fn random_prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = common::Rng(seed);
    (0..n)
        .map(|_| {
            let len = 3 + rng.below(20);
            (0..len).map(|_| 17 + rng.below(40_000) as u32).collect()
        })
        .collect()
}

fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().unwrap().iter().map(Value::as_f64).collect()
}

/// Generating greedily with logprobs, then scoring the prompt and what was generated
/// with `echo` and `max_tokens: 0`, gives the same logprobs: scoring is generation's
/// arithmetic at every position.
#[test]
fn echoed_prompt_logprobs_equal_the_generated_tokens_logprobs() {
    let server = server();
    for (i, prompt) in random_prompts(6, 41).into_iter().enumerate() {
        let (status, generation) = post(
            &server,
            json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{generation}");
        let generated: Vec<u32> = common::ids(&generation["choices"][0]["token_ids"]);
        let gen_lps = floats(&generation["choices"][0]["logprobs"]["token_logprobs"]);
        let mut all = prompt.clone();
        all.extend(&generated);
        let (status, scored) = post(
            &server,
            json!({"prompt": all, "max_tokens": 0, "echo": true, "logprobs": 1, "temperature": 0}),
        );
        assert_eq!(status, 200, "{scored}");
        let c = &scored["choices"][0];
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(scored["usage"]["completion_tokens"], 0);
        assert_eq!(c["token_ids"], json!([]));
        let lps = floats(&c["logprobs"]["token_logprobs"]);
        assert_eq!(
            lps.len(),
            all.len(),
            "case {i}: one per prompt token, none after"
        );
        assert_eq!(lps[0], None, "case {i}: nothing precedes the first token");
        let tops = c["logprobs"]["top_logprobs"].as_array().unwrap();
        for (j, want) in gen_lps.iter().enumerate() {
            let p = prompt.len() + j;
            let (got, want) = (lps[p].unwrap(), want.unwrap());
            assert!(
                (got - want).abs() < 1e-3,
                "case {i}: position {p}: scored {got}, generated {want}"
            );
            // Greedy tokens are each position's argmax: lm-eval's `is_greedy` holds.
            let best = tops[p]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            assert_eq!(got, best, "case {i}: position {p}: {}", tops[p]);
        }
        // The echoed text is the prompt's, and the offsets walk it.
        let (_, detok) = {
            let r = server.request(
                "POST",
                "/detokenize",
                json!({"tokens": all}).to_string().as_bytes(),
            );
            (r.status, r.json())
        };
        assert_eq!(c["text"], detok["prompt"], "case {i}");
        let offsets = c["logprobs"]["text_offset"].as_array().unwrap();
        assert_eq!(offsets.len(), all.len());
        let tokens = c["logprobs"]["tokens"].as_array().unwrap();
        let mut at = 0;
        for (offset, token) in offsets.iter().zip(tokens) {
            assert_eq!(offset, at, "case {i}: {offsets:?}");
            at += token.as_str().unwrap().chars().count() as u64;
        }
    }
}

#[test]
fn batches_of_prompts_answer_one_choice_per_prompt_in_order() {
    let server = server();
    let prompts = random_prompts(4, 7);
    let (status, batch) = post(
        &server,
        json!({"prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 2, "n": 2}),
    );
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 8);
    for (i, prompt) in prompts.iter().enumerate() {
        let (_, alone) = post(
            &server,
            json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 2}),
        );
        for k in 0..2 {
            let c = &choices[2 * i + k];
            assert_eq!(c["index"], 2 * i + k);
            // Both completions echo the prompt and its scores, then generate greedily.
            assert_eq!(
                c["text"], alone["choices"][0]["text"],
                "prompt {i}, choice {k}"
            );
            let (a, b) = (
                floats(&c["logprobs"]["token_logprobs"]),
                floats(&alone["choices"][0]["logprobs"]["token_logprobs"]),
            );
            assert_eq!(a.len(), prompt.len() + 3);
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.is_none(), y.is_none());
                assert!(
                    (x.unwrap_or(0.0) - y.unwrap_or(0.0)).abs() < 1e-3,
                    "{a:?} vs {b:?}"
                );
            }
        }
    }
    let texts = json!(["The capital of France is", "One, two,"]);
    let (status, by_text) = post(
        &server,
        json!({"prompt": texts, "max_tokens": 0, "echo": true}),
    );
    assert_eq!(status, 200, "{by_text}");
    assert_eq!(by_text["choices"][0]["text"], texts[0]);
    assert_eq!(by_text["choices"][1]["text"], texts[1]);
    assert_eq!(by_text["choices"][1]["logprobs"], Value::Null);
}

/// A batch larger than the engine's queue runs as room frees up (each prompt waits for its
/// own admission), and a bad prompt in a batch is refused by its index before any runs.
#[test]
fn a_batch_larger_than_the_queue_completes_and_a_bad_prompt_is_named() {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 32 << 20;
    cfg.max_pending_requests = 3;
    let server = common::server::start(cfg, "smollm2");
    let prompts = random_prompts(10, 12);
    let (status, batch) = post(
        &server,
        json!({"prompt": prompts, "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 0}),
    );
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 10);
    for (i, (c, p)) in choices.iter().zip(&prompts).enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(
            c["logprobs"]["tokens"].as_array().unwrap().len(),
            p.len() + 2
        );
    }
    let mut bad = random_prompts(3, 13);
    bad[1] = vec![1 << 30];
    let (status, err) = post(&server, json!({"prompt": bad, "max_tokens": 2}));
    assert_eq!(status, 400, "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("prompt 1:"), "{message}");
    server
        .wait_idle(std::time::Duration::from_secs(30))
        .expect("the engine is idle after a refused batch");
}

#[test]
fn streaming_with_echo_sends_the_prompt_first() {
    let server = server();
    let prompt = "The capital of France is";
    let (_, whole) = post(
        &server,
        json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": true}),
    );
    let body =
        json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": true, "stream": true});
    let (payload, chunks) = stream(&server, &body);
    assert!(payload.trim_end().ends_with("data: [DONE]"), "{payload}");
    let first = chunks[0]["choices"][0]["text"].as_str().unwrap();
    assert!(first.starts_with(prompt), "{first}");
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    // A batch does not stream: refused by name.
    let (status, err) = post(
        &server,
        json!({"prompt": ["a", "b"], "max_tokens": 2, "stream": true}),
    );
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "stream");
    let (status, err) = post(&server, json!({"prompt": [], "max_tokens": 2}));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "prompt");
    let (status, err) = post(
        &server,
        json!({"prompt": "a", "max_tokens": 0, "echo": true, "logprobs": 21}),
    );
    assert_eq!(status, 400, "{err}");
}

/// vLLM's `prompt_logprobs` field: per position the top M ids with their ranks and the
/// prompt token itself (its rank in the whole vocabulary); the same numbers `echo` gives.
/// Fields troupe does not act on are refused by name.
#[test]
fn vllm_prompt_logprobs_and_unsupported_fields() {
    let server = server();
    let prompt = random_prompts(1, 21).remove(0);
    let (status, r) = post(
        &server,
        json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "echo": true, "logprobs": 1}),
    );
    assert_eq!(status, 200, "{r}");
    let c = &r["choices"][0];
    let pl = c["prompt_logprobs"].as_array().unwrap();
    let echoed = floats(&c["logprobs"]["token_logprobs"]);
    assert_eq!(pl.len(), prompt.len());
    assert_eq!(pl[0], Value::Null);
    for (p, (&id, position)) in prompt.iter().zip(pl).enumerate().skip(1) {
        let position = position.as_object().unwrap();
        let mine = &position[&id.to_string()];
        assert_eq!(mine["logprob"].as_f64(), echoed[p], "position {p}");
        let rank = mine["rank"].as_u64().unwrap();
        assert_eq!(
            position.len(),
            if rank <= 2 { 2 } else { 3 },
            "{position:?}"
        );
        let mut ranks: Vec<u64> = position
            .values()
            .map(|v| v["rank"].as_u64().unwrap())
            .collect();
        ranks.sort();
        assert_eq!(&ranks[..2], &[1, 2]);
        // The echoed top map was cut to `logprobs: 1` (and the token itself).
        let top = c["logprobs"]["top_logprobs"][p].as_object().unwrap();
        assert_eq!(top.len(), if rank == 1 { 1 } else { 2 }, "{top:?}");
    }
    for (field, value) in [
        ("suffix", json!("!")),
        ("best_of", json!(3)),
        ("include_stop_str_in_output", json!(true)),
    ] {
        let mut body = json!({"prompt": "Hi", "max_tokens": 1});
        body[field] = value;
        let (status, err) = post(&server, body);
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], field);
    }
    // Defaults pass.
    let (status, _) = post(
        &server,
        json!({"prompt": "Hi", "max_tokens": 1, "best_of": 1, "suffix": null}),
    );
    assert_eq!(status, 200);
}

#[test]
fn tokenizer_info_names_the_special_tokens_and_template() {
    let server = server();
    let (status, body) = server.get("/tokenizer_info");
    assert_eq!(status, 200);
    let info: Value = serde_json::from_slice(&body).unwrap();
    let golden = common::read_json("tokenizer_smollm2.json");
    let eos = info["eos_token"].as_str().unwrap();
    // The eos string reads back as the model's one stop token.
    let r = server.request(
        "POST",
        "/tokenize",
        json!({"prompt": eos, "add_special_tokens": false, "parse_special_tokens": true})
            .to_string()
            .as_bytes(),
    );
    let ids = common::ids(&r.json()["tokens"]);
    assert_eq!(ids.len(), 1, "{eos}: {ids:?}");
    assert!(golden.to_string().contains(eos));
    let template = info["chat_template"].as_str().unwrap();
    assert!(template.contains("add_generation_prompt"), "{template}");
    assert!(info["model_max_length"].as_u64().unwrap() >= 2048);
}

/// Streamed chunks carry every generated id, also where the tokens have no text: a model
/// without a tokenizer (the tiny DeepSeek-V4 checkpoint) and the default model, on
/// generated prompts and lengths; the ids equal the whole reply's.
#[test]
fn streamed_chunks_carry_every_token_id_even_without_text() {
    let mut dsv4 = EngineConfig::new(common::goldens().join("tiny-dsv4-a"));
    dsv4.kv_cache_bytes = 16 << 20;
    for server in [server(), common::server::start(dsv4, "tiny-dsv4")] {
        for (i, prompt) in random_prompts(4, 33).into_iter().enumerate() {
            let prompt: Vec<u32> = prompt.into_iter().map(|t| t % 200 + 17).collect();
            let max_tokens = 3 + 5 * i;
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true});
            let (status, whole) = post(&server, body.clone());
            assert_eq!(status, 200, "{whole}");
            let mut streamed = body;
            streamed["stream"] = json!(true);
            let (payload, chunks) = stream(&server, &streamed);
            let ids: Vec<Value> = chunks
                .into_iter()
                .flat_map(|c| {
                    c["choices"][0]["token_ids"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .collect();
            assert_eq!(ids.len(), max_tokens, "prompt {i}: {payload}");
            assert_eq!(json!(ids), whole["choices"][0]["token_ids"], "prompt {i}");
        }
    }
}
