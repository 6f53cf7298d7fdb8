//! The markup a tool call is written in: the one the model's own chat template teaches,
//! so that a forced call (`required`, a named tool, a strict tool under `auto`) is held to
//! the tool's schema in the form the model learned, and its reply is read back in it.
//! vLLM asks the user for a tool parser per model; here the template says which.
//!
//! - `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`: Hermes and Qwen templates,
//!   and troupe's generic format (a template that renders no tools).
//! - One bare JSON object `{"name": …, "parameters": …}`: Llama 3.1–3.3.
//! - `[TOOL_CALLS][{"name": …, "arguments": …}]`: Mistral's v3 templates;
//!   `[TOOL_CALLS]name[ARGS]{…}` in its later ones.
//! - DeepSeek-V4's DSML blocks, whose prompt opens the block when a call is forced
//!   (`dsml`).
//!
//! A control string that is one special token of the vocabulary is written into the
//! grammar as that token (`<[id]>`): the model emits the token, never its spelling.

use serde_json::{Map, Value, json};

mod dsml;
use super::output_parser::{CallMarkup, ParseSpec};
use crate::model::ModelText;
use crate::structured::lark_json;

const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
pub(super) const DSML: &str = "｜DSML｜";

/// A control string of a syntax: a special token's id where the vocabulary has it as one.
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    pub text: &'static str,
    pub special_id: Option<u32>,
}

impl Marker {
    fn of(text: &'static str, model: &ModelText) -> Marker {
        let special_id = model.tokenizer.as_ref().and_then(|t| {
            let id = t.token_to_id(text)?;
            t.special_tokens().iter().any(|s| s == text).then_some(id)
        });
        Marker { text, special_id }
    }

    /// The marker as a Lark expression.
    pub(super) fn lark(&self) -> String {
        match self.special_id {
            Some(id) => format!("<[{id}]>"),
            None => lark_str(self.text),
        }
    }
}

/// A Lark string literal for `s`.
pub(super) fn lark_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

#[derive(Debug, Clone, PartialEq)]
pub enum CallSyntax {
    Hermes,
    LlamaJson,
    MistralList { calls: Marker },
    MistralArgs { calls: Marker, args: Marker },
    Dsml { dsml: Marker },
}

/// A tool as its grammar sees it: the name and the schema its arguments are held to.
pub struct CallShape<'a> {
    pub name: &'a str,
    pub arguments: Value,
}

impl CallSyntax {
    /// The syntax `model`'s template teaches (the generic one where it renders no tools).
    pub fn of(model: &ModelText) -> CallSyntax {
        if model.deepseek_v4.is_some() {
            return CallSyntax::Dsml {
                dsml: Marker::of(DSML, model),
            };
        }
        let Some(template) = model.chat_template.as_ref().filter(|t| t.supports_tools()) else {
            return CallSyntax::Hermes;
        };
        let source = template.source();
        if source.contains(MISTRAL_CALLS) {
            let calls = Marker::of(MISTRAL_CALLS, model);
            return if source.contains(MISTRAL_ARGS) {
                CallSyntax::MistralArgs {
                    calls,
                    args: Marker::of(MISTRAL_ARGS, model),
                }
            } else {
                CallSyntax::MistralList { calls }
            };
        }
        if source.contains("<tool_call>") {
            return CallSyntax::Hermes;
        }
        // Llama 3.x asks for `{"name": function name, "parameters": …}` and renders earlier
        // calls with a `"parameters"` key.
        if source.contains("\"parameters\": dictionary of argument name")
            || (source.contains("<|python_tag|>") && source.contains("\"parameters\": "))
        {
            return CallSyntax::LlamaJson;
        }
        CallSyntax::Hermes
    }

