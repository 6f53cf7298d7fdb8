//! The grammar of a forced DeepSeek-V4 call: after the prompt's opening
//! `<｜DSML｜tool_calls>\n`, one `invoke` of a named tool holding the parameters its schema
//! names, in the schema's order (required ones present, others optional, no others unless
//! the schema allows more), then the block's close.
//!
//! DeepSeek's encoding writes a string parameter as is (`string="true"`) and any other
//! value as spaced JSON (`string="false"`), so a plain string is free text up to the
//! parameter's close, an enum or const string is one of its values, and a string with
//! further constraints (pattern, length, format) is written as a JSON string, where the
//! schema holds it; every other value is JSON held to its schema.

use serde_json::{Map, Value, json};

use super::{CallShape, Marker, lark_str};
use crate::structured::lark_json;

/// Keywords that describe a value without constraining it.
const ANNOTATIONS: [&str; 6] = [
    "description",
    "title",
    "examples",
    "default",
    "$comment",
    "deprecated",
];

/// How one parameter's value is written.
enum Written {
    /// Free text up to the close.
    Text,
    /// One of these strings, as is.
    Choice(Vec<String>),
    /// JSON held to the schema.
    Json(Value),
}

fn value_of(schema: &Value) -> Written {
    let Some(obj) = schema.as_object() else {
        return Written::Json(schema.clone());
    };
    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    if let Some(values) = obj.get("enum").and_then(strings).filter(|v| !v.is_empty()) {
        return Written::Choice(values);
    }
    if let Some(c) = obj.get("const").and_then(Value::as_str) {
        return Written::Choice(vec![c.to_string()]);
    }
    let plain = obj.get("type") == Some(&json!("string"))
        && obj
            .keys()
            .all(|k| k == "type" || ANNOTATIONS.contains(&k.as_str()));
    if plain {
        Written::Text
    } else {
        Written::Json(schema.clone())
    }
}

/// The Lark grammar; `dsml` is the `｜DSML｜` marker (a special token in DeepSeek's
/// vocabulary), `roots` the `$defs` the schemas refer to.
pub(super) fn forced(dsml: &Marker, calls: &[CallShape<'_>], roots: &Map<String, Value>) -> String {
    let d = dsml.lark();
    let mut g = String::new();
    let invokes: Vec<String> = (0..calls.len()).map(|i| format!("invoke_{i}")).collect();
    g.push_str(&format!(
        "start: ({}) \"</\" {d} \"tool_calls>\"\n",
        invokes.join(" | ")
    ));
    // A string's text ends at its close. With a special `｜DSML｜`, text cannot contain
    // the token, so the text runs to a `</` the token follows (the text may hold other
    // `</`); spelled out, the text is lazy up to the first whole close.
    let text_close = match dsml.special_id {
        Some(_) => {
            g.push_str("TEXT: /(.|\\n)*<\\//\n");
            format!("TEXT {d} \"parameter>\\n\"")
        }
        None => {
            g.push_str(&format!(
                "text[lazy]: /(.|\\n)*{}/\n",
                regex_escape(&format!("</{}parameter>", dsml.text))
            ));
            "text \"\\n\"".to_string()
        }
    };
    let close = format!("\"</\" {d} \"parameter>\\n\"");
    let json_x = |schema: Value, lenient: bool| {
        let mut schema = schema;
        if let Some(obj) = schema.as_object_mut() {
            for (k, v) in roots {
                obj.insert(k.clone(), v.clone());
            }
            // As DeepSeek's encoding writes non-string values.
            obj.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ", ",
                    "key_separator": ": ", "lenient": lenient}),
            );
        }
        lark_json(&schema)
    };
    let lenient = roots
        .get("x-guidance")
        .and_then(|x| x["lenient"].as_bool())
        .unwrap_or(false);
    let roots_less = |v: &Value| {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            o.remove("x-guidance");
        }
        v
    };
    for (i, call) in calls.iter().enumerate() {
        let args = roots_less(&call.arguments);
        let mut body = Vec::new();
        let props = args["properties"].as_object();
        let required: Vec<&str> = args["required"]
            .as_array()
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("p_{i}_{j}");
            let open = |string: bool| {
                format!(
                    "\"<\" {d} {}",
                    lark_str(&format!("parameter name=\"{key}\" string=\"{string}\">"))
                )
            };
            match value_of(schema) {
                Written::Text => g.push_str(&format!("{rule}: {} {text_close}\n", open(true))),
                Written::Choice(values) => {
                    let alts: Vec<String> = values.iter().map(|v| lark_str(v)).collect();
                    g.push_str(&format!(
                        "{rule}: {} ({}) {close}\n",
                        open(true),
                        alts.join(" | ")
                    ));
                }
                Written::Json(s) => {
                    g.push_str(&format!(
                        "{rule}: {} v_{i}_{j} {close}\nv_{i}_{j}: {}\n",
                        open(false),
                        json_x(s, lenient)
                    ));
                }
            }
            body.push(if required.contains(&key.as_str()) {
                rule
            } else {
                format!("{rule}?")
            });
        }
        // Keys the schema does not name, where it allows them (or names none).
        let open_ended = props.is_none()
            || !matches!(
                args.get("additionalProperties"),
                None | Some(Value::Bool(false))
            );
        if open_ended {
            body.push(format!("extra_{i}*"));
            g.push_str(&format!(
                "extra_{i}: \"<\" {d} \"parameter name=\\\"\" /[A-Za-z_][A-Za-z0-9_.\\-]*/ \"\\\" string=\\\"\" \
                 (\"true\\\">\" {text_close} | \"false\\\">\" xv_{i} {close})\nxv_{i}: {}\n",
                json_x(json!({}), lenient)
            ));
        }
        g.push_str(&format!(
            "invoke_{i}: \"<\" {d} {} {} \"</\" {d} \"invoke>\\n\"\n",
            lark_str(&format!("invoke name=\"{}\">\n", call.name)),
            body.join(" ")
        ));
    }
    g
}

/// `s` as a literal inside a Lark `/regex/`.
fn regex_escape(s: &str) -> String {
    s.chars()
        .map(|c| {
            if "\\^$.|?*+()[]{}/-".contains(c) {
                format!("\\{c}")
            } else {
                c.to_string()
            }
        })
        .collect()
}
