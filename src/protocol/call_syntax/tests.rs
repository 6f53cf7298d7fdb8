use super::*;
use crate::model::chat_template::ChatTemplate;
use crate::protocol::conversation::{Conversation, Message, Role, Tool, ToolChoice};
use crate::protocol::output_parser::OutputEvent;
use crate::structured::{GrammarCompiler, GrammarSpec};

fn smollm2_text() -> ModelText {
    let path = crate::model::hub::resolve(crate::model::hub::DEFAULT_MODEL).unwrap();
    crate::model::load_text(&path).unwrap()
}

/// Tool sections in the shape of the families' published templates: what each asks the
/// model to write, and how it renders an earlier call.
const LLAMA_31: &str = "{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
const MISTRAL_V3: &str = "{% for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% if m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}{% endfor %}]{% else %}[INST] {{ m.content }}[/INST]{% endif %}{% endfor %}";
const MISTRAL_V11: &str = "{% for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}";
const QWEN: &str = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
const NO_TOOLS: &str = "{% for m in messages %}{{ m.content }}{% endfor %}";

fn with_template(mut text: ModelText, source: &str) -> ModelText {
    text.chat_template = Some(ChatTemplate::new(source, "<s>", "</s>").unwrap());
    text
}

#[test]
fn the_syntax_is_the_one_the_template_teaches() {
    let base = smollm2_text();
    let text = |m: &'static str| Marker {
        text: m,
        special_id: None,
    };
    let cases = [
        (LLAMA_31, CallSyntax::LlamaJson),
        (
            MISTRAL_V3,
            CallSyntax::MistralList {
                calls: text(MISTRAL_CALLS),
            },
        ),
        (
            MISTRAL_V11,
            CallSyntax::MistralArgs {
                calls: text(MISTRAL_CALLS),
                args: text(MISTRAL_ARGS),
            },
        ),
        (QWEN, CallSyntax::Hermes),
        (NO_TOOLS, CallSyntax::Hermes),
    ];
    for (source, want) in cases {
        assert_eq!(
            CallSyntax::of(&with_template(smollm2_text(), source)),
            want,
            "{source}"
        );
    }
    // A marker that is one special token of the vocabulary is that token.
    let special = base
        .tokenizer
        .as_ref()
        .unwrap()
        .special_tokens()
        .into_iter()
        .next()
        .unwrap();
    let leaked: &'static str = Box::leak(special.into_boxed_str());
    let m = Marker::of(leaked, &base);
    let id = base
        .tokenizer
        .as_ref()
        .unwrap()
        .token_to_id(leaked)
        .unwrap();
    assert_eq!(m.special_id, Some(id));
    assert_eq!(m.lark(), format!("<[{id}]>"));
    assert_eq!(Marker::of("[TOOL_CALLS]", &base).lark(), "\"[TOOL_CALLS]\"");
}

/// Seeded values, so the cases are not picked by hand.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = crate::sampling::splitmix64(self.0);
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Text with the characters that could end a value early: quotes, `<`, `/`, `>`.
    fn text(&mut self) -> String {
        const CHARS: &[char] = &['a', 'Z', ' ', '<', '/', '>', '"', '\\', 'é', '\n', '7'];
        let n = 1 + self.below(12) as usize;
        (0..n)
            .map(|_| CHARS[self.below(CHARS.len() as u64) as usize])
            .collect()
    }

    /// Arguments for `weather`: city always, the others now and then.
    fn args(&mut self) -> Map<String, Value> {
        let mut a = Map::new();
        a.insert("city".into(), Value::String(self.text()));
        if self.below(2) == 0 {
            a.insert("days".into(), json!(self.below(30)));
        }
        if self.below(2) == 0 {
            a.insert("unit".into(), json!(["c", "f"][self.below(2) as usize]));
        }
        if self.below(2) == 0 {
            a.insert("where".into(), json!({"lat": self.below(90) as f64 + 0.5}));
        }
        a
    }
}

