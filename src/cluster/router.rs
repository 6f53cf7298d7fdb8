//! `troupe router`: the cluster's HTTP front. Each generation request's prompt is
//! tokenized and hashed as the engines' prefix caches hash it, its route is picked by
//! `route::pick_route` over the engines' last reports (with a prefill engine in the
//! cluster: that engine prefills and hands the KV to the decode engine that answers), and
//! the request is forwarded unchanged, its reply streamed back as it comes. An engine that
//! cannot be reached, or fails before the client has a byte of its reply, is dropped from
//! the view and the request goes to the next pick (prefilled again there); one that fails
//! later ends the stream with an error event. An engine answering 429 or 503 is passed
//! over for the request while another can take it.

use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine as _;
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::agent::{AgentMsg, EngineReport, agent_group};
use super::image_transfer::{EncodeAsk, EncodeDone};
use super::in_flight::{InFlight, InFlightCounts};
use super::kv_transfer::MAX_BLOCK_BYTES;
use super::kv_transfer::{HandOff, PrefillAsk};
use super::registry::{Registry, load_of};
use super::router_metrics::Counters;
use crate::model::ModelText;
use crate::protocol::anthropic::{MessagesRequest, conversation as anthropic_conversation};
use crate::protocol::api::ApiError;
use crate::protocol::guard::{flavor_of, header_key, key_matches};
use crate::protocol::openai::{ChatRequest, chat_conversation};
use crate::protocol::serve_options::host_allowed;
use crate::route::{EngineLoad, Route, RouteConfig, pick_encoder, pick_route, prompt_block_hashes};
use crate::sync::{Mutex, Shared};

/// How many engines a request is tried on before the router gives up.
const MAX_ATTEMPTS: usize = 3;
/// How long a prefill engine may take to prefill a prompt and hand its KV over.
const HAND_OFF_TIMEOUT_MS: u64 = 600_000;
/// How long an encode engine may take to encode a request's images and send the rows.
const ENCODE_TIMEOUT_MS: u64 = 120_000;

/// Request headers the engines read (keys, ids, traces); the rest stay here.
const FORWARDED_HEADERS: &[&str] = &[
    "content-type",
    "authorization",
    "x-api-key",
    "x-request-id",
    "traceparent",
    "anthropic-version",
];

pub struct RouterState {
    pub registry: Shared<Registry>,
    /// The served model's tokenizer and template: prompts are hashed as the engines do.
    pub text: ModelText,
    pub cfg: RouteConfig,
    client: reqwest::Client,
    counters: Mutex<Counters>,
    /// Requests forwarded and not yet answered in full, by node name.
    in_flight: Shared<InFlightCounts>,
    /// Image patches sent to each encode engine and not yet encoded, by node name.
    patches_in_flight: Shared<InFlightCounts>,
    /// Host header values accepted (`None`: any), as `serve` checks them.
    allowed_hosts: Option<Vec<String>>,
    /// Keys a client must send (`--api-key`; none: the door is open).
    pub api_keys: Vec<String>,
}

impl RouterState {
    pub fn new(
        registry: Shared<Registry>,
        text: ModelText,
        allowed_hosts: Option<Vec<String>>,
    ) -> Self {
        RouterState {
            registry,
            text,
            cfg: RouteConfig::default(),
            // Engines are reached directly: no proxy from the environment, no redirects.
            client: reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(std::time::Duration::from_secs(2))
                .build()
                .expect("a plain HTTP client"),
            counters: Mutex::new(Counters::default()),
            in_flight: Shared::new(InFlightCounts::default()),
            patches_in_flight: Shared::new(InFlightCounts::default()),
            allowed_hosts,
            api_keys: Vec::new(),
        }
    }

    /// The prompt's token ids, for the routes whose prompt the router can read.
    fn prompt_ids(&self, path: &str, body: &[u8]) -> Option<Vec<u32>> {
        let v: Value = serde_json::from_slice(body).ok()?;
        match path {
            "/v1/completions" => {
                let prompt = match &v["prompt"] {
                    Value::Array(items) if items.first().is_some_and(|x| !x.is_number()) => {
                        items[0].clone()
                    }
                    other => other.clone(),
                };
                match prompt {
                    Value::String(s) => {
                        let tok = self.text.tokenizer.as_ref()?;
                        tok.encode_request_prompt(&s, false, true).ok()
                    }
                    Value::Array(ids) => ids.iter().map(|x| x.as_u64().map(|x| x as u32)).collect(),
                    _ => None,
                }
            }
            "/v1/chat/completions" => {
                let req: ChatRequest = serde_json::from_value(v).ok()?;
                let conv = chat_conversation(&req).ok()?;
                conv.to_prompt_ids(&self.text).ok()
            }
            _ => None,
        }
    }

