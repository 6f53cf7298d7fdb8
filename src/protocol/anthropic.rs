//! The Anthropic Messages codec (`POST /v1/messages`): content blocks (text, tool_use,
//! tool_result) into a conversation, engine outputs into a `message` or its SSE events
//! (`message_start`, `content_block_*`, `message_delta`, `message_stop`).

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{ApiError, Flavor, Sampling, parse_body};
use super::conversation::{Conversation, Message, Role, Tool, ToolCall, ToolChoice};
use super::fields::Passes;
use super::http::{
    ServerState, SseEvent, Submitted, check_model, json_when_done, read_body, respond, sse, submit,
};
use super::openai::response_format;
use super::output_parser::OutputEvent;
use super::reply::{ChoiceStreams, Reply, call_id};
use crate::engine::{FinishReason, RequestOutput};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Blocks {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub struct WireMessage {
    pub role: String,
    pub content: Blocks,
}

#[derive(Debug, Deserialize)]
pub struct WireTool {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub input_schema: Value,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: usize,
    pub messages: Vec<WireMessage>,
    pub system: Option<Blocks>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<WireTool>>,
    pub tool_choice: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema": ...}}`: structured output.
    pub output_config: Option<Value>,
    /// `{"user_id": ...}`: the end user, for the server's log.
    pub metadata: Option<Value>,
}

fn block_text(b: &Value, field: &str) -> Result<String, ApiError> {
    match (
        b.get("type").and_then(Value::as_str),
        b.get("text").and_then(Value::as_str),
    ) {
        (Some("text"), Some(t)) => Ok(t.to_string()),
        (ty, _) => Err(ApiError::bad(
            field,
            format!("a block of type {ty:?} is not supported here (text)"),
        )),
    }
}

pub fn conversation(req: &MessagesRequest) -> Result<Conversation, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut messages = Vec::new();
    let mut images = Vec::new();
    match &req.system {
        None => {}
        Some(Blocks::Text(t)) => messages.push(Message::new(Role::System, t.clone())),
        Some(Blocks::Blocks(bs)) => {
            let text = bs
                .iter()
                .enumerate()
                .map(|(i, b)| block_text(b, &format!("system[{i}]")))
                .collect::<Result<Vec<_>, _>>()?
                .join("\n");
            messages.push(Message::new(Role::System, text));
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.role.as_str() {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::bad(
                    &format!("{field}.role"),
                    format!("role `{other}` is not one of user, assistant"),
                ));
            }
        };
        let blocks = match &m.content {
            Blocks::Text(t) => {
                messages.push(Message::new(role, t.clone()));
                continue;
            }
            Blocks::Blocks(b) => b,
        };
        let mut msg = Message::new(role, "");
        for (j, b) in blocks.iter().enumerate() {
            let bfield = format!("{field}.content[{j}]");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => super::images::push_text(&mut msg, &block_text(b, &bfield)?),
                Some("image") if role == Role::User => {
                    let image = super::images::anthropic_image(b, &bfield)?;
                    super::images::push_image(&mut images, &mut msg, image);
                }
                Some("tool_use") if role == Role::Assistant => msg.tool_calls.push(ToolCall {
                    id: b["id"].as_str().unwrap_or_default().to_string(),
                    name: b["name"]
                        .as_str()
                        .ok_or_else(|| {
                            ApiError::bad(&format!("{bfield}.name"), "`name` is required")
                        })?
                        .to_string(),
                    arguments: b.get("input").cloned().unwrap_or(json!({})).to_string(),
                }),
                Some("tool_result") if role == Role::User => {
                    let content = match b.get("content") {
                        None => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts
                            .iter()
                            .map(|p| block_text(p, &format!("{bfield}.content")))
                            .collect::<Result<Vec<_>, _>>()?
                            .join("\n"),
                        Some(_) => {
                            return Err(ApiError::bad(
                                &format!("{bfield}.content"),
                                "tool_result content must be a string or text blocks",
                            ));
                        }
                    };
                    let mut r = Message::new(Role::Tool, content);
                    r.tool_call_id = b["tool_use_id"].as_str().map(str::to_string);
                    messages.push(r);
                }
                other => {
                    return Err(ApiError::bad(
                        &bfield,
                        format!(
                            "a {role:?} block of type {other:?} is not supported (text, tool_use, tool_result)"
                        ),
                    ));
                }
            }
        }
        if !msg.content.is_empty() || !msg.tool_calls.is_empty() {
            messages.push(msg);
        }
    }
    let tools = req
        .tools
        .iter()
        .flatten()
        .map(|t| Tool {
            name: t.name.clone(),
            description: t.description.clone(),
            parameters: t.input_schema.clone(),
            strict: t.strict.unwrap_or(false),
        })
        .collect();
    let tool_choice = match &req.tool_choice {
        None => ToolChoice::Auto,
        Some(c) => match c.get("type").and_then(Value::as_str) {
            Some("auto") => ToolChoice::Auto,
            Some("any") => ToolChoice::Required,
            Some("none") => ToolChoice::None,
            Some("tool") => ToolChoice::Named(
                c.get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad("tool_choice.name", "`name` is required"))?
                    .to_string(),
            ),
            other => {
                return Err(ApiError::bad(
                    "tool_choice.type",
                    format!("{other:?} is not one of auto, any, tool, none"),
                ));
            }
        },
    };
    Ok(Conversation {
        messages,
        tools,
        tool_choice,
        reasoning_effort: None,
        images,
    })
}

