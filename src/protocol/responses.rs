//! The OpenAI Responses codec (`POST /v1/responses`): `input` items and `instructions` into
//! a conversation, engine outputs into a `response` object or its typed SSE events.
//! Stateless: `previous_response_id` and `store` are refused — nothing is kept.

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{ApiError, Content, Flavor, Sampling, parse_body};
use super::conversation::{Conversation, Message, Role, Tool, ToolCall};
use super::fields::Passes;
use super::http::{
    ServerState, SseEvent, Submitted, check_model, json_when_done, now_secs, read_body, respond,
    sse, submit,
};
use super::openai::{chat_logprobs, check_chat_extras, response_format, tool_choice};
use super::output_parser::OutputEvent;
use super::reply::{ChoiceStreams, Reply, call_id};
use crate::engine::{FinishReason, RequestOutput};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_logprobs: Option<usize>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub text: Option<Value>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    /// The end user, for the server's log.
    pub user: Option<String>,
    /// Only `true` (the default): a reply may call several tools.
    pub parallel_tool_calls: Option<bool>,
}

fn conversation(req: &ResponsesRequest) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    if let Some(i) = &req.instructions {
        messages.push(Message::new(Role::System, i.clone()));
    }
    match &req.input {
        Input::Text(t) => messages.push(Message::new(Role::User, t.clone())),
        Input::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "message" => {
                        let role = match item.get("role").and_then(Value::as_str) {
                            Some("system" | "developer") => Role::System,
                            Some("user") => Role::User,
                            Some("assistant") => Role::Assistant,
                            other => {
                                return Err(ApiError::bad(
                                    &format!("{field}.role"),
                                    format!("unknown role {other:?}"),
                                ));
                            }
                        };
                        let content: Content = serde_json::from_value(
                            item.get("content").cloned().unwrap_or(Value::Null),
                        )
                        .map_err(|_| {
                            ApiError::bad(
                                &format!("{field}.content"),
                                "content must be a string or a list of parts",
                            )
                        })?;
                        let text = content.text(
                            &format!("{field}.content"),
                            &["input_text", "output_text", "text"],
                        )?;
                        messages.push(Message::new(role, text));
                    }
                    "function_call" => {
                        let s = |k: &str| {
                            item.get(k)
                                .and_then(Value::as_str)
                                .map(str::to_string)
                                .ok_or_else(|| {
                                    ApiError::bad(
                                        &format!("{field}.{k}"),
                                        format!("`{k}` is required"),
                                    )
                                })
                        };
                        let call = ToolCall {
                            id: s("call_id")?,
                            name: s("name")?,
                            arguments: s("arguments")?,
                        };
                        // Consecutive calls belong to one assistant turn.
                        match messages.last_mut() {
                            Some(m) if m.role == Role::Assistant && m.tool_call_id.is_none() => {
                                m.tool_calls.push(call)
                            }
                            _ => {
                                let mut m = Message::new(Role::Assistant, "");
                                m.tool_calls.push(call);
                                messages.push(m);
                            }
                        }
                    }
                    "function_call_output" => {
                        let mut m = Message::new(
                            Role::Tool,
                            match item.get("output") {
                                Some(Value::String(s)) => s.clone(),
                                Some(other) => other.to_string(),
                                None => {
                                    return Err(ApiError::bad(
                                        &format!("{field}.output"),
                                        "`output` is required",
                                    ));
                                }
                            },
                        );
                        m.tool_call_id = item
                            .get("call_id")
                            .and_then(Value::as_str)
                            .map(str::to_string);
                        messages.push(m);
                    }
                    other => {
                        return Err(ApiError::bad(
                            &format!("{field}.type"),
                            format!(
                                "input item type `{other}` is not supported (message, function_call, function_call_output)"
                            ),
                        ));
                    }
                }
            }
        }
    }
    if messages.iter().all(|m| m.role == Role::System) {
        return Err(ApiError::bad(
            "input",
            "input must hold at least one message",
        ));
    }
    let mut tools = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        let field = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad(
                &format!("{field}.type"),
                "only `function` tools are supported",
            ));
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad(&format!("{field}.name"), "`name` is required"))?;
        tools.push(Tool {
            name: name.to_string(),
            description: t
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            parameters: t
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            strict: t.get("strict").and_then(Value::as_bool).unwrap_or(true),
        });
    }
    Ok(Conversation {
        messages,
        tools,
        tool_choice: tool_choice(&req.tool_choice, "tool_choice")?,
        reasoning_effort: None,
        images: Vec::new(),
    })
}

/// The parts of the response object every event repeats.
struct Shell {
    id: String,
    created: u64,
    model: String,
    max_output_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
}

