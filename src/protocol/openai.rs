//! The OpenAI codec for Chat Completions: requests into a conversation plus sampling,
//! engine outputs into OpenAI's objects and chunks (legacy Completions: `completions.rs`).

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{ApiError, Content, Flavor, Sampling, StopField, parse_body};
use super::conversation::{Conversation, Message, Role, Tool, ToolCall, ToolChoice};
use super::fields::Passes;
use super::http::{
    ServerState, SseEvent, Submitted, check_model, json_when_done, now_secs, read_body, respond,
    sse, submit,
};
use super::output_parser::OutputEvent;
use super::reply::{ChoiceStreams, Reply, call_id};
use crate::engine::{FinishReason, RequestOutput};
use crate::model::ModelText;
use crate::structured::GrammarSpec;

#[derive(Debug, Deserialize)]
pub struct WireFunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
pub struct WireToolCall {
    #[serde(default)]
    pub id: String,
    /// `function`, the only kind (clients send it back with the call).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: WireFunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct WireMessage {
    pub role: String,
    pub content: Option<Content>,
    pub tool_calls: Option<Vec<WireToolCall>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct WireFunction {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct WireTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: WireFunction,
}

/// Fields both OpenAI endpoints share.
#[derive(Debug, Deserialize, Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub n: Option<usize>,
    pub stop: Option<StopField>,
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub min_tokens: Option<usize>,
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: `{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}` or
    /// `{"grammar": lark}`.
    pub structured_outputs: Option<Value>,
    /// vLLM's older spellings of the same, still sent by many clients.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

impl SamplingFields {
    pub(super) fn sampling(&self) -> Result<Sampling, ApiError> {
        Ok(Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            n: self.n,
            stop: match &self.stop {
                None => Vec::new(),
                Some(StopField::One(s)) => vec![s.clone()],
                Some(StopField::Many(v)) => v.clone(),
            },
            logit_bias: self.logit_bias.clone(),
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            min_tokens: self.min_tokens,
            ignore_eos: self.ignore_eos,
            num_top_logprobs: 0,
            grammar: self.grammar()?,
            skip_special_tokens: None,
        })
    }
}

impl SamplingFields {
    /// The one grammar `structured_outputs` or a `guided_*` field asks for.
    fn grammar(&self) -> Result<Option<GrammarSpec>, ApiError> {
        let guided = [
            (
                "guided_json",
                self.guided_json.as_ref().map(|v| json!({"json": v})),
            ),
            (
                "guided_regex",
                self.guided_regex.as_ref().map(|v| json!({"regex": v})),
            ),
            (
                "guided_choice",
                self.guided_choice.as_ref().map(|v| json!({"choice": v})),
            ),
            (
                "guided_grammar",
                self.guided_grammar.as_ref().map(|v| json!({"grammar": v})),
            ),
        ];
        let mut given = guided.into_iter().filter_map(|(f, v)| Some((f, v?)));
        let old = given.next();
        if let Some((second, _)) = given.next() {
            return Err(ApiError::bad(
                second,
                "give one structured-output field, not several",
            ));
        }
        match (&self.structured_outputs, old) {
            (None, None) => Ok(None),
            (Some(v), None) => structured_outputs(v, "structured_outputs").map(Some),
            (None, Some((field, v))) => structured_outputs(&v, field).map(Some),
            (Some(_), Some((field, _))) => Err(ApiError::bad(
                field,
                "give structured_outputs or a guided_* field, not both",
            )),
        }
    }
}

