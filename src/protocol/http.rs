//! HTTP plumbing every API's handlers share: the server state, body reading with a size
//! limit, errors in the API's own JSON, SSE framing, latency metrics. Dropping a response
//! (client gone) drops its `RequestStream`, which aborts the request and frees its blocks.

use crate::api::RequestIds;
use crate::sync::Shared as Arc;
use crate::sync::{Gate, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::{HttpResponse, web};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde_json::Value;

use super::api::{ApiError, Flavor, Sampling, conversation_request, parse_spec};
use super::conversation::Conversation;
use super::metrics::Metrics;
use super::output_parser::ParseSpec;
use super::serve_options::ServeOptions;
use crate::engine::{EngineError, EngineHandle, ImageEngine, RequestOutput, RequestStream};

/// Request bodies above this are refused (413) while reading.
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// The same for a vision-language model, whose requests carry images in base64.
pub const MAX_IMAGE_BODY_BYTES: usize = 64 << 20;

pub struct ServerState {
    /// Set once the engine has loaded; until then every route but `/health` is 503.
    engine: OnceLock<EngineHandle>,
    /// Set instead on an encode engine (`serve --role encode`): the vision tower alone,
    /// which answers its cluster's asks and no request of the APIs.
    encoder: OnceLock<ImageEngine>,
    /// Why the engine could not start or has failed for good (`/health` says it).
    failure: OnceLock<String>,
    pub opts: ServeOptions,
    pub metrics: Arc<Metrics>,
    /// Generation requests in flight; closed while draining.
    pub gate: Gate,
    request_ids: RequestIds,
    /// Keeps request ids of two server processes apart.
    boot_nanos: u128,
    /// Run first when the server drains (`serve --drain-to`: requests moved to a peer).
    drain_hook: OnceLock<DrainHook>,
}

/// What a drain runs before it waits for the requests in flight.
pub type DrainHook =
    Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

impl ServerState {
    pub fn new(opts: ServeOptions) -> Self {
        ServerState {
            engine: OnceLock::new(),
            encoder: OnceLock::new(),
            failure: OnceLock::new(),
            gate: Gate::new(opts.admission_limit()),
            opts,
            metrics: Arc::new(Metrics::new()),
            request_ids: RequestIds::default(),
            boot_nanos: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            drain_hook: OnceLock::new(),
        }
    }

    pub fn set_drain_hook(&self, hook: DrainHook) {
        let _ = self.drain_hook.set(hook);
    }

    pub fn drain_hook(&self) -> Option<&DrainHook> {
        self.drain_hook.get()
    }

    /// The engine, or 503 while it is loading (421 on an encode engine, which has none).
    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        if self.encoder.get().is_some() {
            return Err(ApiError::status(
                421,
                "this server is an encode engine (serve --role encode): it encodes images \
                 for its cluster's engines and answers no requests; send them to the router",
            ));
        }
        self.engine
            .get()
            .ok_or_else(|| ApiError::status(503, "the model is still loading"))
    }

    /// The encoder of an encode engine (`None` on any other server).
    pub fn encoder(&self) -> Option<&ImageEngine> {
        self.encoder.get()
    }

    pub fn set_encoder(&self, encoder: ImageEngine) {
        let _ = self.encoder.set(encoder);
    }

    pub fn set_engine(&self, engine: EngineHandle) {
        let _ = self.engine.set(engine);
    }

    pub fn set_failure(&self, reason: String) {
        let _ = self.failure.set(reason);
    }

    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    pub fn fresh_request_id(&self) -> String {
        format!(
            "req-{:x}-{}",
            self.boot_nanos & 0xffff_ffff_ffff,
            self.request_ids.next()
        )
    }
}

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn error_response(e: &ApiError, flavor: Flavor) -> HttpResponse {
    let status = actix_web::http::StatusCode::from_u16(e.status)
        .unwrap_or(actix_web::http::StatusCode::BAD_REQUEST);
    let mut reply = HttpResponse::build(status);
    if matches!(e.status, 408 | 413) {
        // The rest of the body was never read: the connection is closed, not kept
        // waiting for bytes nobody will read.
        reply.force_close();
    }
    reply.json(e.body(flavor))
}

pub fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Rejected(e) => ApiError::bad(e.field(), e.to_string()),
        other => ApiError::status(503, other.to_string()),
    }
}

/// The body, refused with 413 past `MAX_BODY_BYTES` (`MAX_IMAGE_BODY_BYTES` for a model
/// that takes images) and with 408 when it has not all
/// arrived within the body read timeout (a slow sender holds no worker past it).
pub async fn read_body(st: &ServerState, payload: web::Payload) -> Result<Bytes, ApiError> {
    let limit = st.opts.body_read_timeout;
    let takes_images = st.engine.get().is_some_and(|e| e.text().vision.is_some());
    let max_bytes = if takes_images {
        MAX_IMAGE_BODY_BYTES
    } else {
        MAX_BODY_BYTES
    };
    tokio::time::timeout(limit, read_whole(payload, max_bytes))
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::status(
                408,
                format!(
                    "the request body did not arrive within {} s",
                    limit.as_secs_f64()
                ),
            ))
        })
}

