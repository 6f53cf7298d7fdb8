//! What every API codec shares: the error every client mistake becomes, body parsing that
//! names the offending field, and the mapping of sampling fields to an engine request.

use serde::Deserialize;
use serde_json::{Value, json};

use super::call_syntax::CallSyntax;
use super::conversation::{Conversation, ToolChoice};
use super::output_parser::ParseSpec;
use crate::engine::EngineRequest;
use crate::model::ModelText;
use crate::sampling::SamplingParams;
use crate::structured::GrammarSpec;
use crate::sync::Shared;

/// Whose error JSON a failure is answered with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

/// A failed request: a 4xx for client mistakes, 503 when the engine cannot serve.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
}

impl From<super::images::ImageRefusal> for ApiError {
    fn from(r: super::images::ImageRefusal) -> ApiError {
        ApiError::bad(&r.field, r.message)
    }
}

impl ApiError {
    /// A 400 about `param`; the message names it (some SDKs show only the message).
    pub fn bad(param: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        let message = if message.contains(param) {
            message
        } else {
            format!("`{param}`: {message}")
        };
        ApiError {
            status: 400,
            message,
            param: Some(param.to_string()),
        }
    }

    pub fn status(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    pub fn body(&self, flavor: Flavor) -> Value {
        match flavor {
            Flavor::OpenAi => {
                let (kind, code) = match self.status {
                    400 | 413 | 421 | 422 => ("invalid_request_error", None),
                    401 => ("invalid_request_error", Some("invalid_api_key")),
                    403 => ("permission_error", None),
                    404 => ("not_found_error", None),
                    408 | 504 => ("timeout_error", Some("timeout")),
                    429 => ("rate_limit_error", Some("rate_limit_exceeded")),
                    _ => ("server_error", None),
                };
                json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": code}})
            }
            Flavor::Anthropic => {
                let kind = match self.status {
                    400 | 421 | 422 => "invalid_request_error",
                    401 => "authentication_error",
                    403 => "permission_error",
                    404 => "not_found_error",
                    429 => "rate_limit_error",
                    408 | 504 => "timeout_error",
                    413 => "request_too_large",
                    503 | 529 => "overloaded_error",
                    _ => "api_error",
                };
                json!({"type": "error", "error": {"type": kind, "message": self.message}})
            }
        }
    }
}

/// Parses a body; errors name the field (`temperature: invalid type ...`).
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(field_error)
}

/// Deserializes `T` from an already parsed body, errors naming the field.
pub fn parse_value<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(field_error)
}

fn field_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> ApiError {
    let path = e.path().to_string();
    let inner = json_terms(&e.into_inner().to_string());
    if path == "." || path.is_empty() {
        ApiError::bad("body", format!("invalid request body: {inner}"))
    } else {
        ApiError::bad(&path, format!("`{path}`: {inner}"))
    }
}

/// serde's message with the Rust types it names (`expected usize`) in JSON's terms, which
/// are the ones a client wrote its request in.
pub fn json_terms(message: &str) -> String {
    const TERMS: [(&str, &str); 10] = [
        ("usize", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("u16", "a non-negative integer"),
        ("u8", "a non-negative integer"),
        ("i64", "an integer"),
        ("i32", "an integer"),
        ("f32", "a number"),
        ("f64", "a number"),
        ("a boolean", "true or false"),
    ];
    let mut out = message.to_string();
    for (rust, json) in TERMS {
        let from = format!("expected {rust}");
        let mut at = 0;
        while let Some(found) = out[at..].find(&from).map(|p| p + at) {
            let end = found + from.len();
            let whole = out[end..]
                .chars()
                .next()
                .is_none_or(|c| !c.is_ascii_alphanumeric());
            if whole {
                out.replace_range(found..end, &format!("expected {json}"));
            }
            at = found + 1;
        }
    }
    out
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// Sampling as each API spells it, normalised by its codec.
#[derive(Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub n: Option<usize>,
    pub stop: Vec<String>,
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    pub max_tokens: Option<usize>,
    pub min_tokens: Option<usize>,
    pub ignore_eos: Option<bool>,
    pub num_top_logprobs: usize,
    pub grammar: Option<GrammarSpec>,
    /// vLLM's `skip_special_tokens`: control tokens left out of the reply's text.
    pub skip_special_tokens: Option<bool>,
}

/// The engine request for a prompt, checked against the model's limits.
pub fn engine_request(
    s: &Sampling,
    prompt_ids: Vec<u32>,
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
    let max_tokens = s.max_tokens.unwrap_or(ctx - prompt_ids.len());
    if max_tokens == 0 {
        return Err(ApiError::bad("max_tokens", "max_tokens must be at least 1"));
    }
    if prompt_ids.len() + max_tokens > ctx {
        return Err(ApiError::bad(
            "max_tokens",
            format!(
                "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds the context of {ctx} tokens",
                prompt_ids.len()
            ),
        ));
    }
    let top_k = match s.top_k {
        None | Some(0) | Some(-1) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let logit_bias = s
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
        temperature: s.temperature.unwrap_or(1.0),
        top_p: s.top_p.unwrap_or(1.0),
        top_k,
        min_p: s.min_p.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        logit_bias,
        num_top_logprobs: s.num_top_logprobs,
        ..Default::default()
    };
    // The parameters' ranges, `n` and the prompt's ids are checked once, by the engine
    // (`EngineRequest::validate`); its typed error names the field (`engine_error`).
    let n = s.n.unwrap_or(1);
    let mut r = EngineRequest::new(prompt_ids, max_tokens, params);
    r.seed = s.seed;
    r.n = n;
    r.min_tokens = s.min_tokens.unwrap_or(0);
    r.ignore_eos = s.ignore_eos.unwrap_or(false);
    r.stop = s.stop.clone();
    r.grammar = s.grammar.clone();
    r.skip_special_tokens = s.skip_special_tokens;
    Ok(r)
}

/// Runs CPU work of a request (rendering its template, tokenizing, checking a grammar) on
/// a blocking thread, so the async workers go on serving others meanwhile; a panic in it
/// becomes a 400 about `field` for this request alone.
pub async fn off_worker<T: Send + 'static>(
    field: &'static str,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(move || crate::structured::unless_panic(work)).await {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => Err(ApiError::bad(
            field,
            format!("this request could not be processed: {panic}"),
        )),
        Err(e) => Err(ApiError::status(
            500,
            format!("a request task was lost: {e}"),
        )),
    }
}

