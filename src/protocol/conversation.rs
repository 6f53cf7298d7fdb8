//! One conversation type inside the server; each API is a codec to and from it.
//!
//! Rendering guards against special-token injection: every string that came with a request
//! (contents, names, tool calls and results, tool definitions) has each special-token
//! string in it replaced by a marker before the template runs; the rendered text is
//! tokenized with special tokens on, and each marker as plain text — a user who writes
//! `<|im_start|>` gets those characters, never the control token.
//!
//! Tools go through the model's template when it renders a `tools` list. Otherwise the
//! generic format applies: the tools are described in the system turn, and the model calls
//! one by replying `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; results come
//! back as user turns in `<tool_response>` tags. `required` and named tool choices
//! constrain the reply to that call syntax with a grammar, so the call is well-formed.

use serde_json::{Value, json};

use super::call_syntax::{CallShape, CallSyntax};
use crate::error::{Result, TroupeError};
use crate::model::ModelText;
use crate::model::tokenizer::Tokenizer;
use crate::structured::GrammarSpec;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// A piece of a message given in parts: text, or an image of the conversation's
/// `images` (by index), in the order the client sent them.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Text(String),
    Image(usize),
}

/// An image as a request carries it, before decoding: its bytes, the MIME type it was
/// declared with, and the request field it came in (errors name it).
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub bytes: Vec<u8>,
    /// An `http(s)` URL whose bytes are fetched before rendering (`images::fetch_remote`).
    pub url: Option<String>,
    pub mime: Option<String>,
    pub field: String,
}

#[derive(Debug, Clone)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Set where the message holds images: its text and images in order (`content` is
    /// then its text alone).
    pub parts: Vec<Part>,
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call id and tool name.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            parts: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
    /// Arguments are constrained to `parameters`.
    pub strict: bool,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub enum ToolChoice {
    None,
    #[default]
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone, Default)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    /// The request's reasoning effort (OpenAI's `reasoning_effort`): DeepSeek-V4 prompts
    /// open the reply in thinking mode when it is given.
    pub reasoning_effort: Option<String>,
    /// The images the messages' parts name.
    pub images: Vec<ImageInput>,
}

/// Marker for the `k`-th special-token string inside request text: private-use
/// characters no template emits and no tokenizer merges across.
fn marker(k: usize) -> String {
    format!("\u{F8F0}{k}\u{F8F1}")
}

struct Guard<'a> {
    specials: &'a [String],
}