    /// A chat's images sent as data (not URLs: the engine fetches those), each as its
    /// file in base64, its MIME type and its patches ((width / patch) × (height / patch)).
    fn images(&self, path: &str, body: &[u8]) -> Vec<(String, Option<String>, usize)> {
        let Some(vision) = &self.text.vision else {
            return Vec::new();
        };
        let conv = match path {
            "/v1/chat/completions" => serde_json::from_slice::<ChatRequest>(body)
                .ok()
                .and_then(|r| chat_conversation(&r).ok()),
            "/v1/messages" => serde_json::from_slice::<MessagesRequest>(body)
                .ok()
                .and_then(|r| anthropic_conversation(&r).ok()),
            _ => None,
        };
        let patch = vision.processor.patch_size.max(1) as u64;
        let b64 = base64::engine::general_purpose::STANDARD;
        conv.map(|c| c.images)
            .unwrap_or_default()
            .into_iter()
            .filter(|i| i.url.is_none())
            .map(|i| {
                let (w, h) = image::ImageReader::new(std::io::Cursor::new(&i.bytes))
                    .with_guessed_format()
                    .ok()
                    .and_then(|r| r.into_dimensions().ok())
                    .unwrap_or((0, 0));
                let patches = (u64::from(w) / patch) * (u64::from(h) / patch);
                (b64.encode(&i.bytes), i.mime, patches as usize)
            })
            .collect()
    }

    /// The request's route: by prefix and work where its prompt is known, by load
    /// otherwise.
    fn route(&self, loads: &[EngineLoad], prompt: Option<&[u32]>) -> Option<Route> {
        match prompt {
            Some(ids) => {
                let block_size = loads.first()?.block_size;
                let hashes = prompt_block_hashes(ids, block_size);
                pick_route(&self.cfg, loads, Some((&hashes, ids.len())))
            }
            None => pick_route(&self.cfg, loads, None),
        }
    }

    /// The engines' last reports as the rules read them: requests in flight added to
    /// each engine's load, the engines passed over for this request not alive.
    fn loads(&self, reports: &[EngineReport], passed_over: &[String]) -> Vec<EngineLoad> {
        reports
            .iter()
            .map(|r| {
                let mut load = load_of(r);
                load.num_running += self.in_flight.get(&r.node_name);
                load.alive &= !passed_over.contains(&r.node_name);
                load
            })
            .collect()
    }

    fn count(&self, f: impl FnOnce(&mut Counters)) {
        f(&mut self.counters.lock().expect("router lock"));
    }

    pub fn counters(&self) -> Counters {
        self.counters.lock().expect("router lock").clone()
    }
}

/// An error in `serve`'s shape for the route's API (Anthropic's for `/v1/messages`).
fn error_for(path: &str, status: u16, message: &str) -> HttpResponse {
    let body = ApiError::status(status, message).body(flavor_of(path));
    HttpResponse::build(actix_web::http::StatusCode::from_u16(status).expect("a status")).json(body)
}

/// Why the router's door is shut to `req`, as `serve`'s is: a Host it does not serve, or
/// no valid key where keys are set (on every route but `/health`, the router's own
/// included: `/router/engines` and `/metrics` name the engines and their loads).
fn refusal(st: &RouterState, req: &HttpRequest) -> Option<HttpResponse> {
    let path = req.uri().path();
    if let Some(allowed) = &st.allowed_hosts {
        let host = req
            .headers()
            .get("host")
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if !host_allowed(host, allowed) {
            return Some(error_for(
                path,
                403,
                &format!("host `{host}` is not served here (--allowed-hosts)"),
            ));
        }
    }
    if st.api_keys.is_empty() || path == "/health" {
        return None;
    }
    let why = match header_key(req.headers()) {
        None => "no API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
        Some(k) if !key_matches(k, &st.api_keys) => "the API key is not valid",
        Some(_) => return None,
    };
    Some(error_for(path, 401, why))
}

