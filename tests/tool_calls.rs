//! Forced tool calls on the default model, written in the markup its chat template
//! teaches (`--chat-template` puts each family's tool section in front of SmolLM2): Hermes'
//! `<tool_call>` blocks, Llama 3.1's bare `{"name", "parameters"}` object and Mistral's
//! `[TOOL_CALLS]` forms. Whatever the model would write, the reply is one call of a named
//! tool whose arguments keep to its schema, reported as a call with `finish_reason`
//! `tool_calls`; seeds drawn in the test vary what it writes.

mod common;

use serde_json::{Value, json};
use troupe::engine::EngineConfig;

/// Each family's instruction and its rendering of an earlier call, around a plain chat.
const TEMPLATES: [(&str, &str, &str); 4] = [
    (
        "hermes",
        "<tool_call>\n{\"name\":",
        "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    ),
    (
        "llama3.1",
        "{\"name\":",
        "{% if tools %}<|im_start|>system\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not use variables.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    ),
    (
        "mistral-v3",
        "[TOOL_CALLS][{\"name\":",
        "{% for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% if m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}{% endfor %}]{% else %}[INST] {{ m.content }}[/INST]{% endif %}{% endfor %}",
    ),
    (
        "mistral-v11",
        "[TOOL_CALLS]get_",
        "{% for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}",
    ),
];

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
        {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
            "parameters": {"type": "object", "required": ["zone"], "properties": {
                "zone": {"enum": ["UTC", "CET", "JST"]}}}}}
    ])
}

/// The arguments keep to the named tool's schema: its keys only, the required ones, each
/// value of its type and range.
fn check_arguments(name: &str, args: &Value, reply: &Value) {
    let obj = args
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {reply}"));
    match name {
        "get_weather" => {
            let city = obj["city"].as_str().unwrap_or_else(|| panic!("{reply}"));
            assert!(city.chars().count() <= 24, "{reply}");
            for (k, v) in obj {
                match k.as_str() {
                    "city" => {}
                    "unit" => assert!(v == "celsius" || v == "fahrenheit", "{reply}"),
                    "days" => assert!(matches!(v.as_i64(), Some(1..=7)), "{reply}"),
                    other => panic!("key {other} outside the schema: {reply}"),
                }
            }
        }
        "get_time" => {
            assert_eq!(obj.len(), 1, "{reply}");
            assert!(
                ["UTC", "CET", "JST"].contains(&obj["zone"].as_str().unwrap()),
                "{reply}"
            );
        }
        other => panic!("a call to {other}: {reply}"),
    }
}

#[test]
fn forced_calls_come_back_in_each_familys_markup_and_keep_to_the_schema() {
    let mut seeds = common::Rng(0x7001_ca11);
    for (family, opening, template) in TEMPLATES {
        let mut cfg = EngineConfig::new(common::smollm2_path());
        cfg.chat_template = Some(template.to_string());
        cfg.kv_cache_bytes = 64 << 20;
        let server = common::server::start(cfg, "smollm2");
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "get_time"}}),
        ] {
            let seed = seeds.next() % 1_000_000;
            let body = json!({"model": "smollm2", "max_tokens": 160, "temperature": 0.8,
                "seed": seed, "tools": tools(), "tool_choice": choice, "logprobs": true,
                "messages": [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]});
            let got = server.request("POST", "/v1/chat/completions", body.to_string().as_bytes());
            let reply = got.json();
            assert_eq!(got.status, 200, "{family}: {reply}");
            let choice0 = &reply["choices"][0];
            assert_eq!(
                choice0["finish_reason"], "tool_calls",
                "{family} seed {seed}: {reply}"
            );
            let calls = choice0["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{family}: {reply}");
            let f = &calls[0]["function"];
            let name = f["name"].as_str().unwrap();
            if choice.is_object() {
                assert_eq!(name, "get_time", "{family}: {reply}");
            }
            let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap())
                .unwrap_or_else(|e| panic!("{family}: arguments are not JSON ({e}): {reply}"));
            check_arguments(name, &args, &reply);
            // Written in the family's markup (the reply's tokens, from its logprobs).
            let written: String = choice0["logprobs"]["content"]
                .as_array()
                .unwrap_or_else(|| panic!("no logprobs: {reply}"))
                .iter()
                .map(|t| t["token"].as_str().unwrap())
                .collect();
            assert!(written.starts_with(opening), "{family}: {written}");
            // The markup is the call, not text beside it.
            let content = choice0["message"]["content"].as_str().unwrap_or("");
            assert!(
                !content.contains("TOOL_CALLS") && !content.contains('{'),
                "{family}: {reply}"
            );
        }
    }
}

/// The default template renders no tools: the generic `<tool_call>` format applies, and a
/// strict tool under `auto` is held to its schema when the reply opens a call.
#[test]
fn without_a_tool_template_calls_use_the_generic_markup() {
    let mut cfg = EngineConfig::new(common::smollm2_path());
    cfg.kv_cache_bytes = 64 << 20;
    let server = common::server::start(cfg, "smollm2");
    let body = json!({"model": "smollm2", "max_tokens": 160, "seed": 3, "tools": tools(),
        "tool_choice": "required",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}]});
    let got = server.request("POST", "/v1/chat/completions", body.to_string().as_bytes());
    let reply = got.json();
    assert_eq!(got.status, 200, "{reply}");
    let f = &reply["choices"][0]["message"]["tool_calls"][0]["function"];
    let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
    check_arguments(f["name"].as_str().unwrap(), &args, &reply);
}