impl Guard<'_> {
    fn text(&self, s: &str) -> String {
        // The marker's own opening character, typed by a user, is escaped as one more
        // "special" so it cannot forge a marker.
        let mut out = if s.contains('\u{F8F0}') {
            s.replace('\u{F8F0}', &marker(self.specials.len()))
        } else {
            s.to_string()
        };
        for (k, sp) in self.specials.iter().enumerate() {
            if out.contains(sp.as_str()) {
                out = out.replace(sp.as_str(), &marker(k));
            }
        }
        out
    }

    fn value(&self, v: &Value) -> Value {
        match v {
            Value::String(s) => Value::String(self.text(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(x)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| (self.text(k), self.value(x)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// What is wrong with a conversation before any template sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversationError {
    #[error("the conversation has no messages")]
    NoMessages,
    #[error("tool_choice `required` needs at least one tool")]
    RequiredWithoutTools,
    #[error("tool_choice names `{0}`, which is not among the tools")]
    UnknownTool(String),
}

impl Conversation {
    pub fn from_messages(messages: Vec<Message>) -> Self {
        Conversation {
            messages,
            ..Default::default()
        }
    }

    /// Whether replies are parsed for tool calls.
    pub fn uses_tools(&self) -> bool {
        !self.tools.is_empty() && self.tool_choice != ToolChoice::None
    }

    /// Checks what no template would: the named tool exists, a choice has tools.
    pub fn validate(&self) -> std::result::Result<(), ConversationError> {
        if self.messages.is_empty() {
            return Err(ConversationError::NoMessages);
        }
        match &self.tool_choice {
            ToolChoice::Required if self.tools.is_empty() => {
                Err(ConversationError::RequiredWithoutTools)
            }
            ToolChoice::Named(n) if !self.tools.iter().any(|t| &t.name == n) => {
                Err(ConversationError::UnknownTool(n.clone()))
            }
            _ => Ok(()),
        }
    }

    /// The grammar the reply must follow for the tool choice, written in `syntax`, if any.
    pub fn tool_grammar(&self, syntax: &CallSyntax) -> Option<GrammarSpec> {
        // A forced call (required, named) is held to its tool's schema, as vLLM does; under
        // `auto` only strict tools are, the rest to any object.
        let forced = matches!(
            self.tool_choice,
            ToolChoice::Required | ToolChoice::Named(_)
        );
        let chosen: Vec<&Tool> = match &self.tool_choice {
            ToolChoice::None => return None,
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Auto if self.tools.iter().any(|t| t.strict) => self.tools.iter().collect(),
            ToolChoice::Auto => return None,
        };
        if chosen.is_empty() {
            return None;
        }
        let held = |t: &Tool| t.strict || forced;
        // Parameters' `$defs` / `definitions` move to the grammar's root, where their
        // `#/$defs/...` references resolve; a name two tools define differently leaves the
        // second tool's arguments to any object.
        let mut roots: serde_json::Map<String, Value> = serde_json::Map::new();
        let mut shapes: Vec<CallShape<'_>> = Vec::with_capacity(chosen.len());
        for t in &chosen {
            let mut args = if held(t) {
                t.parameters.clone()
            } else {
                json!({"type": "object"})
            };
            let mut clash = false;
            for key in ["$defs", "definitions"] {
                let Some(defs) = args.as_object_mut().and_then(|o| o.remove(key)) else {
                    continue;
                };
                let into = roots.entry(key).or_insert_with(|| json!({}));
                for (name, def) in defs.as_object().into_iter().flatten() {
                    match into.get(name) {
                        Some(old) if old != def => clash = true,
                        _ => {
                            into[name] = def.clone();
                        }
                    }
                }
            }
            shapes.push(CallShape {
                name: &t.name,
                arguments: if clash {
                    json!({"type": "object"})
                } else {
                    args
                },
            });
        }
        // A tool that is not strict is held to what of its schema the grammar engine
        // supports; a strict one fails loudly on the rest.
        if forced && !chosen.iter().any(|t| t.strict) {
            roots.insert(
                "x-guidance".into(),
                json!({"lenient": true, "whitespace_flexible": false}),
            );
        }
        syntax
            .grammar(&shapes, &roots, forced)
            .map(GrammarSpec::Lark)
    }

    /// Prompt token ids through the model's chat template (`prompt.rs` chooses it),
    /// ending with the assistant turn's opening.
    pub(super) fn template_prompt_ids(
        &self,
        tok: &Tokenizer,
        text: &ModelText,
    ) -> Result<Vec<u32>> {
        let template = text
            .chat_template
            .as_ref()
            .ok_or_else(|| TroupeError::InvalidInput("the model has no chat template".into()))?;
        let specials = tok.special_tokens();
        let guard = Guard {
            specials: &specials,
        };
        let with_tools = self.uses_tools();
        let native = with_tools && template.supports_tools();
        let mut messages: Vec<Value> = self
            .messages
            .iter()
            .map(|m| self.message_json(m, native, &guard))
            .collect();
        if with_tools && !native {
            let preamble = guard.text(&generic_tools_preamble(&self.tools));
            match messages.first_mut() {
                Some(first) if first["role"] == "system" => {
                    let content = first["content"].as_str().unwrap_or("").to_string();
                    first["content"] = Value::String(format!("{content}\n\n{preamble}"));
                }
                _ => messages.insert(0, json!({"role": "system", "content": preamble})),
            }
        }
        let tools = native.then(|| {
            Value::Array(
                self.tools
                    .iter()
                    .map(|t| {
                        guard.value(&json!({"type": "function", "function": {
                            "name": t.name, "description": t.description, "parameters": t.parameters}}))
                    })
                    .collect(),
            )
        });
        let rendered = template.render_json(&Value::Array(messages), tools.as_ref(), true)?;
        let mut ids = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(at) = rest.find('\u{F8F0}') {
            let after = &rest[at + '\u{F8F0}'.len_utf8()..];
            let Some(close) = after.find('\u{F8F1}') else {
                break;
            };
            let literal = match after[..close].parse::<usize>() {
                Ok(k) if k < specials.len() => Some(specials[k].as_str()),
                Ok(k) if k == specials.len() => Some("\u{F8F0}"),
                _ => None,
            };
            let Some(special) = literal else {
                // Not one of ours (the user typed the characters): plain text.
                ids.extend(tok.encode(&rest[..at + '\u{F8F0}'.len_utf8()])?);
                rest = after;
                continue;
            };
            ids.extend(tok.encode(&rest[..at])?);
            ids.extend(tok.encode_plain(special)?);
            rest = &after[close + '\u{F8F1}'.len_utf8()..];
        }
        ids.extend(tok.encode(rest)?);
        Ok(ids)
    }

    fn message_json(&self, m: &Message, native: bool, guard: &Guard) -> Value {
        if !m.parts.is_empty() {
            // The template places each image's placeholder where the part stands.
            let parts: Vec<Value> = m
                .parts
                .iter()
                .map(|p| match p {
                    Part::Text(t) => json!({"type": "text", "text": guard.text(t)}),
                    Part::Image(_) => json!({"type": "image"}),
                })
                .collect();
            return json!({"role": m.role.as_str(), "content": parts});
        }
        let content = guard.text(&m.content);
        if native {
            let mut v = json!({"role": m.role.as_str(), "content": content});
            if !m.tool_calls.is_empty() {
                v["tool_calls"] = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let args = serde_json::from_str::<Value>(&c.arguments)
                            .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                        guard.value(&json!({"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": args}}))
                    })
                    .collect();
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = Value::String(guard.text(id));
            }
            if let Some(name) = &m.name {
                v["name"] = Value::String(guard.text(name));
            }
            return v;
        }
        match m.role {
            Role::Tool => json!({"role": "user",
                "content": format!("<tool_response>\n{content}\n</tool_response>")}),
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut text = content;
                for c in &m.tool_calls {
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                    let call = json!({"name": c.name, "arguments": args});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!(
                        "<tool_call>\n{}\n</tool_call>",
                        guard.value(&call)
                    ));
                }
                json!({"role": "assistant", "content": text})
            }
            role => json!({"role": role.as_str(), "content": content}),
        }
    }
}

/// The generic format's system-turn description of the tools.
fn generic_tools_preamble(tools: &[Tool]) -> String {
    let mut s = String::from("You can call functions. The available functions are:\n<tools>\n");
    for t in tools {
        s.push_str(
            &json!({"name": t.name, "description": t.description, "parameters": t.parameters})
                .to_string(),
        );
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call a function, reply with only:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>",
    );
    s
}

#[cfg(test)]
mod tests;