/// A conversation's engine request: template, guard, tool grammar, limits; rendered off
/// the async worker.
pub async fn conversation_request(
    conv: &Conversation,
    s: Sampling,
    text: Shared<ModelText>,
) -> Result<EngineRequest, ApiError> {
    let conv = conv.clone();
    off_worker("messages", move || render_request(&conv, s, &text)).await
}

fn render_request(
    conv: &Conversation,
    mut s: Sampling,
    text: &ModelText,
) -> Result<EngineRequest, ApiError> {
    conv.validate()
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let syntax = CallSyntax::of(text);
    if conv.uses_tools() && syntax.needs_special_tokens() {
        // Its calls open with a control token, which the reply's text must keep to be read.
        s.skip_special_tokens.get_or_insert(false);
    }
    if let Some(g) = conv.tool_grammar(&syntax) {
        if s.grammar.is_some() {
            return Err(ApiError::bad(
                "tool_choice",
                "a forced tool choice and a response format cannot both constrain the reply",
            ));
        }
        s.grammar = Some(g);
    }
    let prompt_ids = conv
        .to_prompt_ids(text)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let (prompt_ids, images) = super::images::expand(conv, text, prompt_ids)?;
    let mut request = engine_request(&s, prompt_ids, text)?;
    request.images = images;
    Ok(request)
}

/// Text content given as a string or as typed parts; only text parts are served.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

impl Content {
    /// The text of the parts whose `type` is one of `text_types`.
    pub fn text(&self, field: &str, text_types: &[&str]) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                    (Some(ty), Some(t)) if text_types.contains(&ty) => Ok(t.to_string()),
                    (ty, _) => Err(ApiError::bad(
                        field,
                        format!(
                            "content part type {} is not supported (only {})",
                            ty.map_or("(missing)".to_string(), |t| format!("`{t}`")),
                            text_types.join(", ")
                        ),
                    )),
                })
                .collect(),
        }
    }
}

/// How replies to `conv` are read: DeepSeek-V4's DSML calls (and reasoning from the start
/// in thinking mode), or `<tool_call>` JSON and `<think>` blocks where the template has them.
pub fn parse_spec(text: &ModelText, conv: &Conversation) -> ParseSpec {
    let forced = matches!(
        conv.tool_choice,
        ToolChoice::Required | ToolChoice::Named(_)
    );
    let syntax = CallSyntax::of(text);
    if text.deepseek_v4.is_some() {
        let thinking = conv.reasoning_effort.is_some();
        return syntax.parse_spec(conv.uses_tools(), true, thinking, forced);
    }
    syntax.parse_spec(conv.uses_tools(), parses_reasoning(text), false, forced)
}

/// Whether the model's template thinks in `<think>` blocks.
fn parses_reasoning(text: &ModelText) -> bool {
    text.tokenizer
        .as_ref()
        .is_some_and(|t| t.token_to_id("<think>").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_request_work_is_a_400_naming_the_field() {
        let r: Result<(), ApiError> = off_worker("messages", || panic!("template blew up")).await;
        let e = r.unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("template blew up"), "{}", e.message);
        assert!(e.message.contains("messages"), "{}", e.message);
        let ok = off_worker("messages", || Ok(7)).await;
        assert_eq!(ok.unwrap(), 7);
    }

    /// A body with a value of the wrong JSON type is named in JSON's terms, never Rust's.
    #[test]
    fn type_errors_speak_json_not_rust() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Body {
            n: Option<usize>,
            t: Option<f32>,
            s: Option<bool>,
            seed: Option<u64>,
        }
        for (body, want) in [
            (r#"{"n": -1}"#, "expected a non-negative integer"),
            (r#"{"n": "3"}"#, "expected a non-negative integer"),
            (r#"{"t": "hot"}"#, "expected a number"),
            (r#"{"s": 1}"#, "expected true or false"),
            (r#"{"seed": 1.5}"#, "expected a non-negative integer"),
        ] {
            let e = parse_body::<Body>(body.as_bytes()).unwrap_err();
            assert!(e.message.contains(want), "{body}: {}", e.message);
            for rust in ["usize", "u64", "f32", "a boolean"] {
                assert!(!e.message.contains(rust), "{body}: {}", e.message);
            }
        }
        assert_eq!(json_terms("expected u8x or u8"), "expected u8x or u8");
        assert_eq!(
            json_terms("expected u8, got -1"),
            "expected a non-negative integer, got -1"
        );
    }
}