/// Every route but the router's own: forwarded along the route picked for it.
pub async fn forward(
    st: web::Data<RouterState>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    if let Some(shut) = refusal(&st, &req) {
        return shut;
    }
    // Tokenizing a long prompt or rendering a chat template takes milliseconds of CPU:
    // on the blocking pool, not on the worker that serves other requests.
    let (reader, path, bytes) = (st.clone(), req.uri().path().to_string(), body.clone());
    let (prompt, images) = web::block(move || {
        let images = reader.images(&path, &bytes);
        (reader.prompt_ids(&path, &bytes), images)
    })
    .await
    .unwrap_or_default();
    let mut passed_over: Vec<String> = Vec::new();
    let mut why = "no engine in the cluster can take the request".to_string();
    for attempt in 0..MAX_ATTEMPTS {
        let reports = st.registry.reports();
        let loads = st.loads(&reports, &passed_over);
        let Some(route) = st.route(&loads, prompt.as_deref()) else {
            break;
        };
        let engine = &reports[route.target];
        // Counted from now: a burst of hand-offs spreads over the decode engines.
        let counted = InFlightCounts::enter(&st.in_flight, &engine.node_name);
        if !images.is_empty() {
            // The engine that prefills: a prefill engine's hand-off carries no images,
            // so a request with images is prefilled where it is answered.
            encode_remote(&st, &reports, &loads, &images, &engine.node_name).await;
        } else if let (Some(from), Some(ids)) = (route.prefill_from, &prompt) {
            hand_off(&st, &reports[from], engine, ids).await;
        }
        // The last try, or no other engine to try: its 429 or 503 goes to the client.
        let others = (loads.iter().enumerate())
            .filter(|(i, l)| *i != route.target && l.alive && l.role.decodes())
            .count();
        let last = attempt + 1 == MAX_ATTEMPTS || others == 0;
        match send(&st, &req, &body, engine, last, counted).await {
            Ok(reply) => {
                st.count(|c| {
                    *c.routed.entry(engine.node_name.clone()).or_default() += 1;
                    c.rerouted += u64::from(attempt > 0);
                });
                return reply;
            }
            Err(e) => {
                tracing::warn!("router: engine {}: {e}", engine.node_name);
                why = format!("engine {}: {e}", engine.node_name);
                passed_over.push(engine.node_name.clone());
            }
        }
    }
    error_for(req.uri().path(), 503, &why)
}

/// The request sent to `engine`: its reply, or why another engine should take it — it
/// could not be reached, broke off before the client had a byte, or was full or
/// unavailable (429, 503) with another try left.
async fn send(
    st: &web::Data<RouterState>,
    req: &HttpRequest,
    body: &web::Bytes,
    engine: &EngineReport,
    last: bool,
    counted: InFlight,
) -> Result<HttpResponse, String> {
    let reply = match forwarded(st, req, body, engine).send().await {
        Ok(reply) => reply,
        Err(e) if e.is_connect() => {
            // Nothing reached the engine: it is gone.
            st.registry.forget(&engine.node_name);
            return Err(format!("unreachable: {e}"));
        }
        Err(e) => {
            st.registry.forget(&engine.node_name);
            return Err(format!("no reply: {e}"));
        }
    };
    let code = reply.status().as_u16();
    if (code == 429 || code == 503) && !last {
        return Err(format!("answered {code}"));
    }
    let status = actix_web::http::StatusCode::from_u16(code)
        .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
    let mut response = HttpResponse::build(status);
    for name in ["content-type", "retry-after", "x-request-id"] {
        if let Some(v) = reply.headers().get(name) {
            response.insert_header((name, v.as_bytes()));
        }
    }
    let streamed = reply
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        // A whole reply or none: an engine that dies mid-reply leaves nothing sent.
        return match reply.bytes().await {
            Ok(bytes) => Ok(response.body(bytes)),
            Err(e) => {
                st.registry.forget(&engine.node_name);
                Err(format!("broke off its reply: {e}"))
            }
        };
    }
    relay_stream(st, engine, reply, response, counted).await
}

