//! The OpenAI codec: Chat Completions and Completions requests into engine requests,
//! engine outputs into OpenAI's response and SSE chunk objects.

use serde::Deserialize;
use serde_json::{Value, json};

use super::conversation::Conversation;
use crate::engine::{EngineRequest, FinishReason, MAX_CHOICES, RequestOutput};
use crate::model::ModelText;
use crate::model::chat_template::ChatMessage;
use crate::sampling::SamplingParams;

/// A client mistake, answered with 400 and OpenAI's error object.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            param: Some(param),
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": null}})
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub struct WireMessage {
    pub role: String,
    pub content: Option<Content>,
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
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptField,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<usize>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

fn content_text(c: &Option<Content>) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::bad(
                    "messages",
                    "only text content parts are supported",
                )),
            })
            .collect(),
    }
}

/// The engine request for `fields`, with `prompt_ids` and the logprob count given.
pub fn engine_request(
    fields: &SamplingFields,
    prompt_ids: Vec<u32>,
    num_top_logprobs: usize,
    text: &ModelText,
) -> Result<EngineRequest, ApiError> {
    let ctx = text.config.max_context_tokens;
    if prompt_ids.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if prompt_ids.len() >= ctx {
        return Err(ApiError::bad(
            "messages",
            format!(
                "the prompt has {} tokens; the context is {ctx}",
                prompt_ids.len()
            ),
        ));
    }
    let max_tokens = fields
        .max_completion_tokens
        .or(fields.max_tokens)
        .unwrap_or(ctx - prompt_ids.len());
    if prompt_ids.len() + max_tokens > ctx {
        return Err(ApiError::bad(
            "max_tokens",
            format!(
                "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds the context of {ctx} tokens",
                prompt_ids.len()
            ),
        ));
    }
    let top_k = match fields.top_k {
        None | Some(0) | Some(-1) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let logit_bias = fields
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, &v)| {
            k.parse::<u32>()
                .map(|id| (id, v))
                .map_err(|_| ApiError::bad("logit_bias", format!("`{k}` is not a token id")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let params = SamplingParams {
        temperature: fields.temperature.unwrap_or(1.0),
        top_p: fields.top_p.unwrap_or(1.0),
        top_k,
        min_p: fields.min_p.unwrap_or(0.0),
        frequency_penalty: fields.frequency_penalty.unwrap_or(0.0),
        presence_penalty: fields.presence_penalty.unwrap_or(0.0),
        repetition_penalty: fields.repetition_penalty.unwrap_or(1.0),
        logit_bias,
        num_top_logprobs,
        ..Default::default()
    };
    params
        .validate()
        .map_err(|e| ApiError::bad("sampling", e.to_string()))?;
    params
        .validate_for_vocab(text.config.vocab_size)
        .map_err(|e| ApiError::bad("logit_bias", e.to_string()))?;
    let n = fields.n.unwrap_or(1);
    if n == 0 || n > MAX_CHOICES {
        return Err(ApiError::bad(
            "n",
            format!("n must be in 1..={MAX_CHOICES}, got {n}"),
        ));
    }
    let mut r = EngineRequest::new(prompt_ids, max_tokens, params);
    r.seed = fields.seed;
    r.n = n;
    r.min_tokens = fields.min_tokens.unwrap_or(0);
    r.ignore_eos = fields.ignore_eos.unwrap_or(false);
    r.stop = match &fields.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    Ok(r)
}

pub fn chat_to_engine(req: &ChatRequest, text: &ModelText) -> Result<EngineRequest, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !["system", "user", "assistant", "developer", "tool"].contains(&m.role.as_str()) {
            return Err(ApiError::bad(
                "messages",
                format!("unknown role `{}`", m.role),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        messages.push(ChatMessage::new(role, &content_text(&m.content)?));
    }
    let prompt_ids = Conversation { messages }
        .to_prompt_ids(text)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let num_top = if req.logprobs.unwrap_or(false) {
        req.top_logprobs.unwrap_or(0)
    } else {
        0
    };
    engine_request(&req.sampling, prompt_ids, num_top, text)
}

pub fn completion_to_engine(
    req: &CompletionRequest,
    text: &ModelText,
) -> Result<EngineRequest, ApiError> {
    let prompt_ids = match &req.prompt {
        PromptField::Ids(ids) => {
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= text.config.vocab_size) {
                return Err(ApiError::bad(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary ({})",
                        text.config.vocab_size
                    ),
                ));
            }
            ids.clone()
        }
        PromptField::Text(t) => {
            let tok = text.tokenizer.as_ref().ok_or_else(|| {
                ApiError::bad("prompt", "this model has no tokenizer: send token ids")
            })?;
            tok.encode_prompt(t)
                .map_err(|e| ApiError::bad("prompt", e.to_string()))?
        }
    };
    engine_request(&req.sampling, prompt_ids, req.logprobs.unwrap_or(0), text)
}

pub fn finish_reason(r: Option<FinishReason>) -> Value {
    match r {
        Some(FinishReason::Stop) => json!("stop"),
        Some(FinishReason::Length) | Some(FinishReason::Preempted) => json!("length"),
        Some(FinishReason::Abort) => json!("abort"),
        None => Value::Null,
    }
}

pub fn chat_logprobs(o: &RequestOutput, text: &ModelText) -> Value {
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
