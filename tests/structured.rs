//! Structured output on the default model through the engine: whatever the sampler draws,
//! the output matches the grammar (JSON schema, regex, Lark), ends when the grammar does,
//! and bad grammars are refused with a message naming the problem.

mod common;

use serde_json::{Value, json};
use troupe::engine::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineRequest, FinishReason,
};
use troupe::protocol::call_syntax::CallSyntax;
use troupe::protocol::conversation::{Conversation, Message, Role};
use troupe::sampling::SamplingParams;
use troupe::structured::GrammarSpec;

async fn engine(zos: bool) -> EngineHandle {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 128 << 20;
    cfg.zero_overhead_scheduling = zos;
    Engine::spawn(cfg).await.unwrap()
}

fn chat(engine: &EngineHandle, user: &str, grammar: GrammarSpec, n: usize) -> EngineRequest {
    let conv = Conversation::from_messages(vec![Message::new(Role::User, user)]);
    let ids = conv.to_prompt_ids(engine.text()).unwrap();
    // Hot sampling: only the mask keeps the output well-formed.
    let params = SamplingParams {
        temperature: 1.5,
        ..Default::default()
    };
    let mut r = EngineRequest::new(ids, 96, params);
    r.seed = Some(7);
    r.n = n;
    r.grammar = Some(grammar);
    r
}