/// The client's request as it goes to `engine`: its method, path and query, body and the
/// headers an engine reads.
fn forwarded(
    st: &RouterState,
    req: &HttpRequest,
    body: &web::Bytes,
    engine: &EngineReport,
) -> reqwest::RequestBuilder {
    let target = req
        .uri()
        .path_and_query()
        .map_or(req.uri().path().to_string(), |p| p.to_string());
    let method = reqwest::Method::from_bytes(req.method().as_str().as_bytes())
        .unwrap_or(reqwest::Method::GET);
    let mut out = st
        .client
        .request(method, format!("{}{target}", engine.http_url))
        .body(body.clone());
    for name in FORWARDED_HEADERS {
        if let Some(v) = req.headers().get(*name).and_then(|v| v.to_str().ok()) {
            out = out.header(*name, v);
        }
    }
    out
}

/// An engine's event stream relayed to the client. The client's stream starts with the
/// engine's first event: before it, another engine may still take the request; after it,
/// an engine that fails ends the stream with an error event.
async fn relay_stream(
    st: &web::Data<RouterState>,
    engine: &EngineReport,
    reply: reqwest::Response,
    mut response: actix_web::HttpResponseBuilder,
    counted: InFlight,
) -> Result<HttpResponse, String> {
    let mut events = reply.bytes_stream();
    let first = match events.next().await {
        Some(Ok(first)) => first,
        Some(Err(e)) => {
            st.registry.forget(&engine.node_name);
            return Err(format!("broke off its stream: {e}"));
        }
        None => {
            st.registry.forget(&engine.node_name);
            return Err("ended its stream before any event".into());
        }
    };
    let (st, node) = (st.clone(), engine.node_name.clone());
    let rest = events.scan(false, move |ended, chunk| {
        // Held until the reply's last chunk has gone (or the client left).
        let _counted = &counted;
        if *ended {
            return std::future::ready(None);
        }
        let bytes = chunk.unwrap_or_else(|e| {
            // An error event ends the stream: the client never waits on a dead engine.
            *ended = true;
            st.count(|c| c.failed_mid_reply += 1);
            st.registry.forget(&node);
            let message = format!("engine {node} failed mid-reply: {e}");
            let event = json!({"error": {"message": message, "type": "router_error", "code": 502}});
            // After whatever part of an event came: the error is an event of its own.
            web::Bytes::from(format!("\n\ndata: {event}\n\ndata: [DONE]\n\n"))
        });
        std::future::ready(Some(Ok::<_, actix_web::Error>(bytes)))
    });
    let stream = futures_util::stream::once(std::future::ready(Ok(first))).chain(rest);
    Ok(response.streaming(stream))
}

/// The prompt prefilled on `prefill` and its KV handed to `decode`; on failure the decode
/// engine prefills it itself (counted).
/// A request's images encoded on the encode engine with the fewest patches in flight (if
/// the cluster has one) and their rows sent to `target`, which would otherwise encode them
/// itself — as it does when this fails.
async fn encode_remote(
    st: &web::Data<RouterState>,
    reports: &[EngineReport],
    loads: &[EngineLoad],
    images: &[(String, Option<String>, usize)],
    target: &str,
) {
    let in_flight: Vec<usize> = reports
        .iter()
        .map(|r| st.patches_in_flight.get(&r.node_name))
        .collect();
    let Some(pick) = pick_encoder(loads, &in_flight) else {
        return;
    };
    let encoder = &reports[pick];
    let patches = images.iter().map(|i| i.2).sum();
    let _counted =
        InFlightCounts::enter_weighted(&st.patches_in_flight, &encoder.node_name, patches);
    let ask = EncodeAsk {
        images: images
            .iter()
            .map(|(d, m, _)| (d.clone(), m.clone()))
            .collect(),
        deliver_to: vec![target.to_string()],
    };
    let ask = serde_json::to_string(&ask).unwrap_or_default();
    let done = match ractor::pg::get_members(&agent_group(&encoder.node_name)).pop() {
        // Past a frame of the transport: the target encodes them.
        _ if ask.len() > MAX_BLOCK_BYTES => Err("the images are past a frame".to_string()),
        None => Err("its agent left the cluster".to_string()),
        Some(cell) => {
            let agent: ractor::ActorRef<AgentMsg> = cell.into();
            match ractor::call_t!(agent, AgentMsg::EncodeImages, ENCODE_TIMEOUT_MS, ask) {
                Ok(answer) => serde_json::from_str::<EncodeDone>(&answer)
                    .map_err(|_| answer)
                    .and_then(|d| d.error.clone().map_or(Ok(d), Err)),
                Err(e) => {
                    st.registry.forget(&encoder.node_name);
                    Err(e.to_string())
                }
            }
        }
    };
    match done {
        Ok(d) => st.count(|c| {
            *c.encoded_images
                .entry(encoder.node_name.clone())
                .or_default() += d.num_images as u64;
        }),
        Err(e) => {
            tracing::warn!(
                "router: encode engine {} did not encode a request's images ({e}); {target} encodes them",
                encoder.node_name
            );
            st.count(|c| c.failed_encodes += 1);
        }
    }
}