fn weather() -> Value {
    json!({"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}}})
}

/// A call as each syntax writes it (DSML after the prompt's opening of the block), with
/// its JSON as the model's own template renders it.
fn written(syntax: &CallSyntax, name: &str, args: &Map<String, Value>) -> String {
    let json = Value::Object(args.clone()).to_string();
    match syntax {
        CallSyntax::Hermes => {
            format!("<tool_call>\n{{\"name\":\"{name}\",\"arguments\":{json}}}\n</tool_call>")
        }
        CallSyntax::LlamaJson => format!("{{\"name\":\"{name}\",\"parameters\":{json}}}"),
        CallSyntax::MistralList { .. } => {
            format!("[TOOL_CALLS][{{\"name\":\"{name}\",\"arguments\":{json}}}]")
        }
        CallSyntax::MistralArgs { .. } => format!("[TOOL_CALLS]{name}[ARGS]{json}"),
        CallSyntax::Dsml { .. } => {
            let mut s = format!("<｜DSML｜invoke name=\"{name}\">\n");
            // In the schema's order, as the grammar has them.
            for key in weather()["properties"].as_object().unwrap().keys() {
                let Some(v) = args.get(key) else { continue };
                let (string, v) = match v {
                    Value::String(t) => ("true", t.clone()),
                    // DeepSeek's encoding writes JSON spaced.
                    other => (
                        "false",
                        other.to_string().replace(':', ": ").replace(',', ", "),
                    ),
                };
                s.push_str(&format!(
                    "<｜DSML｜parameter name=\"{key}\" string=\"{string}\">{v}</｜DSML｜parameter>\n"
                ));
            }
            s.push_str("</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
            s
        }
    }
}

fn all_syntaxes() -> Vec<CallSyntax> {
    let text = |m: &'static str| Marker {
        text: m,
        special_id: None,
    };
    vec![
        CallSyntax::Hermes,
        CallSyntax::LlamaJson,
        CallSyntax::MistralList {
            calls: text(MISTRAL_CALLS),
        },
        CallSyntax::MistralArgs {
            calls: text(MISTRAL_CALLS),
            args: text(MISTRAL_ARGS),
        },
        CallSyntax::Dsml { dsml: text(DSML) },
    ]
}

fn forced(choice: ToolChoice, strict: bool) -> Conversation {
    let tool = |name: &str| Tool {
        name: name.into(),
        description: String::new(),
        parameters: weather(),
        strict,
    };
    Conversation {
        messages: vec![Message::new(Role::User, "Weather?")],
        tools: vec![tool("get_weather"), tool("get_forecast")],
        tool_choice: choice,
        reasoning_effort: None,
        images: Vec::new(),
    }
}

/// Every syntax's forced grammar takes the calls it writes, held to the schema, and the
/// reply reads back as the same call; what the schema forbids is refused.
#[test]
fn forced_calls_in_every_syntax_follow_the_schema_and_read_back() {
    let text = smollm2_text();
    let compiler = GrammarCompiler::new(text.tokenizer.clone().unwrap(), text.stop_ids[0]).unwrap();
    let mut rng = Gen(0x5eed_0063);
    for syntax in all_syntaxes() {
        for (choice, names) in [
            (ToolChoice::Required, &["get_weather", "get_forecast"][..]),
            (
                ToolChoice::Named("get_forecast".into()),
                &["get_forecast"][..],
            ),
        ] {
            let conv = forced(choice.clone(), false);
            let Some(GrammarSpec::Lark(g)) = conv.tool_grammar(&syntax) else {
                panic!("{syntax:?} {choice:?}: no grammar");
            };
            let grammar = compiler
                .compile(&GrammarSpec::Lark(g.clone()))
                .unwrap_or_else(|e| panic!("{syntax:?}: {e}\n{g}"));
            for _ in 0..12 {
                let name = names[rng.below(names.len() as u64) as usize];
                let args = rng.args();
                let reply = written(&syntax, name, &args);
                assert!(grammar.accepts(&reply), "{syntax:?} refused\n{reply}\n{g}");
                let spec = syntax.parse_spec(true, false, false, true);
                let mut p = spec.parser();
                let mut events = p.push(&reply);
                events.extend(p.finish());
                let got: Vec<(String, Value)> = calls_of(&events);
                assert_eq!(
                    got,
                    vec![(name.to_string(), Value::Object(args))],
                    "{syntax:?}\n{reply}"
                );
            }
            let mut bad = Vec::new();
            let mut args = rng.args();
            args.remove("city");
            bad.push(written(&syntax, "get_forecast", &args));
            let mut args = rng.args();
            args.insert("unit".into(), json!("k"));
            bad.push(written(&syntax, "get_forecast", &args));
            let mut args = rng.args();
            args.insert("days".into(), json!("three"));
            bad.push(written(&syntax, "get_forecast", &args));
            bad.push(written(&syntax, "get_time", &rng.args()));
            for reply in bad {
                assert!(!grammar.accepts(&reply), "{syntax:?} took\n{reply}");
            }
        }
    }
}

fn calls_of(events: &[OutputEvent]) -> Vec<(String, Value)> {
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events {
        match e {
            OutputEvent::CallStart { name, .. } => calls.push((name.clone(), String::new())),
            OutputEvent::CallArgs { delta, .. } => calls.last_mut().unwrap().1.push_str(delta),
            _ => {}
        }
    }
    calls
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).unwrap_or(Value::String(a))))
        .collect()
}

