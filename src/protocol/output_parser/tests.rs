use super::*;

/// Runs `text` through a parser in pieces of `chunk` chars, merging adjacent deltas.
fn parse(text: &str, chunk: usize, tools: bool, reasoning: bool) -> (Vec<OutputEvent>, usize) {
    parse_with(text, chunk, ParseSpec::generic(tools, reasoning))
}

fn parse_with(text: &str, chunk: usize, spec: ParseSpec) -> (Vec<OutputEvent>, usize) {
    let mut p = spec.parser();
    let chars: Vec<char> = text.chars().collect();
    let mut raw = Vec::new();
    for piece in chars.chunks(chunk) {
        raw.extend(p.push(&piece.iter().collect::<String>()));
    }
    raw.extend(p.finish());
    let num_raw_args = raw
        .iter()
        .filter(|e| matches!(e, OutputEvent::CallArgs { .. }))
        .count();
    let mut merged: Vec<OutputEvent> = Vec::new();
    for e in raw {
        match (merged.last_mut(), e) {
            (Some(OutputEvent::Text(a)), OutputEvent::Text(b)) => a.push_str(&b),
            (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(&b),
            (
                Some(OutputEvent::CallArgs { index: i, delta: a }),
                OutputEvent::CallArgs { index: j, delta: b },
            ) if *i == j => a.push_str(&b),
            (_, e) => merged.push(e),
        }
    }
    (merged, num_raw_args)
}

fn call(index: usize, name: &str, args: &str) -> Vec<OutputEvent> {
    vec![
        OutputEvent::CallStart {
            index,
            name: name.into(),
        },
        OutputEvent::CallArgs {
            index,
            delta: args.into(),
        },
        OutputEvent::CallEnd { index },
    ]
}

#[test]
fn plain_text_passes_through_in_any_chunking() {
    let text = "a < b, and <tool> is not <tool_cal a call.";
    for chunk in [1, 3, 100] {
        let (events, _) = parse(text, chunk, true, true);
        assert_eq!(
            events,
            vec![OutputEvent::Text(text.into())],
            "chunk {chunk}"
        );
    }
}

#[test]
fn a_tool_call_streams_its_arguments() {
    let args = r#"{"city": "Paris \"}\" </tool_call>", "days": [1, {"x": 2}]}"#;
    let text = format!(
        "Let me check.<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {args}}}\n</tool_call>"
    );
    for chunk in [1, 2, 7, 1000] {
        let (events, num_raw_args) = parse(&text, chunk, true, false);
        let mut want = vec![OutputEvent::Text("Let me check.".into())];
        want.extend(call(0, "get_weather", args));
        assert_eq!(events, want, "chunk {chunk}");
        if chunk == 1 {
            assert!(num_raw_args > 10, "arguments arrive incrementally");
        }
    }
}

#[test]
fn several_calls_other_field_orders_and_bare_json() {
    let text = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"arguments\": {\"k\": 1}, \"name\": \"b\"}</tool_call>";
    let (events, _) = parse(text, 4, true, false);
    let mut want = call(0, "a", "{}");
    want.extend(call(1, "b", "{\"k\":1}"));
    assert_eq!(events, want);
    let (events, _) = parse(
        "{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}",
        5,
        true,
        false,
    );
    assert_eq!(events, call(0, "get_time", "{\"tz\":\"UTC\"}"));
    // Without tools a JSON reply is text.
    let (events, _) = parse("{\"name\": \"x\", \"arguments\": {}}", 5, false, false);
    assert_eq!(
        events,
        vec![OutputEvent::Text(
            "{\"name\": \"x\", \"arguments\": {}}".into()
        )]
    );
}

#[test]
fn reasoning_and_truncated_calls() {
    let (events, _) = parse("<think>hmm, 2+2</think>\n\nIt is 4.", 3, true, true);
    assert_eq!(
        events,
        vec![
            OutputEvent::Reasoning("hmm, 2+2".into()),
            OutputEvent::Text("It is 4.".into())
        ]
    );
    let (events, _) = parse(
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": ",
        3,
        true,
        false,
    );
    assert_eq!(events, call(0, "f", "{\"a\": "));
    let (events, _) = parse("<tool_call>not json", 3, true, false);
    assert_eq!(
        events,
        vec![OutputEvent::Text("<tool_call>not json".into())]
    );
}

/// What DeepSeek-V4 writes (its template's own DSML format): reasoning up to `</think>`
/// when the prompt opened it, text, then a block of two invokes.
const DSML_REPLY: &str = "Let me check.</think>\n\nOne moment.\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"get_weather\">\n\
<｜DSML｜parameter name=\"city\" string=\"true\">Paris, \"FR\"</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"units\" string=\"false\">{\"temp\": \"C\"}</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

#[test]
fn deepseek_v4_dsml_calls_and_reasoning_from_the_start() {
    let args = serde_json::json!({"city": "Paris, \"FR\"", "days": 3, "units": {"temp": "C"}});
    let mut want = vec![
        OutputEvent::Reasoning("Let me check.".into()),
        OutputEvent::Text("One moment.\n\n".into()),
    ];
    want.extend(call(0, "get_weather", &args.to_string()));
    want.extend(call(1, "now", "{}"));
    for chunk in [1, 2, 7, 1000] {
        let (got, _) = parse_with(DSML_REPLY, chunk, ParseSpec::deepseek_v4(true, true));
        assert_eq!(got, want, "chunk {chunk}");
    }
    // Not in thinking mode (the prompt closed the block): all of it is text before the call.
    let (got, _) = parse_with("Hi there.", 3, ParseSpec::deepseek_v4(true, false));
    assert_eq!(got, vec![OutputEvent::Text("Hi there.".into())]);
    // Without tools a DSML block is text.
    let block = &DSML_REPLY[DSML_REPLY.find("<｜DSML｜tool_calls>").unwrap()..];
    let (got, _) = parse_with(block, 5, ParseSpec::deepseek_v4(false, false));
    assert_eq!(got, vec![OutputEvent::Text(block.into())]);
}

#[test]
fn a_malformed_dsml_block_stays_text() {
    let bad = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\"</｜DSML｜tool_calls>";
    let (got, _) = parse_with(bad, 4, ParseSpec::deepseek_v4(true, false));
    assert_eq!(got, vec![OutputEvent::Text(bad.into())]);
}

fn mistral() -> ParseSpec {
    ParseSpec {
        markup: CallMarkup::Mistral,
        ..ParseSpec::generic(true, false)
    }
}

/// Mistral's calls run to the end of the reply, in both of its forms, after any text.
#[test]
fn mistral_calls_are_read_in_either_form() {
    let list = "Sure.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abc123def\"}, {\"name\": \"now\", \"arguments\": {}}]";
    let args = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}"#;
    for chunk in [1, 3, 1000] {
        let (got, _) = parse_with(list, chunk, mistral());
        let mut want = vec![OutputEvent::Text("Sure.".into())];
        want.extend(call(0, "get_weather", r#"{"city":"Paris"}"#));
        want.extend(call(1, "now", "{}"));
        assert_eq!(got, want, "chunk {chunk}");
        let (got, _) = parse_with(args, chunk, mistral());
        assert_eq!(got, want[1..].to_vec(), "chunk {chunk}");
    }
    // Not a call after all: the reply's text, marker and all.
    for bad in [
        "[TOOL_CALLS] [{\"name\": 3}]",
        "[TOOL_CALLS]get_weather{}",
        "[TOOL_CALLS][]",
    ] {
        let (got, _) = parse_with(bad, 2, mistral());
        assert_eq!(got, vec![OutputEvent::Text(bad.into())], "{bad}");
    }
}