async fn hand_off(
    st: &web::Data<RouterState>,
    prefill: &EngineReport,
    decode: &EngineReport,
    prompt: &[u32],
) {
    let _counted = InFlightCounts::enter(&st.in_flight, &prefill.node_name);
    let ask = PrefillAsk {
        prompt_ids: prompt.to_vec(),
        decode_node: decode.node_name.clone(),
    };
    let done = match ractor::pg::get_members(&agent_group(&prefill.node_name)).pop() {
        None => Err("its agent left the cluster".to_string()),
        Some(cell) => {
            let agent: ractor::ActorRef<AgentMsg> = cell.into();
            let ask = serde_json::to_string(&ask).unwrap_or_default();
            match ractor::call_t!(agent, AgentMsg::Prefill, HAND_OFF_TIMEOUT_MS, ask) {
                Ok(answer) => serde_json::from_str::<HandOff>(&answer).map_err(|_| answer),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    match done {
        Ok(h) => st.count(|c| {
            *c.hand_offs.entry(prefill.node_name.clone()).or_default() += 1;
            c.kv_blocks_moved += h.num_blocks as u64;
            c.kv_bytes_moved += h.bytes;
            c.kv_transfer_secs += h.transfer_secs;
        }),
        Err(e) => {
            tracing::warn!(
                "router: hand-off from {} to {}: {e}",
                prefill.node_name,
                decode.node_name
            );
            st.count(|c| c.failed_hand_offs += 1);
        }
    }
}

/// `GET /router/engines`: each engine's last report (cached blocks counted), how many
/// requests it answered and prefilled for others, and the router's counters.
pub async fn engines(st: web::Data<RouterState>, req: HttpRequest) -> HttpResponse {
    if let Some(shut) = refusal(&st, &req) {
        return shut;
    }
    let c = st.counters();
    let engines: Vec<Value> = st
        .registry
        .reports()
        .iter()
        .map(|e| {
            json!({"node_name": e.node_name, "http_url": e.http_url, "role": e.role,
                   "num_running": e.num_running, "num_waiting": e.num_waiting,
                   "num_kv_tokens": e.num_kv_tokens, "num_cached_blocks": e.cached_blocks.len(),
                   "routed": c.routed.get(&e.node_name).copied().unwrap_or(0),
                   "hand_offs": c.hand_offs.get(&e.node_name).copied().unwrap_or(0)})
        })
        .collect();
    HttpResponse::Ok().json(json!({
        "engines": engines,
        "routed": c.routed,
        "rerouted": c.rerouted,
        "failed_mid_reply": c.failed_mid_reply,
        "hand_offs": c.hand_offs.values().sum::<u64>(),
        "failed_hand_offs": c.failed_hand_offs,
        "kv_blocks_moved": c.kv_blocks_moved,
        "kv_bytes_moved": c.kv_bytes_moved,
        "kv_transfer_secs": c.kv_transfer_secs,
    }))
}

/// `GET /health`: 200 while an engine is in the cluster.
pub async fn health(st: web::Data<RouterState>, req: HttpRequest) -> HttpResponse {
    if let Some(shut) = refusal(&st, &req) {
        return shut;
    }
    if st.registry.reports().is_empty() {
        error_for("/health", 503, "no engine has joined the cluster")
    } else {
        HttpResponse::Ok().finish()
    }
}

/// `GET /metrics`: the router's view and counters in Prometheus' text format.
pub async fn metrics(st: web::Data<RouterState>, req: HttpRequest) -> HttpResponse {
    if let Some(shut) = refusal(&st, &req) {
        return shut;
    }
    let in_flight = st.in_flight.snapshot();
    let text = super::router_metrics::render(&st.registry.reports(), &in_flight, &st.counters());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(text)
}
