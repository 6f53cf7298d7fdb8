//! vLLM's `/tokenize`, `/detokenize` and `/version`: a prompt (text, or chat messages
//! through the model's template, exactly as `/v1/chat/completions` renders them) into
//! token ids, ids back into text.

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{self, ApiError, Flavor, parse_body, parse_value};
use super::http::{ServerState, check_model, read_body, respond};
use super::openai::{ChatRequest, chat_conversation};

/// The fields `/tokenize` reads; the chat form also takes what a chat request's
/// conversation has (`tools`, `tool_choice`, `reasoning_effort`).
const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "parse_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "tools",
    "tool_choice",
    "reasoning_effort",
];

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    add_special_tokens: Option<bool>,
    /// As on `/v1/completions`: control-token strings in `prompt` read as those tokens
    /// only when asked (default: as text, which is what a completion would be fed).
    #[serde(default)]
    parse_special_tokens: bool,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

fn refuse_unknown(body: &Value, known: &[&str], route: &str) -> Result<(), ApiError> {
    let Some(map) = body.as_object() else {
        return Err(ApiError::bad(
            "body",
            "the request body must be a JSON object",
        ));
    };
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::bad(k, format!("`{k}` is not a field of {route}"))),
        None => Ok(()),
    }
}

pub async fn tokenize(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = tokenize_inner(&st, body).await;
    respond(&st, "tokenize", Flavor::OpenAi, result).await
}

async fn tokenize_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let body: Value = parse_body(&read_body(st, body).await?)?;
    refuse_unknown(&body, TOKENIZE_FIELDS, "/tokenize")?;
    let req: TokenizeRequest = parse_value(&body)?;
    check_model(st, &req.model)?;
    let engine = st.engine()?;
    let text = engine.text_shared();
    let tok = text
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad("prompt", "this model has no tokenizer"))?;
    let ids = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => {
            let add = req.add_special_tokens.unwrap_or(true);
            let (prompt, parse) = (prompt.clone(), req.parse_special_tokens);
            api::off_worker("prompt", move || {
                tok.encode_request_prompt(&prompt, parse, add)
                    .map_err(|e| ApiError::bad("prompt", e.to_string()))
            })
            .await?
        }
        (None, Some(_)) => {
            if req.add_generation_prompt == Some(false) {
                return Err(ApiError::bad(
                    "add_generation_prompt",
                    "only `true` is supported: the prompt ends where the assistant's reply begins",
                ));
            }
            if req.add_special_tokens == Some(true) {
                return Err(ApiError::bad(
                    "add_special_tokens",
                    "the chat template places the special tokens; `true` would add a second BOS",
                ));
            }
            let chat: ChatRequest = parse_value(&body)?;
            let conv = chat_conversation(&chat)?;
            api::off_worker("messages", move || {
                conv.validate()
                    .map_err(|e| ApiError::bad("messages", e.to_string()))?;
                let ids = conv
                    .to_prompt_ids(&text)
                    .map_err(|e| ApiError::bad("messages", e.to_string()))?;
                // Each image counted as the tokens it takes.
                Ok(super::images::expand(&conv, &text, ids)?.0)
            })
            .await?
        }
        _ => {
            return Err(ApiError::bad(
                "prompt",
                "give exactly one of `prompt` and `messages`",
            ));
        }
    };
    let token_strs = req.return_token_strs.then(|| {
        let tok = engine.text().tokenizer.as_ref().expect("checked above");
        ids.iter()
            .map(|&id| tok.id_to_token(id).unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(HttpResponse::Ok().json(json!({
        "count": ids.len(),
        "max_model_len": engine.text().config.max_context_tokens,
        "tokens": ids,
        "token_strs": token_strs,
    })))
}

pub async fn detokenize(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = detokenize_inner(&st, body).await;
    respond(&st, "detokenize", Flavor::OpenAi, result).await
}

async fn detokenize_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let req: DetokenizeRequest = parse_body(&read_body(st, body).await?)?;
    check_model(st, &req.model)?;
    let engine = st.engine()?;
    let vocab_size = engine.text().config.vocab_size;
    if let Some((i, id)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab_size)
    {
        return Err(ApiError::bad(
            &format!("tokens[{i}]"),
            format!("token id {id} is outside the vocabulary (size {vocab_size})"),
        ));
    }
    let tok = engine
        .text()
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad("tokens", "this model has no tokenizer"))?;
    let prompt = api::off_worker("tokens", move || {
        tok.decode(&req.tokens, false)
            .map_err(|e| ApiError::bad("tokens", e.to_string()))
    })
    .await?;
    Ok(HttpResponse::Ok().json(json!({ "prompt": prompt })))
}

/// vLLM's `/tokenizer_info`: what a client needs to tokenize and render chats as the
/// server does (lm-evaluation-harness's remote tokenizer reads it).
pub async fn tokenizer_info(st: web::Data<ServerState>) -> HttpResponse {
    let result = async {
        let text = st.engine()?.text();
        if text.tokenizer.is_none() {
            return Err(ApiError::status(404, "this model has no tokenizer"));
        }
        let template = text.chat_template.as_ref();
        let (bos, eos) = match template {
            Some(t) => (Some(t.bos_token()), Some(t.eos_token())),
            None => (None, None),
        };
        let tok = text.tokenizer.as_ref().expect("checked");
        let name = |id: Option<&u32>| id.and_then(|&id| tok.decode(&[id], false).ok());
        let eos = eos
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .or_else(|| name(text.stop_ids.first()));
        Ok(HttpResponse::Ok().json(json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos.filter(|b| !b.is_empty()),
            "eos_token": eos,
            "pad_token": Value::Null,
            "chat_template": template.map(|t| t.source()),
            "model_max_length": text.config.max_context_tokens,
            "vocab_size": text.config.vocab_size,
        })))
    }
    .await;
    respond(&st, "tokenizer_info", Flavor::OpenAi, result).await
}

pub async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}