fn structured_outputs(v: &Value, field: &str) -> Result<GrammarSpec, ApiError> {
    match (
        v.get("json"),
        v.get("regex"),
        v.get("choice"),
        v.get("grammar"),
    ) {
        (Some(schema), None, None, None) => Ok(GrammarSpec::JsonSchema(match schema {
            Value::String(s) => serde_json::from_str(s).map_err(|e| {
                ApiError::bad(field, format!("`{field}`: the schema is not JSON: {e}"))
            })?,
            other => other.clone(),
        })),
        (None, Some(Value::String(rx)), None, None) => Ok(GrammarSpec::Regex(rx.clone())),
        (None, None, Some(Value::Array(choices)), None) if !choices.is_empty() => {
            // vLLM's choice: the output is exactly one of the strings.
            let alternatives: Option<Vec<String>> = choices
                .iter()
                .map(|c| c.as_str().map(regex_syntax::escape))
                .collect();
            let alternatives = alternatives
                .ok_or_else(|| ApiError::bad(field, format!("`{field}`: choices are strings")))?;
            Ok(GrammarSpec::Regex(format!(
                "(?:{})",
                alternatives.join("|")
            )))
        }
        (None, None, None, Some(Value::String(g))) => Ok(GrammarSpec::Lark(g.clone())),
        _ => Err(ApiError::bad(
            field,
            format!(
                "`{field}`: give exactly one of `json` (a schema), `regex`, `choice` (a non-empty list of strings) or `grammar` (Lark)"
            ),
        )),
    }
}

/// `response_format` of Chat Completions (and, reshaped, of Responses' `text.format`).
pub fn response_format(v: &Value, field: &str) -> Result<Option<GrammarSpec>, ApiError> {
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            // Chat nests the schema under `json_schema`; Responses puts it beside `type`.
            let schema = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .or_else(|| v.get("schema"))
                .ok_or_else(|| ApiError::bad(field, "`json_schema` needs a `schema`"))?;
            Ok(Some(GrammarSpec::JsonSchema(schema.clone())))
        }
        other => Err(ApiError::bad(
            field,
            format!(
                "type {} is not supported (text, json_object, json_schema)",
                other.map_or("(missing)".into(), |t| format!("`{t}`"))
            ),
        )),
    }
}

pub fn tool_choice(v: &Option<Value>, field: &str) -> Result<ToolChoice, ApiError> {
    match v {
        None => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::bad(
                field,
                format!("`{other}` is not one of none, auto, required"),
            )),
        },
        Some(obj) => obj
            .get("function")
            .and_then(|f| f.get("name"))
            .or_else(|| obj.get("name"))
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_string()))
            .ok_or_else(|| ApiError::bad(field, "a named tool choice needs `function.name`")),
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<WireMessage>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub tools: Option<Vec<WireTool>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub reasoning_effort: Option<String>,
    /// The end user, for the server's log.
    pub user: Option<String>,
    /// Only `true` (the default): a reply may call several tools.
    pub parallel_tool_calls: Option<bool>,
    /// Read in a second pass over the same body, so errors keep the field's name.
    #[serde(skip)]
    pub sampling: SamplingFields,
}

/// Fields of an assistant message a client sends back as it received them; the model's
/// template decides what an earlier turn shows (none of them reaches a prompt).
pub const MESSAGE_ECHOES: &[&str] = &[
    "messages[].refusal",
    "messages[].annotations",
    "messages[].audio",
    "messages[].function_call",
    "messages[].reasoning_content",
    "messages[].reasoning",
];

/// Refuses what troupe cannot honour among the fields every OpenAI chat client may send,
/// and logs the end user a request names.
pub(super) fn check_chat_extras(
    user: &Option<String>,
    parallel_tool_calls: Option<bool>,
) -> Result<(), ApiError> {
    if parallel_tool_calls == Some(false) {
        return Err(ApiError::bad(
            "parallel_tool_calls",
            "a reply may call several tools here; `false` is not supported",
        ));
    }
    if let Some(user) = user {
        tracing::info!(user = %user, "request for an end user");
    }
    Ok(())
}

