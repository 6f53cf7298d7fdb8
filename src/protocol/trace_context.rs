//! A caller's W3C trace context (`traceparent`, `tracestate`): a request that carries one
//! becomes a child span of the caller's trace when spans are exported
//! (`troupe serve --otlp-traces-endpoint`); without an exporter this is inert.

use actix_web::http::header::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Parents `span` on the caller's trace when the headers carry a valid `traceparent`; a
/// malformed one is ignored, as the W3C specification asks.
pub fn adopt_caller_trace(span: &tracing::Span, headers: &HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    if cx.span().span_context().is_valid() {
        // Fails only when no OpenTelemetry layer is installed: then there is no trace to join.
        let _ = span.set_parent(cx);
    }
}