/// `stop_reason` and `stop_sequence`.
fn stop_reason(o: &RequestOutput, num_calls: usize) -> (Value, Value) {
    let sequence = o.stop_string.as_ref().map_or(Value::Null, |s| json!(s));
    let reason = match o.finish_reason {
        Some(FinishReason::Length) | Some(FinishReason::Preempted) => json!("max_tokens"),
        Some(_) if num_calls > 0 => json!("tool_use"),
        Some(_) if !sequence.is_null() => json!("stop_sequence"),
        Some(_) => json!("end_turn"),
        None => Value::Null,
    };
    (reason, sequence)
}

/// A tool call's input: its arguments as an object (`{}` when they are not one).
fn input_of(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

pub async fn messages(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = messages_inner(&st, body).await;
    respond(&st, "messages", Flavor::Anthropic, result).await
}

/// `POST /v1/messages/count_tokens`: the tokens of the prompt `messages` would render from
/// the same body (tools and system included), as Anthropic's endpoint counts them.
pub async fn count_tokens(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = count_tokens_inner(&st, body).await;
    respond(&st, "count_tokens", Flavor::Anthropic, result).await
}

async fn count_tokens_inner(
    st: &ServerState,
    body: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let mut body: Value = parse_body(&read_body(st, body).await?)?;
    // Counting has no output: the field `messages` requires is not part of this body.
    if let Some(fields) = body.as_object_mut() {
        if fields.contains_key("max_tokens") {
            return Err(ApiError::bad(
                "max_tokens",
                "count_tokens counts the prompt: `max_tokens` is not part of it",
            ));
        }
        fields.insert("max_tokens".into(), json!(1));
    }
    let mut passes = Passes::new(&body);
    let req: MessagesRequest = passes.pass()?;
    passes.finish(&[])?;
    check_model(st, &req.model)?;
    let text = st.engine()?.text_shared();
    let conv = conversation(&req)?;
    let ids = super::api::off_worker("messages", move || {
        conv.validate()
            .map_err(|e| ApiError::bad("messages", e.to_string()))?;
        conv.to_prompt_ids(&text)
            .map_err(|e| ApiError::bad("messages", e.to_string()))
    })
    .await?;
    Ok(HttpResponse::Ok().json(json!({"input_tokens": ids.len()})))
}

async fn messages_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let body: Value = parse_body(&read_body(st, body).await?)?;
    let mut passes = Passes::new(&body);
    let req: MessagesRequest = passes.pass()?;
    passes.finish(&[])?;
    if let Some(user) = req.metadata.as_ref().and_then(|m| m.get("user_id")) {
        tracing::info!(user = %user, "request for an end user");
    }
    check_model(st, &req.model)?;
    st.engine()?;
    let conv = conversation(&req)?;
    let grammar = match req.output_config.as_ref().and_then(|c| c.get("format")) {
        Some(f) if !f.is_null() => response_format(f, "output_config.format")?,
        _ => None,
    };
    let sampling = Sampling {
        grammar,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().unwrap_or_default(),
        max_tokens: Some(req.max_tokens),
        ..Default::default()
    };
    let Submitted {
        stream,
        spec,
        num_prompt_tokens: num_input_tokens,
    } = submit(st, &conv, sampling).await?;
    let request_id = stream.request_id();
    let id = format!("msg_{request_id:x}");
    let model = st.opts.served_model_name.clone();
    if !req.stream {
        return Ok(json_when_done(
            async move {
                let outputs = stream.collect_ok().await?;
                let o = outputs.first().cloned().unwrap_or_default();
                let r = Reply::parse(&o, spec);
                let mut content = Vec::new();
                if !r.reasoning.is_empty() {
                    content.push(
                        json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}),
                    );
                }
                if !r.text.is_empty() {
                    content.push(json!({"type": "text", "text": r.text}));
                }
                for (k, c) in r.calls.iter().enumerate() {
                    content.push(
                        json!({"type": "tool_use", "id": call_id("toolu_", request_id, 0, k),
                                "name": c.name, "input": input_of(&c.arguments)}),
                    );
                }
                let (reason, sequence) = stop_reason(&o, r.calls.len());
                Ok(json!({
                    "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                    "stop_reason": reason, "stop_sequence": sequence,
                    "usage": {"input_tokens": num_input_tokens, "output_tokens": o.token_ids.len()},
                }))
            },
            Flavor::Anthropic,
        ));
    }
    let mut parsers = ChoiceStreams::new(spec);
    // The open block: its index and kind.
    let mut open: Option<(usize, &'static str)> = None;
    let mut num_blocks = 0usize;
    let mut num_output_tokens = 0usize;
    let mut first = true;
    let encode = move |o: &RequestOutput| {
        let mut events = Vec::new();
        if first {
            first = false;
            events.push(SseEvent::named(
                "message_start",
                json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": num_input_tokens, "output_tokens": 0}}}),
            ));
        }
        num_output_tokens += o.token_ids.len();
        if let Some(err) = &o.error {
            events.push(SseEvent::named(
                "error",
                json!({"type": "error", "error": {"type": "api_error", "message": err}}),
            ));
            return events;
        }
        let mut start = |kind: &'static str,
                         block: Value,
                         events: &mut Vec<SseEvent>,
                         open: &mut Option<(usize, &'static str)>| {
            if let Some((i, _)) = open.take() {
                events.push(SseEvent::named(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                ));
            }
            events.push(SseEvent::named(
                "content_block_start",
                json!({"type": "content_block_start", "index": num_blocks, "content_block": block}),
            ));
            *open = Some((num_blocks, kind));
            num_blocks += 1;
        };
        let delta = |i: usize, d: Value| {
            SseEvent::named(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": d}),
            )
        };
        for e in parsers.feed(o) {
            match e {
                OutputEvent::Reasoning(t) => {
                    if !matches!(open, Some((_, "thinking"))) {
                        start(
                            "thinking",
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                            &mut events,
                            &mut open,
                        );
                    }
                    let i = open.map_or(0, |(i, _)| i);
                    events.push(delta(i, json!({"type": "thinking_delta", "thinking": t})));
                }
                OutputEvent::Text(t) => {
                    if !matches!(open, Some((_, "text"))) {
                        start(
                            "text",
                            json!({"type": "text", "text": ""}),
                            &mut events,
                            &mut open,
                        );
                    }
                    let i = open.map_or(0, |(i, _)| i);
                    events.push(delta(i, json!({"type": "text_delta", "text": t})));
                }
                OutputEvent::CallStart { index, name } => {
                    let block = json!({"type": "tool_use", "id": call_id("toolu_", o.request_id, 0, index), "name": name, "input": {}});
                    start("tool_use", block, &mut events, &mut open);
                }
                OutputEvent::CallArgs { delta: d, .. } => {
                    let i = open.map_or(0, |(i, _)| i);
                    events.push(delta(
                        i,
                        json!({"type": "input_json_delta", "partial_json": d}),
                    ));
                }
                OutputEvent::CallEnd { .. } => {
                    if let Some((i, _)) = open.take() {
                        events.push(SseEvent::named(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": i}),
                        ));
                    }
                }
            }
        }
        if o.finish_reason.is_some() {
            if let Some((i, _)) = open.take() {
                events.push(SseEvent::named(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                ));
            }
            let (reason, sequence) = stop_reason(o, parsers.num_calls(0));
            events.push(SseEvent::named(
                "message_delta",
                json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": num_output_tokens}}),
            ));
            events.push(SseEvent::named(
                "message_stop",
                json!({"type": "message_stop"}),
            ));
        }
        events
    };
    Ok(sse(stream, encode, Vec::new, false))
}