pub fn chat_conversation(req: &ChatRequest) -> Result<Conversation, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut images = Vec::new();
    for (i, m) in req.messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => {
                return Err(ApiError::bad(&field, format!("unknown role `{other}`")));
            }
        };
        let mut msg = Message::new(role, "");
        match &m.content {
            None => {}
            // A user's parts may hold images.
            Some(Content::Parts(parts)) if role == Role::User => {
                for (j, p) in parts.iter().enumerate() {
                    let pfield = format!("{field}.content[{j}]");
                    match (p["type"].as_str(), p["text"].as_str()) {
                        (Some("text"), Some(t)) => super::images::push_text(&mut msg, t),
                        (Some("image_url"), _) => {
                            let image = super::images::openai_image(p, &pfield)?;
                            super::images::push_image(&mut images, &mut msg, image);
                        }
                        (ty, _) => {
                            return Err(ApiError::bad(
                                &pfield,
                                format!(
                                    "content part type {ty:?} is not supported (text, image_url)"
                                ),
                            ));
                        }
                    }
                }
            }
            Some(c) => msg.content = c.text(&format!("{field}.content"), &["text"])?,
        }
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        for (k, c) in m.tool_calls.iter().flatten().enumerate() {
            if c.kind.as_deref().is_some_and(|t| t != "function") {
                return Err(ApiError::bad(
                    &format!("{field}.tool_calls[{k}].type"),
                    "only `function` calls are supported",
                ));
            }
            msg.tool_calls.push(ToolCall {
                id: c.id.clone(),
                name: c.function.name.clone(),
                arguments: c.function.arguments.clone(),
            });
        }
        messages.push(msg);
    }
    let mut tools = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::bad(
                &format!("tools[{i}].type"),
                format!("tool type `{}` is not supported (function)", t.kind),
            ));
        }
        tools.push(Tool {
            name: t.function.name.clone(),
            description: t.function.description.clone(),
            parameters: t
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            strict: t.function.strict.unwrap_or(false),
        });
    }
    Ok(Conversation {
        messages,
        tools,
        tool_choice: tool_choice(&req.tool_choice, "tool_choice")?,
        reasoning_effort: req.reasoning_effort.clone(),
        images,
    })
}

pub(super) fn finish_reason(r: Option<FinishReason>, num_calls: usize) -> Value {
    match r {
        Some(FinishReason::Stop) if num_calls > 0 => json!("tool_calls"),
        Some(FinishReason::Stop) => json!("stop"),
        Some(FinishReason::Length) | Some(FinishReason::Preempted) => json!("length"),
        Some(FinishReason::Abort) => json!("abort"),
        None => Value::Null,
    }
}

