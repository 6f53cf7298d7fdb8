//! `troupe serve`: the HTTP front end (actix-web). Handlers decode a request through its
//! API's codec, submit it to the engine, and encode the outputs — whole, or as SSE.
//! Dropping a response (client gone) drops its `RequestStream`, which aborts the request.

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{App, HttpResponse, HttpServer, web};
use bytes::Bytes;
use serde_json::{Value, json};

use super::openai::{self, ApiError, ChatRequest, CompletionRequest};
use crate::engine::{EngineError, EngineHandle, RequestOutput, RequestStream};

/// Request bodies above this are refused (413) before parsing.
const MAX_BODY_BYTES: usize = 4 << 20;

pub struct ServerState {
    pub engine: EngineHandle,
    pub model_name: String,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn error_response(e: &ApiError) -> HttpResponse {
    HttpResponse::build(actix_web::http::StatusCode::from_u16(e.status).expect("valid status"))
        .json(e.body())
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Rejected(m) => ApiError::bad("request", m),
        other => ApiError {
            status: 503,
            message: other.to_string(),
            param: None,
        },
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("invalid request body: {e}")))
}

fn check_model(st: &ServerState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &st.model_name => Err(ApiError {
            status: 404,
            message: format!(
                "model `{m}` does not exist; this server serves `{}`",
                st.model_name
            ),
            param: Some("model"),
        }),
        _ => Ok(()),
    }
}

/// Every completion, or the engine's error as a 503.
async fn collect_ok(stream: RequestStream) -> Result<Vec<RequestOutput>, ApiError> {
    let choices = stream.collect_choices().await;
    match choices.iter().find_map(|c| c.error.clone()) {
        Some(message) => Err(ApiError {
            status: 503,
            message,
            param: None,
        }),
        None => Ok(choices),
    }
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

async fn models(st: web::Data<ServerState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "troupe"}],
    }))
}

/// The SSE body: one `data:` event per JSON value, then `[DONE]`.
fn sse(
    stream: RequestStream,
    encode: impl FnMut(&RequestOutput) -> Vec<Value> + 'static,
    tail: impl FnOnce() -> Vec<Value> + 'static,
) -> HttpResponse {
    struct State<E, T> {
        stream: Option<RequestStream>,
        encode: E,
        tail: Option<T>,
    }
    let state = State {
        stream: Some(stream),
        encode,
        tail: Some(tail),
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        let events: Vec<Value> = match s.stream.as_mut() {
            Some(stream) => match stream.next().await {
                Some(out) => (s.encode)(&out),
                None => {
                    s.stream = None;
                    s.tail.take().map(|t| t()).unwrap_or_default()
                }
            },
            None => return None,
        };
        let mut text = String::new();
        for e in events {
            text.push_str(&format!("data: {e}\n\n"));
        }
        if s.stream.is_none() {
            text.push_str("data: [DONE]\n\n");
        }
        Some((Ok::<_, actix_web::Error>(Bytes::from(text)), s))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(body)
}

async fn chat_completions(st: web::Data<ServerState>, body: Bytes) -> HttpResponse {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn chat_inner(st: web::Data<ServerState>, body: Bytes) -> Result<HttpResponse, ApiError> {
    let req: ChatRequest = parse(&body)?;
    check_model(&st, &req.model)?;
    let text = st.engine.text();
    let engine_req = openai::chat_to_engine(&req, text)?;
    let num_prompt_tokens = engine_req.prompt_ids.len();
    let want_logprobs = req.logprobs.unwrap_or(false);
    let stream = st.engine.generate(engine_req).await.map_err(engine_error)?;
    let id = format!("chatcmpl-{}", stream.request_id);
    let (created, model) = (now_secs(), st.model_name.clone());
    if req.stream {
        let include_usage = req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let mut started = std::collections::HashSet::new();
        let mut num_completion_tokens = 0usize;
        let counter = std::rc::Rc::new(std::cell::Cell::new(0usize));
        let counter_tail = counter.clone();
        let (id2, model2) = (id.clone(), model.clone());
        let text_side = st.engine.clone();
        let encode = move |o: &RequestOutput| {
            let mut events = Vec::new();
            let chunk = |delta: Value, finish: Value, logprobs: Value| {
                json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": o.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
            };
            if started.insert(o.index) {
                events.push(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    Value::Null,
                ));
            }
            num_completion_tokens += o.token_ids.len();
            counter.set(num_completion_tokens);
            if let Some(err) = &o.error {
                events.push(json!({"error": {"message": err, "type": "server_error"}}));
                return events;
            }
            let lp = if want_logprobs {
                openai::chat_logprobs(o, text_side.text())
            } else {
                Value::Null
            };
            if !o.text.is_empty() || !o.token_ids.is_empty() {
                events.push(chunk(json!({"content": o.text}), Value::Null, lp));
            }
            if o.finish_reason.is_some() {
                events.push(chunk(
                    json!({}),
                    openai::finish_reason(o.finish_reason),
                    Value::Null,
                ));
            }
            events
        };
        let tail = move || {
            if !include_usage {
                return Vec::new();
            }
            let n = counter_tail.get();
            vec![
                json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": model2, "choices": [],
                        "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": n, "total_tokens": num_prompt_tokens + n}}),
            ]
        };
        return Ok(sse(stream, encode, tail));
    }
    let choices = collect_ok(stream).await?;
    let num_completion_tokens: usize = choices.iter().map(|c| c.token_ids.len()).sum();
    let choices: Vec<Value> = choices
        .iter()
        .map(|c| {
            json!({"index": c.index, "message": {"role": "assistant", "content": c.text},
                   "logprobs": if want_logprobs { openai::chat_logprobs(c, text) } else { Value::Null },
                   "finish_reason": openai::finish_reason(c.finish_reason)})
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
        "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                  "total_tokens": num_prompt_tokens + num_completion_tokens},
    })))
}

