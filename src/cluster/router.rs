//! `troupe router`: the cluster's HTTP front. Each generation request's prompt is
//! tokenized and hashed as the engines' prefix caches hash it, the engine is picked by
//! `route::pick_prefill` over the engines' last reports, and the request is forwarded to
//! it unchanged, its reply streamed back as it comes. An engine that cannot be reached is
//! dropped from the view and the request goes to the next pick.

use std::collections::BTreeMap;

use actix_web::{HttpRequest, HttpResponse, web};
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::registry::{Registry, load_of};
use crate::model::ModelText;
use crate::protocol::openai::{ChatRequest, chat_conversation};
use crate::protocol::serve_options::host_allowed;
use crate::route::{EngineLoad, RouteConfig, pick_decode, pick_prefill, prompt_block_hashes};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{Mutex, Shared};

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

pub struct RouterState {
    pub registry: Shared<Registry>,
    /// The served model's tokenizer and template: prompts are hashed as the engines do.
    pub text: ModelText,
    pub cfg: RouteConfig,
    client: reqwest::Client,
    /// Requests sent to each engine, by node name.
    routed: Mutex<BTreeMap<String, u64>>,
    /// Requests that went to another engine after a failed forward.
    rerouted: AtomicU64,
    /// Requests forwarded and not yet answered in full, by node name: counted with each
    /// engine's last report, so a burst between two reports spreads.
    in_flight: Mutex<BTreeMap<String, usize>>,
    /// Host header values accepted (`None`: any), as `serve` checks them.
    allowed_hosts: Option<Vec<String>>,
}

/// One forwarded request in an engine's in-flight count, until dropped (its reply ended).
struct InFlight {
    st: web::Data<RouterState>,
    node_name: String,
}

impl InFlight {
    fn new(st: &web::Data<RouterState>, node_name: &str) -> Self {
        *st.in_flight
            .lock()
            .expect("router lock")
            .entry(node_name.to_string())
            .or_default() += 1;
        InFlight {
            st: st.clone(),
            node_name: node_name.to_string(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut in_flight = self.st.in_flight.lock().expect("router lock");
        if let Some(n) = in_flight.get_mut(&self.node_name) {
            *n = n.saturating_sub(1);
        }
    }
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
            routed: Mutex::new(BTreeMap::new()),
            rerouted: AtomicU64::new(0),
            in_flight: Mutex::new(BTreeMap::new()),
            allowed_hosts,
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

    /// The engine for a request: by prefix and work for a generation request whose
    /// prompt is known, by load otherwise.
    fn pick(&self, loads: &[EngineLoad], prompt: Option<&[u32]>) -> Option<usize> {
        match prompt {
            Some(ids) => {
                let block_size = loads.first()?.block_size;
                let hashes = prompt_block_hashes(ids, block_size);
                pick_prefill(&self.cfg, loads, &hashes, ids.len())
            }
            None => pick_decode(loads, 0),
        }
    }
}

fn error(status: u16, message: &str) -> HttpResponse {
    HttpResponse::build(actix_web::http::StatusCode::from_u16(status).expect("a status"))
        .json(json!({"error": {"message": message, "type": "router_error", "code": status}}))
}

/// Every route but the router's own: forwarded to the engine picked for it.
pub async fn forward(
    st: web::Data<RouterState>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    let path = req.uri().path().to_string();
    let target = req
        .uri()
        .path_and_query()
        .map_or(path.clone(), |p| p.to_string());
    if let Some(allowed) = &st.allowed_hosts {
        let host = req
            .headers()
            .get("host")
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if !host_allowed(host, allowed) {
            return error(
                403,
                "the Host header names no host this router serves (--allowed-hosts)",
            );
        }
    }
    let prompt = st.prompt_ids(&path, &body);
    for attempt in 0..MAX_ATTEMPTS {
        let reports = st.registry.reports();
        let mut loads: Vec<EngineLoad> = reports.iter().map(load_of).collect();
        {
            let in_flight = st.in_flight.lock().expect("router lock");
            for (load, report) in loads.iter_mut().zip(&reports) {
                load.num_running += in_flight.get(&report.node_name).copied().unwrap_or(0);
            }
        }
        let Some(i) = st.pick(&loads, prompt.as_deref()) else {
            return error(503, "no engine in the cluster can take the request");
        };
        let engine = &reports[i];
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
        let counted = InFlight::new(&st, &engine.node_name);
        match out.send().await {
            Ok(reply) => {
                *st.routed
                    .lock()
                    .expect("router lock")
                    .entry(engine.node_name.clone())
                    .or_default() += 1;
                if attempt > 0 {
                    st.rerouted.fetch_add(1, Ordering::Relaxed);
                }
                let status = actix_web::http::StatusCode::from_u16(reply.status().as_u16())
                    .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
                let mut response = HttpResponse::build(status);
                if let Some(ct) = reply.headers().get("content-type") {
                    response.insert_header(("content-type", ct.as_bytes()));
                }
                let bytes = reply.bytes_stream().map(move |chunk| {
                    // Held until the reply's last chunk has gone (or the client left).
                    let _counted = &counted;
                    chunk.map_err(|e| actix_web::error::ErrorBadGateway(e.to_string()))
                });
                return response.streaming(bytes);
            }
            // Nothing reached the engine: it is gone; the next pick gets the request.
            Err(e) if e.is_connect() => st.registry.forget(&engine.node_name),
            Err(e) => return error(502, &format!("engine {}: {e}", engine.node_name)),
        }
    }
    error(503, "no engine of the cluster answered")
}

/// `GET /router/engines`: each engine's last report (cached blocks counted) and how many
/// requests went to it.
pub async fn engines(st: web::Data<RouterState>) -> HttpResponse {
    let routed = st.routed.lock().expect("router lock").clone();
    let engines: Vec<Value> = st
        .registry
        .reports()
        .iter()
        .map(|e| {
            json!({"node_name": e.node_name, "http_url": e.http_url, "role": e.role,
                   "num_running": e.num_running, "num_waiting": e.num_waiting,
                   "num_kv_tokens": e.num_kv_tokens, "num_cached_blocks": e.cached_blocks.len(),
                   "routed": routed.get(&e.node_name).copied().unwrap_or(0)})
        })
        .collect();
    HttpResponse::Ok().json(json!({
        "engines": engines,
        "routed": routed,
        "rerouted": st.rerouted.load(Ordering::Relaxed),
    }))
}

/// `GET /health`: 200 while an engine is in the cluster.
pub async fn health(st: web::Data<RouterState>) -> HttpResponse {
    if st.registry.reports().is_empty() {
        error(503, "no engine has joined the cluster")
    } else {
        HttpResponse::Ok().finish()
    }
}