pub(super) fn chat_logprobs(o: &RequestOutput, text: &ModelText) -> Value {
    let Some(tok) = &text.tokenizer else {
        return Value::Null;
    };
    let piece = |id: u32| tok.decode(&[id], false).unwrap_or_default();
    let content: Vec<Value> = o
        .token_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let top: Vec<Value> = o
                .top_logprobs
                .get(i)
                .into_iter()
                .flatten()
                .map(|&(t, lp)| json!({"token": piece(t), "logprob": lp, "bytes": piece(t).into_bytes()}))
                .collect();
            json!({"token": piece(id), "logprob": o.token_logprobs.get(i).copied().unwrap_or(0.0), "bytes": piece(id).into_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({"content": content})
}

pub(super) fn usage(num_prompt_tokens: usize, num_completion_tokens: usize) -> Value {
    json!({"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
           "total_tokens": num_prompt_tokens + num_completion_tokens})
}

pub async fn chat_completions(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = chat_inner(&st, body).await;
    respond(&st, "chat_completions", Flavor::OpenAi, result).await
}

async fn chat_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let body: Value = parse_body(&read_body(st, body).await?)?;
    let mut passes = Passes::new(&body);
    let mut req: ChatRequest = passes.pass()?;
    req.sampling = passes.pass()?;
    passes.finish(MESSAGE_ECHOES)?;
    check_chat_extras(&req.user, req.parallel_tool_calls)?;
    check_model(st, &req.model)?;
    st.engine()?;
    let conv = chat_conversation(&req)?;
    let mut sampling = req.sampling.sampling()?;
    if let Some(f) = &req.response_format {
        let g = response_format(f, "response_format")?;
        if g.is_some() && sampling.grammar.is_some() {
            return Err(ApiError::bad(
                "response_format",
                "give response_format or structured_outputs, not both",
            ));
        }
        sampling.grammar = sampling.grammar.or(g);
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    if want_logprobs {
        sampling.num_top_logprobs = req.top_logprobs.unwrap_or(0);
    }
    let Submitted {
        stream,
        spec,
        num_prompt_tokens,
    } = submit(st, &conv, sampling).await?;
    let request_id = stream.request_id();
    let id = format!("chatcmpl-{request_id}");
    let (created, model) = (now_secs(), st.opts.served_model_name.clone());
    if !req.stream {
        let engine = st.engine()?.clone();
        return Ok(json_when_done(
            async move {
                let text = engine.text();
                let choices = stream.collect_ok().await?;
                let num_completion_tokens: usize = choices.iter().map(|c| c.token_ids.len()).sum();
                let choices: Vec<Value> = choices
            .iter()
            .map(|c| {
                let r = Reply::parse(c, spec);
                let calls: Vec<Value> = r.calls.iter().enumerate().map(|(k, call)| {
                    json!({"id": call_id("call_", request_id, c.index, k), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
                }).collect();
                let mut message = json!({"role": "assistant",
                    "content": if r.text.is_empty() && !calls.is_empty() { Value::Null } else { json!(r.text) }});
                if !calls.is_empty() {
                    message["tool_calls"] = json!(calls);
                }
                if !r.reasoning.is_empty() {
                    message["reasoning_content"] = json!(r.reasoning);
                }
                json!({"index": c.index, "message": message,
                       "logprobs": if want_logprobs { chat_logprobs(c, text) } else { Value::Null },
                       "finish_reason": finish_reason(r.finish, r.calls.len()),
                       "stop_reason": c.stop_string})
            })
            .collect();
                Ok(json!({
                    "id": id, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": usage(num_prompt_tokens, num_completion_tokens),
                }))
            },
            Flavor::OpenAi,
        ));
    }
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let mut parsers = ChoiceStreams::new(spec);
    let mut started = std::collections::HashSet::new();
    let counter = std::rc::Rc::new(std::cell::Cell::new(0usize));
    let counter_tail = counter.clone();
    let (id2, model2) = (id.clone(), model.clone());
    let engine = st.engine()?.clone();
    let encode = move |o: &RequestOutput| {
        let chunk = |delta: Value, finish: Value, logprobs: Value| {
            SseEvent::data(
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": o.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}]}),
            )
        };
        let mut events = Vec::new();
        if started.insert(o.index) {
            events.push(chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            ));
        }
        counter.set(counter.get() + o.token_ids.len());
        if let Some(err) = &o.error {
            events.push(SseEvent::data(
                json!({"error": {"message": err, "type": "server_error"}}),
            ));
            return events;
        }
        let mut logprobs = if want_logprobs && !o.token_ids.is_empty() {
            chat_logprobs(o, engine.text())
        } else {
            Value::Null
        };
        for e in parsers.feed(o) {
            let delta = match e {
                OutputEvent::Text(t) => json!({"content": t}),
                OutputEvent::Reasoning(t) => json!({"reasoning_content": t}),
                OutputEvent::CallStart { index, name } => json!({"tool_calls": [{"index": index,
                    "id": call_id("call_", o.request_id, o.index, index), "type": "function",
                    "function": {"name": name, "arguments": ""}}]}),
                OutputEvent::CallArgs { index, delta } => {
                    json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]})
                }
                OutputEvent::CallEnd { .. } => continue,
            };
            events.push(chunk(delta, Value::Null, std::mem::take(&mut logprobs)));
        }
        if !logprobs.is_null() {
            events.push(chunk(json!({"content": ""}), Value::Null, logprobs));
        }
        if o.finish_reason.is_some() {
            let reason = finish_reason(o.finish_reason, parsers.num_calls(o.index));
            let mut last = chunk(json!({}), reason, Value::Null);
            last.data["choices"][0]["stop_reason"] = json!(o.stop_string);
            events.push(last);
        }
        events
    };
    let tail = move || {
        if !include_usage {
            return Vec::new();
        }
        vec![SseEvent::data(
            json!({"id": id2, "object": "chat.completion.chunk",
            "created": created, "model": model2, "choices": [],
            "usage": usage(num_prompt_tokens, counter_tail.get())}),
        )]
    };
    Ok(sse(stream, encode, tail, true))
}