async fn read_whole(mut payload: web::Payload, max_bytes: usize) -> Result<Bytes, ApiError> {
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad("body", format!("cannot read the body: {e}")))?;
        if body.len() + chunk.len() > max_bytes {
            return Err(ApiError::status(
                413,
                format!("the request body exceeds {max_bytes} bytes"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

pub fn check_model(st: &ServerState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &st.opts.served_model_name => Err(ApiError {
            status: 404,
            message: format!(
                "model `{m}` does not exist; this server serves `{}`",
                st.opts.served_model_name
            ),
            param: Some("model".into()),
        }),
        _ => Ok(()),
    }
}

/// A chat-shaped request (chat completions, messages, responses) on its way: the
/// conversation rendered off the worker and handed to the engine, its outputs timed.
pub struct Submitted {
    pub stream: Timed,
    /// How the reply's text splits into reasoning, text and tool calls.
    pub spec: ParseSpec,
    pub num_prompt_tokens: usize,
}

/// `conv` with `sampling` rendered, admitted and timed: what the three chat APIs share.
pub async fn submit(
    st: &ServerState,
    conv: &Conversation,
    sampling: Sampling,
) -> Result<Submitted, ApiError> {
    let engine = st.engine()?;
    let fetched;
    let conv = if conv.images.iter().any(|i| i.url.is_some()) {
        let (mut owned, allowed) = (conv.clone(), st.opts.allowed_media_domains.clone());
        fetched = super::api::off_worker("messages", move || {
            super::images::fetch_remote(&mut owned, &allowed)?;
            Ok(owned)
        })
        .await?;
        &fetched
    } else {
        conv
    };
    let engine_req = conversation_request(conv, sampling, engine.text_shared()).await?;
    let num_prompt_tokens = engine_req.prompt_ids.len();
    let spec = parse_spec(engine.text(), conv);
    let stream = engine.generate(engine_req).await.map_err(engine_error)?;
    Ok(Submitted {
        stream: Timed::new(stream, st, num_prompt_tokens),
        spec,
        num_prompt_tokens,
    })
}

/// A request's outputs with its latencies recorded as they arrive.
pub struct Timed {
    /// Dropped (which aborts the request) when its deadline passes.
    stream: Option<RequestStream>,
    request_id: u64,
    /// `--request-timeout` from admission.
    deadline: Option<(tokio::time::Instant, std::time::Duration)>,
    metrics: Arc<Metrics>,
    started: Instant,
    last_token: Option<Instant>,
    num_prompt_tokens: usize,
    num_generated_tokens: usize,
    done: bool,
}

/// What `Timed` takes from the server, held by a reply that submits its requests later
/// (a batch's prompts, each once there is room for it).
#[derive(Clone)]
pub struct Timer {
    request_timeout: Option<std::time::Duration>,
    metrics: Arc<Metrics>,
}

impl Timer {
    pub fn of(st: &ServerState) -> Self {
        Timer {
            request_timeout: st.opts.request_timeout,
            metrics: st.metrics.clone(),
        }
    }

    pub fn time(&self, stream: RequestStream, num_prompt_tokens: usize) -> Timed {
        let now = tokio::time::Instant::now();
        Timed {
            request_id: stream.request_id,
            stream: Some(stream),
            deadline: self.request_timeout.map(|t| (now + t, t)),
            metrics: self.metrics.clone(),
            started: Instant::now(),
            last_token: None,
            num_prompt_tokens,
            num_generated_tokens: 0,
            done: false,
        }
    }
}

impl Timed {
    pub fn new(stream: RequestStream, st: &ServerState, num_prompt_tokens: usize) -> Self {
        Timer::of(st).time(stream, num_prompt_tokens)
    }

    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The stream's next output, or once its deadline has passed, an error output (the
    /// request is aborted) and then the end.
    async fn next_in_time(&mut self) -> Option<RequestOutput> {
        let stream = self.stream.as_mut()?;
        let Some((deadline, limit)) = self.deadline else {
            return stream.next().await;
        };
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(out) => out,
            Err(_) => {
                self.stream = None;
                Some(RequestOutput {
                    request_id: self.request_id,
                    error: Some(format!(
                        "the request ran past --request-timeout ({} s) and was stopped",
                        limit.as_secs_f64()
                    )),
                    ..Default::default()
                })
            }
        }
    }

    pub async fn next(&mut self) -> Option<RequestOutput> {
        let out = self.next_in_time().await;
        let now = Instant::now();
        match &out {
            Some(o) if !o.token_ids.is_empty() => {
                match self.last_token {
                    None => self
                        .metrics
                        .observe_ttft_secs((now - self.started).as_secs_f64()),
                    Some(t) => self
                        .metrics
                        .observe_inter_token_secs((now - t).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.num_generated_tokens += o.token_ids.len();
            }
            Some(_) => {}
            None => self.finish(),
        }
        out
    }

    pub async fn collect_ok(mut self) -> Result<Vec<RequestOutput>, ApiError> {
        let mut by_index: Vec<RequestOutput> = Vec::new();
        while let Some(o) = self.next().await {
            while by_index.len() <= o.index {
                by_index.push(RequestOutput::default());
            }
            let acc = &mut by_index[o.index];
            acc.index = o.index;
            acc.request_id = o.request_id;
            acc.token_ids.extend(&o.token_ids);
            acc.text.push_str(&o.text);
            acc.token_logprobs.extend(&o.token_logprobs);
            acc.top_logprobs.extend(o.top_logprobs.iter().cloned());
            if o.prompt_logprobs.is_some() {
                acc.prompt_logprobs = o.prompt_logprobs.clone();
            }
            if o.finish_reason.is_some() {
                acc.finish_reason = o.finish_reason;
                acc.seed = o.seed;
                acc.stop_string = o.stop_string.clone();
            }
            if let Some(e) = o.error {
                return Err(ApiError::status(503, e));
            }
        }
        Ok(by_index)
    }

    fn finish(&mut self) {
        if !self.done {
            self.done = true;
            self.metrics
                .record_tokens(self.num_prompt_tokens, self.num_generated_tokens);
            self.metrics
                .observe_e2e_secs(self.started.elapsed().as_secs_f64());
        }
    }
}

/// One server-sent event: `event:` (the Anthropic and Responses APIs name theirs) and data.
pub struct SseEvent {
    pub event: Option<String>,
    pub data: Value,
}

impl SseEvent {
    pub fn data(data: Value) -> Self {
        SseEvent { event: None, data }
    }
    pub fn named(event: &str, data: Value) -> Self {
        SseEvent {
            event: Some(event.to_string()),
            data,
        }
    }
}

/// The SSE body: the encoded events of each output, the tail's after the last, then
/// OpenAI's `[DONE]` when `done_marker`.
pub fn sse(
    stream: Timed,
    encode: impl FnMut(&RequestOutput) -> Vec<SseEvent> + 'static,
    tail: impl FnOnce() -> Vec<SseEvent> + 'static,
    done_marker: bool,
) -> HttpResponse {
    struct State<E, T> {
        stream: Option<Timed>,
        encode: E,
        tail: Option<T>,
    }
    let state = State {
        stream: Some(stream),
        encode,
        tail: Some(tail),
    };
    let body = futures_util::stream::unfold(state, move |mut s| async move {
        let events: Vec<SseEvent> = match s.stream.as_mut() {
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
            if let Some(name) = e.event {
                text.push_str(&format!("event: {name}\n"));
            }
            text.push_str(&format!("data: {}\n\n", e.data));
        }
        if s.stream.is_none() && done_marker {
            text.push_str("data: [DONE]\n\n");
        }
        Some((Ok::<_, actix_web::Error>(Bytes::from(text)), s))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(body)
}

/// A whole-JSON reply whose body is sent as the generation ends, with a space every
/// second until then (leading whitespace is valid JSON). The heartbeats are what notices a
/// client that hung up: the failed write drops the body, and with it the request, which
/// aborts and frees its blocks — a plain response would run the request to its end.
/// Client mistakes were answered before this starts; an engine failure during generation
/// arrives as the API's error object after the 200.
pub fn json_when_done(
    reply: impl std::future::Future<Output = Result<Value, ApiError>> + 'static,
    flavor: Flavor,
) -> HttpResponse {
    let state = Some(Box::pin(reply));
    let body = futures_util::stream::unfold(state, move |state| async move {
        let mut reply = state?;
        let tick = tokio::time::sleep(std::time::Duration::from_secs(1));
        match futures_util::future::select(reply.as_mut(), Box::pin(tick)).await {
            futures_util::future::Either::Left((done, _)) => {
                let value = done.unwrap_or_else(|e| e.body(flavor));
                Some((
                    Ok::<_, actix_web::Error>(Bytes::from(value.to_string())),
                    None,
                ))
            }
            futures_util::future::Either::Right(_) => {
                Some((Ok(Bytes::from_static(b" ")), Some(reply)))
            }
        }
    });
    HttpResponse::Ok()
        .content_type("application/json")
        .streaming(body)
}

/// Runs a handler body and answers its error in the API's format; counts the request.
pub async fn respond(
    st: &ServerState,
    endpoint: &str,
    flavor: Flavor,
    result: Result<HttpResponse, ApiError>,
) -> HttpResponse {
    let response = match result {
        Ok(r) => r,
        Err(e) => error_response(&e, flavor),
    };
    st.metrics
        .record_request(endpoint, response.status().as_u16());
    response
}