/// A key the schema does not name is refused in DSML, unless the schema allows more.
#[test]
fn dsml_takes_extra_parameters_only_where_the_schema_allows_them() {
    let text = smollm2_text();
    let compiler = GrammarCompiler::new(text.tokenizer.clone().unwrap(), text.stop_ids[0]).unwrap();
    let syntax = CallSyntax::Dsml {
        dsml: Marker {
            text: DSML,
            special_id: None,
        },
    };
    let extra = "<｜DSML｜invoke name=\"get_weather\">\n\
        <｜DSML｜parameter name=\"city\" string=\"true\">Oslo</｜DSML｜parameter>\n\
        <｜DSML｜parameter name=\"mood\" string=\"false\">{\"x\": 1}</｜DSML｜parameter>\n\
        </｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    for (allow, want) in [(None, false), (Some(true), true), (Some(false), false)] {
        let mut conv = forced(ToolChoice::Named("get_weather".into()), true);
        if let Some(allow) = allow {
            conv.tools[0].parameters["additionalProperties"] = json!(allow);
        }
        let g = conv.tool_grammar(&syntax).unwrap();
        let grammar = compiler.compile(&g).unwrap();
        assert_eq!(
            grammar.accepts(extra),
            want,
            "additionalProperties {allow:?}"
        );
    }
}

/// Strict tools under `auto`: free text, or a well-formed call; DSML stays free there.
#[test]
fn strict_tools_under_auto_allow_text_or_a_call() {
    let text = smollm2_text();
    let compiler = GrammarCompiler::new(text.tokenizer.clone().unwrap(), text.stop_ids[0]).unwrap();
    let conv = forced(ToolChoice::Auto, true);
    let mut rng = Gen(7);
    for syntax in all_syntaxes() {
        let Some(g) = conv.tool_grammar(&syntax) else {
            assert!(matches!(syntax, CallSyntax::Dsml { .. }), "{syntax:?}");
            continue;
        };
        let grammar = compiler.compile(&g).unwrap();
        assert!(grammar.accepts("It is sunny."), "{syntax:?}");
        if !matches!(syntax, CallSyntax::Dsml { .. }) {
            let call = written(&syntax, "get_weather", &rng.args());
            assert!(grammar.accepts(&call), "{syntax:?}: {call}");
        }
    }
}
