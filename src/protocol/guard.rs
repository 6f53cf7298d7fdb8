//! The door every request passes before a handler sees it: its request id (the client's
//! `x-request-id`, or a fresh one) and tracing span, the Host allow-list, the API key, and
//! for generation requests a ticket from the admission gate — refused at once with 429
//! when the gate is full and 503 while the server loads or drains, so nothing waits
//! holding its body. The ticket rides on the response body and is given back when the
//! body is done or the client hangs up.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpResponse, web};
use bytes::Bytes;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tracing::Instrument;

use super::api::{ApiError, Flavor};
use super::http::{ServerState, error_response};
use super::serve_options::host_allowed;
use crate::sync::{Refusal, Ticket};

pub const REQUEST_ID: &str = "x-request-id";

/// The request id a handler's logs and the engine's carry (also in the span).
#[derive(Clone, Debug)]
pub struct RequestTag(pub String);

/// The path as the router matches it: percent-decoded (`/v1/%63ompletions` is
/// `/v1/completions`), so no spelling of a route slips past what is decided by path.
fn routed_path(req: &ServiceRequest) -> &str {
    req.match_info().as_str()
}

/// The routes that start a generation, and so take a ticket.
fn is_generation(req: &ServiceRequest) -> bool {
    req.method() == actix_web::http::Method::POST
        && matches!(
            routed_path(req),
            "/v1/chat/completions" | "/v1/completions" | "/v1/responses" | "/v1/messages"
        )
}

pub fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// A client's id is kept when it is short and printable (it is echoed in a header and
/// written to logs); otherwise the request gets a fresh one.
fn request_id(st: &ServerState, req: &ServiceRequest) -> String {
    req.headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| st.fresh_request_id(), str::to_string)
}

/// Compares digests: equal-length inputs and a comparison that does not stop at the
/// first differing byte, so the time taken tells nothing about any key.
pub fn key_matches(presented: &str, keys: &[String]) -> bool {
    let presented = Sha256::digest(presented.as_bytes());
    keys.iter().fold(0u8, |any, key| {
        any | Sha256::digest(key.as_bytes()).ct_eq(&presented).unwrap_u8()
    }) == 1
}

/// The key a client sent: `Authorization: Bearer` (OpenAI's SDKs) or `x-api-key`
/// (Anthropic's); either is taken on any route, as vLLM and Anthropic's gateway do.
fn presented_key(req: &ServiceRequest) -> Option<&str> {
    header_key(req.headers())
}

/// The key in `headers`, as `presented_key` reads it (the router's door reads it too).
pub fn header_key(headers: &actix_web::http::header::HeaderMap) -> Option<&str> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").map(str::trim))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

fn needs_key(st: &ServerState, path: &str) -> bool {
    let open = match path {
        "/health" => st.opts.open_health,
        "/metrics" => st.opts.open_metrics,
        _ => false,
    };
    !open && !st.opts.api_keys.is_empty()
}

/// Why the door is shut to this request, if it is.
fn refusal(st: &ServerState, req: &ServiceRequest) -> Option<HttpResponse> {
    let path = routed_path(req);
    let flavor = flavor_of(path);
    if let Some(allowed) = &st.opts.allowed_hosts {
        let host = req
            .headers()
            .get("host")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !host_allowed(host, allowed) {
            let e = ApiError::status(
                403,
                format!("host `{host}` is not served here (--allowed-hosts)"),
            );
            return Some(error_response(&e, flavor));
        }
    }
    if needs_key(st, path) {
        let e = match presented_key(req) {
            None => Some("no API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"),
            Some(k) if !key_matches(k, &st.opts.api_keys) => Some("the API key is not valid"),
            Some(_) => None,
        };
        if let Some(message) = e {
            return Some(error_response(&ApiError::status(401, message), flavor));
        }
    }
    None
}

fn turned_away(st: &ServerState, why: Refusal, flavor: Flavor) -> HttpResponse {
    match why {
        Refusal::Full => {
            let e = ApiError::status(
                429,
                format!(
                    "the server is at capacity ({} requests running or queued, --max-queued-requests {}); retry later",
                    st.opts.admission_limit(),
                    st.opts.max_queued_requests
                ),
            );
            let mut r = error_response(&e, flavor);
            r.headers_mut()
                .insert(HeaderName::from_static("retry-after"), HeaderValue::from(1));
            r
        }
        Refusal::Closed => error_response(
            &ApiError::status(
                503,
                "the server is shutting down; no new requests are taken",
            ),
            flavor,
        ),
    }
}

pub async fn guard(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let st = req
        .app_data::<web::Data<ServerState>>()
        .cloned()
        .expect("the server state is registered with the app");
    let id = request_id(&st, &req);
    // Health and metrics probes come every few seconds: no span, nothing exported.
    let span = if matches!(routed_path(&req), "/health" | "/metrics") {
        tracing::Span::none()
    } else {
        let span = tracing::info_span!("request", id = %id, method = %req.method(), path = %routed_path(&req));
        super::trace_context::adopt_caller_trace(&span, req.headers());
        span
    };
    let flavor = flavor_of(routed_path(&req));
    let mut ticket: Option<Ticket> = None;
    let early = refusal(&st, &req).or_else(|| {
        if !is_generation(&req) {
            return None;
        }
        if let Err(e) = st.engine() {
            return Some(error_response(&e, flavor));
        }
        match st.gate.enter() {
            Ok(t) => {
                ticket = Some(t);
                None
            }
            Err(why) => Some(turned_away(&st, why, flavor)),
        }
    });
    let mut res = match early {
        Some(r) => {
            span.in_scope(|| tracing::info!(status = r.status().as_u16(), "turned away"));
            req.into_response(r)
        }
        None => {
            req.extensions_mut().insert(RequestTag(id.clone()));
            next.call(req)
                .instrument(span)
                .await?
                .map_into_boxed_body()
                .map_body(|_, body| BoxBody::new(Ticketed { body, ticket }))
        }
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut()
            .insert(HeaderName::from_static(REQUEST_ID), v);
    }
    Ok(res)
}

/// A response body that holds its request's admission ticket until it is dropped.
struct Ticketed {
    body: BoxBody,
    ticket: Option<Ticket>,
}

impl MessageBody for Ticketed {
    type Error = <BoxBody as MessageBody>::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_next(cx);
        if matches!(polled, Poll::Ready(None)) {
            this.ticket = None;
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::key_matches;

    #[test]
    fn keys_match_whole_and_only_whole() {
        let keys = vec!["sk-one".to_string(), "sk-two".to_string()];
        assert!(key_matches("sk-one", &keys));
        assert!(key_matches("sk-two", &keys));
        assert!(!key_matches("sk-on", &keys));
        assert!(!key_matches("sk-one ", &keys));
        assert!(!key_matches("", &keys));
        assert!(!key_matches("sk-one", &[]));
    }
}