    /// How replies written in this syntax are read. `forced`: the prompt opened the call
    /// block itself (DeepSeek-V4 under a required or named choice).
    pub fn parse_spec(
        &self,
        tools: bool,
        reasoning: bool,
        thinking: bool,
        forced: bool,
    ) -> ParseSpec {
        let markup = match self {
            CallSyntax::Hermes | CallSyntax::LlamaJson => CallMarkup::Tagged,
            CallSyntax::MistralList { .. } | CallSyntax::MistralArgs { .. } => CallMarkup::Mistral,
            CallSyntax::Dsml { .. } => CallMarkup::Dsml,
        };
        ParseSpec {
            tools,
            reasoning,
            markup,
            starts_in_reasoning: thinking,
            starts_in_call: tools && forced && markup == CallMarkup::Dsml,
        }
    }

    /// Whether the reply must keep special tokens in its text for its calls to be read.
    pub fn needs_special_tokens(&self) -> bool {
        match self {
            CallSyntax::Hermes | CallSyntax::LlamaJson => false,
            CallSyntax::MistralList { calls } => calls.special_id.is_some(),
            CallSyntax::MistralArgs { calls, args } => {
                calls.special_id.is_some() || args.special_id.is_some()
            }
            CallSyntax::Dsml { dsml } => dsml.special_id.is_some(),
        }
    }

    /// The Lark grammar a reply must follow: exactly one call to one of `calls` when
    /// `forced`, else (strict tools under `auto`) free text or such a call. `roots` are
    /// the `$defs` the argument schemas refer to, placed at each JSON document's top.
    /// `None` where the syntax has no such grammar (DSML under `auto`: its calls follow
    /// free text mid-reply).
    pub fn grammar(
        &self,
        calls: &[CallShape<'_>],
        roots: &Map<String, Value>,
        forced: bool,
    ) -> Option<String> {
        let rooted = |mut schema: Value| {
            for (k, v) in roots {
                schema[k] = v.clone();
            }
            schema
        };
        let objects = |key: &str| {
            let any: Vec<Value> = calls
                .iter()
                .map(|c| {
                    json!({"type": "object",
                        "properties": {"name": {"const": c.name}, key: c.arguments},
                        "required": ["name", key], "additionalProperties": false})
                })
                .collect();
            format!("call: {}\n", lark_json(&rooted(json!({"anyOf": any}))))
        };
        // Free text under `auto`: anything that does not open a call.
        let either = |call: &str, text_rx: &str| {
            if forced {
                format!("start: {call}\n")
            } else {
                format!("start: TEXT | {call}\nTEXT: /{text_rx}/\n")
            }
        };
        Some(match self {
            CallSyntax::Hermes => format!(
                "{}{}",
                either(
                    "\"<tool_call>\\n\" call \"\\n</tool_call>\"",
                    "[^<][\\s\\S]*"
                ),
                objects("arguments")
            ),
            CallSyntax::LlamaJson => {
                format!(
                    "{}{}",
                    either("call", "[^{][\\s\\S]*"),
                    objects("parameters")
                )
            }
            CallSyntax::MistralList { calls: m } => format!(
                "{}{}",
                either(&format!("{} \"[\" call \"]\"", m.lark()), free_of(m)),
                objects("arguments")
            ),
            CallSyntax::MistralArgs { calls: m, args } => {
                let mut g = either(&format!("{} call", m.lark()), free_of(m));
                let alts: Vec<String> = (0..calls.len()).map(|i| format!("call_{i}")).collect();
                g.push_str(&format!("call: {}\n", alts.join(" | ")));
                for (i, c) in calls.iter().enumerate() {
                    g.push_str(&format!(
                        "call_{i}: {} {} args_{i}\nargs_{i}: {}\n",
                        lark_str(c.name),
                        args.lark(),
                        lark_json(&rooted(c.arguments.clone()))
                    ));
                }
                g
            }
            CallSyntax::Dsml { dsml } => {
                if !forced {
                    return None;
                }
                dsml::forced(dsml, calls, roots)
            }
        })
    }
}

/// Free text that cannot be mistaken for a call opened by `m`: any text when `m` is a
/// special token (text never spells one), else text not starting with its first character.
fn free_of(m: &Marker) -> &'static str {
    if m.special_id.is_some() {
        "[\\s\\S]+"
    } else {
        "[^\\[][\\s\\S]*"
    }
}

#[cfg(test)]
mod tests;