async fn texts(engine: &EngineHandle, r: EngineRequest) -> Vec<(String, Option<FinishReason>)> {
    let stream = engine.generate(r).await.unwrap();
    stream
        .collect_choices()
        .await
        .into_iter()
        .map(|o| {
            assert!(o.error.is_none(), "{:?}", o.error);
            (o.text, o.finish_reason)
        })
        .collect()
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_output_is_valid_for_every_sampled_choice() {
    let engine = engine(true).await;
    let r = chat(
        &engine,
        "Describe a person as JSON.",
        GrammarSpec::JsonSchema(person_schema()),
        6,
    );
    for (text, finish) in texts(&engine, r).await {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let obj = v.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["age", "name", "pets"], "{text}");
        assert!(
            obj["name"].as_str().unwrap().chars().count() <= 16,
            "{text}"
        );
        assert!((0..=120).contains(&obj["age"].as_i64().unwrap()), "{text}");
        let pets = obj["pets"].as_array().unwrap();
        assert!(
            pets.len() <= 3 && pets.iter().all(|p| p == "cat" || p == "dog"),
            "{text}"
        );
        assert_eq!(
            finish,
            Some(FinishReason::Stop),
            "the grammar's end ends the output"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_and_lark_constrain_the_whole_output() {
    let engine = engine(true).await;
    let r = chat(
        &engine,
        "Give me a phone number.",
        GrammarSpec::Regex("[0-9]{3}-[0-9]{4}".into()),
        4,
    );
    for (text, finish) in texts(&engine, r).await {
        let b = text.as_bytes();
        assert!(
            b.len() == 8
                && b[3] == b'-'
                && b.iter()
                    .enumerate()
                    .all(|(i, c)| i == 3 || c.is_ascii_digit()),
            "{text:?}"
        );
        assert_eq!(finish, Some(FinishReason::Stop));
    }
    let r = chat(
        &engine,
        "Is the sky blue?",
        GrammarSpec::Lark(
            "start: (\"yes\" | \"no\") \", because \" REASON \".\"\nREASON: /[a-z ]{1,20}/".into(),
        ),
        4,
    );
    for (text, _) in texts(&engine, r).await {
        assert!(
            (text.starts_with("yes, because ") || text.starts_with("no, because "))
                && text.ends_with('.'),
            "{text:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_sampling_is_reproducible_with_and_without_zos() {
    let mut runs = Vec::new();
    for zos in [true, false] {
        let engine = engine(zos).await;
        let r = chat(
            &engine,
            "Describe a person as JSON.",
            GrammarSpec::JsonSchema(person_schema()),
            3,
        );
        runs.push(texts(&engine, r).await);
    }
    assert_eq!(runs[0], runs[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grammars_are_refused_with_the_reason() {
    let engine = engine(true).await;
    // Each with the words that say why: the whole message, not its first line (a regex
    // error's first line is only `regex parse error:`).
    let cases = [
        (
            GrammarSpec::JsonSchema(
                json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
            ),
            "strin",
        ),
        (
            GrammarSpec::Regex("[0-9".into()),
            "unclosed character class",
        ),
        (
            GrammarSpec::Lark("start: undefined_rule".into()),
            "undefined_rule",
        ),
    ];
    for (spec, why) in cases {
        let kind = spec.kind();
        let r = chat(&engine, "hi", spec, 1);
        match engine.generate(r).await {
            Err(EngineError::Rejected(m)) => {
                let m = m.to_string();
                assert!(m.contains(kind) && m.contains(why), "{m}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a bad {kind} was accepted"),
        }
    }
    // The engine still serves afterwards.
    let mut r = chat(
        &engine,
        "Reply with a JSON object with a key \"greeting\".",
        GrammarSpec::JsonObject,
        1,
    );
    r.params.temperature = 0.0;
    let (text, _) = texts(&engine, r).await.remove(0);
    assert!(
        serde_json::from_str::<serde_json::Map<String, Value>>(&text).is_ok(),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_output_with_speculation_equals_without_and_follows_the_grammar() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    // A grammar that repeats itself: prompt lookup proposes the repetition, and each draft
    // is checked against the grammar's mask after the drafts before it.
    let grammar = GrammarSpec::Regex(r#"\[("cat"|"dog")(, ("cat"|"dog")){11}\]"#.into());
    let mut outputs = Vec::new();
    for verify in [None, Some(SpecVerify::Fixed), Some(SpecVerify::Confidence)] {
        let mut cfg = EngineConfig::new(common::smollm2_path());
        cfg.kv_cache_bytes = 128 << 20;
        cfg.latency_curve_dir = Some(std::env::temp_dir().join("troupe-structured-spec-curves"));
        cfg.speculative = verify.map(|verify| SpecConfig {
            method: SpecMethod::Ngram,
            num_speculative_tokens: 4,
            verify,
            acceptance: SpecAcceptance::Coupled,
        });
        let engine = Engine::spawn(cfg).await.unwrap();
        let r = chat(&engine, "List cats and dogs.", grammar.clone(), 2);
        let got: Vec<(Vec<u32>, String)> = engine
            .generate(r)
            .await
            .unwrap()
            .collect_choices()
            .await
            .into_iter()
            .map(|o| {
                assert!(o.error.is_none(), "{:?}", o.error);
                assert_eq!(o.finish_reason, Some(FinishReason::Stop));
                (o.token_ids, o.text)
            })
            .collect();
        let status = engine.status().await.unwrap();
        engine.shutdown(true).await;
        for (_, text) in &got {
            let items: Vec<&str> = text
                .strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .unwrap_or_else(|| panic!("{text:?}"))
                .split(", ")
                .collect();
            assert_eq!(items.len(), 12, "{text:?}");
            assert!(
                items.iter().all(|i| *i == "\"cat\"" || *i == "\"dog\""),
                "{text:?}"
            );
        }
        if verify.is_some() {
            assert!(
                status.num_spec_accepted_tokens > 0,
                "{verify:?}: no draft was accepted under the grammar: {status:?}"
            );
        }
        outputs.push(got);
    }
    // Seeded hot sampling: the same tokens with speculation off, fixed and confidence.
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
}

/// Rows under a grammar where the backend draws rows itself (CUDA): the rank masks them
/// and the device draws them, greedy and seeded, verify rows included — the same tokens
/// and logprobs as the host's sampler gives the same rows (a zero logit bias sends them
/// there: a processor that changes nothing). On the CPU both runs take the host's path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_rows_drawn_on_the_device_equal_the_host_samplers() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    let grammar = GrammarSpec::Regex("[a-e]{3}( [a-e]{3}){5,8}".into());
    let requests = |bias: bool| -> Vec<troupe::engine::EngineRequest> {
        (0..12u64)
            .map(|i| {
                let phrase: Vec<u32> = (0..6)
                    .map(|k| 3 + (troupe::sampling::splitmix64(i * 16 + k) % 300) as u32)
                    .collect();
                let params = SamplingParams {
                    temperature: if i % 3 == 0 { 0.0 } else { 0.9 },
                    top_p: if i % 2 == 0 { 1.0 } else { 0.9 },
                    logit_bias: if bias { vec![(5, 0.0)] } else { Vec::new() },
                    ..Default::default()
                };
                let mut r = EngineRequest::new(phrase.repeat(4), 40, params);
                r.seed = Some(500 + i);
                r.grammar = Some(grammar.clone());
                r
            })
            .collect()
    };
    let on_device = common::engine::test_device() != troupe::engine::Device::Cpu;
    for spec in [false, true] {
        let mut cfg = common::engine::tiny_config("tiny-llama");
        cfg.batch_invariant = true;
        cfg.speculative = spec.then_some(SpecConfig {
            method: SpecMethod::Ngram,
            num_speculative_tokens: 4,
            verify: SpecVerify::Fixed,
            acceptance: SpecAcceptance::Coupled,
        });
        let (device, device_status) =
            common::engine::run_engine(cfg.clone(), requests(false)).await;
        let (host, host_status) = common::engine::run_engine(cfg, requests(true)).await;
        assert!(host_status.num_host_sampled_rows > 0, "{host_status:?}");
        if spec {
            // Drafts kept, so rows continue verify rows that yielded more than one token.
            assert!(
                device_status.num_spec_accepted_tokens > 0,
                "{device_status:?}"
            );
        }
        if on_device {
            assert_eq!(device_status.num_host_sampled_rows, 0, "{device_status:?}");
            // A grammar's sequence continues its verify row in flight (the rank reads
            // what that row yielded from the picks): none sits out a step.
            assert_eq!(device_status.num_spec_sat_out_rows, 0, "{device_status:?}");
        }
        for (d, h) in device.iter().zip(&host) {
            assert_eq!(
                d.token_ids, h.token_ids,
                "spec {spec}: {:?} / {:?}",
                d.text, h.text
            );
            for (a, b) in d.token_logprobs.iter().zip(&h.token_logprobs) {
                assert!((a - b).abs() < 1e-4, "spec {spec}: logprobs {a} / {b}");
            }
            // The grammar holds: words of three letters a–e, single spaces between.
            assert!(d.text.len() >= 3, "spec {spec}: {:?}", d.text);
            let words: Vec<&str> = d.text.split(' ').collect();
            assert!(
                words.len() <= 9
                    && words.iter().enumerate().all(|(i, w)| {
                        let last = i + 1 == words.len();
                        w.chars().all(|c| ('a'..='e').contains(&c))
                            && (w.len() == 3 || (last && w.len() < 3))
                    }),
                "spec {spec}: {:?}",
                d.text
            );
        }
    }
}

/// Past the grammar's end with EOS not a stop (`ignore_eos`), every row still has an id to
/// draw: the sequence runs to its length, the grammar's text first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_past_its_end_under_ignore_eos_still_draws() {
    let requests: Vec<EngineRequest> = [0.0f32, 0.8]
        .iter()
        .map(|&temperature| {
            let params = SamplingParams {
                temperature,
                ..Default::default()
            };
            let mut r = EngineRequest::new(vec![5, 6, 7, 8], 8, params);
            r.seed = Some(3);
            r.ignore_eos = true;
            r.grammar = Some(GrammarSpec::Regex("abc".into()));
            r
        })
        .collect();
    let cfg = common::engine::tiny_config("tiny-llama");
    let (outs, _) = common::engine::run_engine(cfg, requests).await;
    for o in &outs {
        assert_eq!(o.finish_reason, Some(FinishReason::Length), "{o:?}");
        assert_eq!(o.token_ids.len(), 8, "{o:?}");
        assert!(o.text.starts_with("abc"), "{o:?}");
        // Past the grammar's end only its end may be drawn: the model's EOS (id 2 in
        // tiny-llama's generation_config.json), never an arbitrary id.
        assert_eq!(o.token_ids.last(), Some(&2), "{o:?}");
    }
}

/// vLLM's strict default: an object that names its properties takes no others unless its
/// schema allows them, and a key never repeats — in `response_format` schemas and in forced
/// tool calls alike. (Without it SmolLM2 forced to call a tool wrote `"type":"string",…`
/// after its argument until `max_tokens`, and a cut call repeated a key.)
#[test]
fn objects_take_only_their_named_keys_unless_the_schema_allows_more() {
    use troupe::protocol::conversation::{Tool, ToolChoice};
    use troupe::structured::GrammarCompiler;
    let text = troupe::model::load_text(&common::smollm2_path()).unwrap();
    let compiler = GrammarCompiler::new(text.tokenizer.clone().unwrap(), text.stop_ids[0]).unwrap();
    let compile = |s: &Value| {
        compiler
            .compile(&GrammarSpec::JsonSchema(s.clone()))
            .unwrap()
    };
    let weather = json!({"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}}});
    let g = compile(&weather);
    for ok in [
        r#"{"city":"Paris"}"#,
        r#"{"city":"Paris","unit":"c"}"#,
        r#"{"city":"Paris","where":{"lat":1.5}}"#,
    ] {
        assert!(g.accepts(ok), "{ok}");
    }
    for bad in [
        r#"{"city":"Paris","type":"string"}"#,
        r#"{"city":"Paris","city":"Rome"}"#,
        r#"{"city":"Paris","unit":"c","unit":"c"}"#,
        r#"{"city":"Paris","where":{"lat":1.5,"lon":2}}"#,
    ] {
        assert!(!g.accepts(bad), "{bad}");
    }
    // The schema's own word wins, at the top and nested.
    let mut open = weather.clone();
    open["additionalProperties"] = json!(true);
    open["properties"]["where"]["additionalProperties"] = json!({"type": "number"});
    let g = compile(&open);
    assert!(g.accepts(r#"{"city":"Paris","type":"string"}"#));
    assert!(g.accepts(r#"{"city":"Paris","where":{"lat":1.5,"lon":2}}"#));
    assert!(!g.accepts(r#"{"city":"Paris","where":{"lat":1.5,"lon":"x"}}"#));

    // A forced call to a tool that is not strict, its schema silent on extra keys.
    let conv = Conversation {
        messages: vec![Message::new(Role::User, "Weather in Paris?")],
        tools: vec![Tool {
            name: "get_weather".into(),
            description: "Current weather".into(),
            parameters: weather,
            strict: false,
        }],
        tool_choice: ToolChoice::Required,
        reasoning_effort: None,
        images: Vec::new(),
    };
    let g = compiler
        .compile(&conv.tool_grammar(&CallSyntax::Hermes).unwrap())
        .unwrap();
    let call = |args: &str| {
        format!("<tool_call>\n{{\"name\":\"get_weather\",\"arguments\":{args}}}\n</tool_call>")
    };
    assert!(g.accepts(&call(r#"{"city":"Paris"}"#)));
    assert!(!g.accepts(&call(r#"{"city":"Paris","type":"string"}"#)));
    assert!(!g.accepts(&call(r#"{"city":"Paris","unit":"f","unit":"f"}"#)));
}
