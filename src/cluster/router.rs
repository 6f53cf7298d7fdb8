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
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::agent::EngineReport;
use super::hand_off::{encode_remote, hand_off};
use super::in_flight::{InFlight, InFlightCounts};
use super::request_view::RequestView;
pub use super::router_state::RouterState;
use crate::protocol::api::ApiError;
use crate::protocol::guard::{flavor_of, header_key, key_matches};
use crate::protocol::serve_options::host_allowed;

/// How many engines a request is tried on before the router gives up.
const MAX_ATTEMPTS: usize = 3;
/// Request headers the engines read (keys, ids, traces); the rest stay here.
const FORWARDED_HEADERS: &[&str] = &[
    "content-type",
    "authorization",
    "x-api-key",
    "x-request-id",
    "traceparent",
    "anthropic-version",
];

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
    let view = web::block(move || RequestView::read(&reader.text, &path, &bytes))
        .await
        .unwrap_or_default();
    let mut passed_over: Vec<String> = Vec::new();
    let mut why = "no engine in the cluster can take the request".to_string();
    for attempt in 0..MAX_ATTEMPTS {
        let reports = st.registry.reports();
        let loads = st.loads(&reports, &passed_over);
        let Some(route) = st.route(&loads, &view) else {
            break;
        };
        let engine = &reports[route.target];
        // Counted from now: a burst of hand-offs spreads over the decode engines.
        let counted = InFlightCounts::enter(&st.in_flight, &engine.node_name);
        let target = engine.node_name.clone();
        match (route.prefill_from, &view.prompt) {
            // URLs only the answering engine fetches: prefilled there.
            (Some(from), Some(ids)) if !view.fetches_images => {
                let prefill = &reports[from];
                if !view.images.is_empty() {
                    // The prefill engine reads the rows; the decode engine those of an
                    // image that reaches the prompt's last partial block.
                    let to = vec![prefill.node_name.clone(), target];
                    encode_remote(&st, &reports, &loads, &view, to).await;
                }
                hand_off(&st, prefill, engine, ids, &view).await;
            }
            _ if !view.images.is_empty() => {
                encode_remote(&st, &reports, &loads, &view, vec![target]).await;
            }
            _ => {}
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
        "hand_offs_by_transport": c.hand_offs_by_transport,
        "kv_blocks_moved": c.kv_blocks_moved,
        "kv_bytes_moved": c.kv_bytes_moved,
        "kv_transfer_secs": c.kv_transfer_secs,
        "encoded_images": c.encoded_images.values().sum::<u64>(),
        "failed_encodes": c.failed_encodes,
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