impl Shell {
    fn response(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: Value) -> Value {
        json!({"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": output, "usage": usage, "error": null,
               "incomplete_details": incomplete, "instructions": null,
               "max_output_tokens": self.max_output_tokens, "temperature": self.temperature,
               "top_p": self.top_p, "parallel_tool_calls": true, "tool_choice": "auto",
               "tools": [], "text": {"format": {"type": "text"}}})
    }
}

fn usage(num_input_tokens: usize, num_output_tokens: usize) -> Value {
    json!({"input_tokens": num_input_tokens, "output_tokens": num_output_tokens,
           "total_tokens": num_input_tokens + num_output_tokens,
           "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}})
}

fn status_of(finish: Option<FinishReason>) -> (&'static str, Value) {
    match finish {
        Some(FinishReason::Length) | Some(FinishReason::Preempted) => {
            ("incomplete", json!({"reason": "max_output_tokens"}))
        }
        _ => ("completed", Value::Null),
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

pub async fn create(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = create_inner(&st, body).await;
    respond(&st, "responses", Flavor::OpenAi, result).await
}

async fn create_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let body: Value = parse_body(&read_body(st, body).await?)?;
    let mut passes = Passes::new(&body);
    let req: ResponsesRequest = passes.pass()?;
    passes.finish(&[])?;
    check_chat_extras(&req.user, req.parallel_tool_calls)?;
    check_model(st, &req.model)?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::bad(
            "previous_response_id",
            "this server stores no responses: send the whole conversation as `input`",
        ));
    }
    if req.store == Some(true) {
        return Err(ApiError::bad(
            "store",
            "this server stores no responses: set `store` to false",
        ));
    }
    st.engine()?;
    let conv = conversation(&req)?;
    let grammar = match req.text.as_ref().and_then(|t| t.get("format")) {
        Some(f) => response_format(f, "text.format")?,
        None => None,
    };
    let sampling = Sampling {
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        max_tokens: req.max_output_tokens,
        num_top_logprobs: req.top_logprobs.unwrap_or(0),
        grammar,
        ..Default::default()
    };
    let Submitted {
        stream,
        spec,
        num_prompt_tokens: num_input_tokens,
    } = submit(st, &conv, sampling).await?;
    let request_id = stream.request_id();
    let shell = Shell {
        id: format!("resp_{request_id:x}"),
        created: now_secs(),
        model: st.opts.served_model_name.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
    };
    let msg_id = format!("msg_{request_id:x}");
    let want_logprobs = req.top_logprobs.is_some();
    if !req.stream {
        let engine = st.engine()?.clone();
        return Ok(json_when_done(
            async move {
                let outputs = stream.collect_ok().await?;
                let o = outputs.first().cloned().unwrap_or_default();
                let r = Reply::parse(&o, spec);
                let mut output = Vec::new();
                if !r.reasoning.is_empty() {
                    output.push(reasoning_item(&format!("rs_{request_id:x}"), &r.reasoning));
                }
                let (status, incomplete) = status_of(r.finish);
                if !r.text.is_empty() || r.calls.is_empty() {
                    // A message cut by max_output_tokens is incomplete, as its response is.
                    let mut item = message_item(&msg_id, &r.text, status);
                    if want_logprobs {
                        item["content"][0]["logprobs"] =
                            chat_logprobs(&o, engine.text())["content"].take();
                    }
                    output.push(item);
                }
                for (k, c) in r.calls.iter().enumerate() {
                    let cid = call_id("call_", request_id, 0, k);
                    output.push(call_item(
                        &format!("fc_{cid}"),
                        &cid,
                        &c.name,
                        &c.arguments,
                        "completed",
                    ));
                }
                Ok(shell.response(
                    status,
                    output,
                    usage(num_input_tokens, o.token_ids.len()),
                    incomplete,
                ))
            },
            Flavor::OpenAi,
        ));
    }
    let mut seq = 0u64;
    let mut ev = move |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        seq += 1;
        SseEvent::named(kind, data)
    };
    let mut parsers = ChoiceStreams::new(spec);
    let mut items: Vec<Value> = Vec::new();
    // Index into `items` of the open message or call, and its text so far.
    let mut open: Option<(usize, String)> = None;
    let mut num_output_tokens = 0usize;
    let mut first = true;
    let engine = st.engine()?.clone();
    let encode = move |o: &RequestOutput| {
        let mut events = Vec::new();
        // This output's tokens' logprobs ride on its first text delta.
        let mut logprobs = if want_logprobs && !o.token_ids.is_empty() {
            chat_logprobs(o, engine.text())["content"].take()
        } else {
            json!([])
        };
        if first {
            first = false;
            let r = shell.response("in_progress", vec![], Value::Null, Value::Null);
            events.push(ev("response.created", json!({"response": r})));
            events.push(ev("response.in_progress", json!({"response": r})));
        }
        num_output_tokens += o.token_ids.len();
        if let Some(err) = &o.error {
            let r = shell.response("failed", items.clone(), Value::Null, Value::Null);
            let mut r = r;
            r["error"] = json!({"code": "server_error", "message": err});
            events.push(ev("response.failed", json!({"response": r})));
            return events;
        }
        let close = |open: &mut Option<(usize, String)>,
                     items: &mut Vec<Value>,
                     events: &mut Vec<SseEvent>,
                     ev: &mut dyn FnMut(&str, Value) -> SseEvent,
                     status: &str| {
            let Some((i, acc)) = open.take() else { return };
            let item = &mut items[i];
            if item["type"] == "message" {
                let id = item["id"].clone();
                events.push(ev("response.output_text.done", json!({"item_id": id, "output_index": i, "content_index": 0, "text": acc, "logprobs": []})));
                let part =
                    json!({"type": "output_text", "text": acc, "annotations": [], "logprobs": []});
                events.push(ev(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
                ));
                item["content"][0]["text"] = json!(acc);
            } else {
                let id = item["id"].clone();
                events.push(ev("response.function_call_arguments.done", json!({"item_id": id, "output_index": i, "arguments": acc, "name": item["name"]})));
                item["arguments"] = json!(acc);
            }
            item["status"] = json!(status);
            events.push(ev(
                "response.output_item.done",
                json!({"output_index": i, "item": item.clone()}),
            ));
        };
        for e in parsers.feed(o) {
            match e {
                OutputEvent::Reasoning(t) => {
                    close(&mut open, &mut items, &mut events, &mut ev, "completed");
                    let i = items.len();
                    let item = reasoning_item(&format!("rs_{request_id:x}{i}"), &t);
                    events.push(ev(
                        "response.output_item.added",
                        json!({"output_index": i, "item": item}),
                    ));
                    events.push(ev(
                        "response.output_item.done",
                        json!({"output_index": i, "item": item}),
                    ));
                    items.push(item);
                }
                OutputEvent::Text(t) => {
                    if !matches!(&open, Some((i, _)) if items[*i]["type"] == "message") {
                        close(&mut open, &mut items, &mut events, &mut ev, "completed");
                        let i = items.len();
                        let item = message_item(&format!("{msg_id}{i}"), "", "in_progress");
                        events.push(ev(
                            "response.output_item.added",
                            json!({"output_index": i, "item": item}),
                        ));
                        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                        events.push(ev("response.content_part.added", json!({"item_id": item["id"], "output_index": i, "content_index": 0, "part": part})));
                        items.push(item);
                        open = Some((i, String::new()));
                    }
                    if let Some((i, acc)) = open.as_mut() {
                        acc.push_str(&t);
                        let lp = std::mem::replace(&mut logprobs, json!([]));
                        events.push(ev("response.output_text.delta", json!({"item_id": items[*i]["id"], "output_index": *i, "content_index": 0, "delta": t, "logprobs": lp})));
                    }
                }
                OutputEvent::CallStart { index, name } => {
                    close(&mut open, &mut items, &mut events, &mut ev, "completed");
                    let i = items.len();
                    let cid = call_id("call_", request_id, 0, index);
                    let item = call_item(&format!("fc_{cid}"), &cid, &name, "", "in_progress");
                    events.push(ev(
                        "response.output_item.added",
                        json!({"output_index": i, "item": item}),
                    ));
                    items.push(item);
                    open = Some((i, String::new()));
                }
                OutputEvent::CallArgs { delta, .. } => {
                    if let Some((i, acc)) = open.as_mut() {
                        acc.push_str(&delta);
                        events.push(ev(
                            "response.function_call_arguments.delta",
                            json!({"item_id": items[*i]["id"], "output_index": *i, "delta": delta}),
                        ));
                    }
                }
                OutputEvent::CallEnd { .. } => {
                    close(&mut open, &mut items, &mut events, &mut ev, "completed")
                }
            }
        }
        if o.finish_reason.is_some() {
            // The item open when the reply was cut is as incomplete as the response.
            let (status, _) = status_of(o.finish_reason);
            close(&mut open, &mut items, &mut events, &mut ev, status);
            if items.is_empty() {
                let item = message_item(&format!("{msg_id}0"), "", "completed");
                events.push(ev(
                    "response.output_item.added",
                    json!({"output_index": 0, "item": item}),
                ));
                events.push(ev(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ));
                items.push(item);
            }
            let (status, incomplete) = status_of(o.finish_reason);
            let kind = if status == "completed" {
                "response.completed"
            } else {
                "response.incomplete"
            };
            let r = shell.response(
                status,
                items.clone(),
                usage(num_input_tokens, num_output_tokens),
                incomplete,
            );
            events.push(ev(kind, json!({"response": r})));
        }
        events
    };
    Ok(sse(stream, encode, Vec::new, false))
}