async fn completions(st: web::Data<ServerState>, body: Bytes) -> HttpResponse {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn completions_inner(
    st: web::Data<ServerState>,
    body: Bytes,
) -> Result<HttpResponse, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    check_model(&st, &req.model)?;
    let engine_req = openai::completion_to_engine(&req, st.engine.text())?;
    let num_prompt_tokens = engine_req.prompt_ids.len();
    let stream = st.engine.generate(engine_req).await.map_err(engine_error)?;
    let id = format!("cmpl-{}", stream.request_id);
    let (created, model) = (now_secs(), st.model_name.clone());
    if req.stream {
        let encode = move |o: &RequestOutput| {
            if let Some(err) = &o.error {
                return vec![json!({"error": {"message": err, "type": "server_error"}})];
            }
            vec![
                json!({"id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                                     "finish_reason": openai::finish_reason(o.finish_reason)}]}),
            ]
        };
        return Ok(sse(stream, encode, Vec::new));
    }
    let choices = collect_ok(stream).await?;
    let num_completion_tokens: usize = choices.iter().map(|c| c.token_ids.len()).sum();
    let choices: Vec<Value> = choices
        .iter()
        .map(|c| {
            json!({"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": null,
                        "finish_reason": openai::finish_reason(c.finish_reason)})
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
        "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                  "total_tokens": num_prompt_tokens + num_completion_tokens},
    })))
}

async fn not_found() -> HttpResponse {
    error_response(&ApiError {
        status: 404,
        message: "no such route".into(),
        param: None,
    })
}

/// Serves until the process is stopped.
pub fn serve(
    engine: EngineHandle,
    model_name: String,
    host: &str,
    port: u16,
) -> std::io::Result<()> {
    let state = web::Data::new(ServerState { engine, model_name });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .app_data(web::PayloadConfig::new(MAX_BODY_BYTES))
            .route("/health", web::get().to(health))
            .route("/v1/models", web::get().to(models))
            .route("/v1/chat/completions", web::post().to(chat_completions))
            .route("/v1/completions", web::post().to(completions))
            .default_service(web::to(not_found))
    })
    .workers(2)
    .bind((host, port))?;
    eprintln!("troupe: serving on http://{host}:{port}");
    actix_web::rt::System::new().block_on(server.run())
}
