//! `troupe serve --otlp-traces-endpoint`: every request's span (its admission, preemptions
//! and finish as span events) exported over OTLP/HTTP in protobuf to a collector, beside
//! the log lines. A caller's W3C `traceparent` makes the request a child of its trace
//! (`protocol::trace_context`).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::{Layer, Registry};

use crate::error::{Result, TroupeError};

const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The exporter's pipeline; dropping it flushes the spans still buffered.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            crate::notice::notice(&format!("the last spans could not be exported: {e}"));
        }
    }
}

/// The collector's traces URL: as given (scheme lower-cased), or with OTLP's `/v1/traces`
/// path when it has none.
pub fn traces_url(endpoint: &str) -> Result<String> {
    let bad = |why: &str| {
        TroupeError::InvalidInput(format!("--otlp-traces-endpoint `{endpoint}`: {why}"))
    };
    let scheme = endpoint
        .split_once("://")
        .map(|(s, rest)| (s.to_ascii_lowercase(), rest));
    let rest = match scheme.as_ref().map(|(s, rest)| (s.as_str(), *rest)) {
        Some(("http", rest)) => rest,
        Some(("https", _)) => {
            return Err(bad(
                "TLS is not built in; export over http to a collector or agent beside the server",
            ));
        }
        Some((scheme, _)) => {
            return Err(bad(&format!(
                "the scheme is `{scheme}`; OTLP is exported over http (protobuf)"
            )));
        }
        None => {
            return Err(bad(
                "not a URL; give one like http://localhost:4318/v1/traces",
            ));
        }
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() {
        return Err(bad("the URL names no host"));
    }
    let url = match &rest[authority.len()..] {
        "" | "/" => format!("http://{authority}/v1/traces"),
        tail if tail.starts_with('/') => format!("http://{rest}"),
        _ => {
            return Err(bad(
                "give the collector's path, e.g. http://localhost:4318/v1/traces",
            ));
        }
    };
    Ok(url)
}

/// The layer that turns troupe's spans into OpenTelemetry ones and the pipeline behind it
/// (batched, on its own thread). `OTEL_SERVICE_NAME` names the service, `troupe` otherwise.
pub fn otlp_layer(endpoint: &str) -> Result<(Box<dyn Layer<Registry> + Send + Sync>, Telemetry)> {
    let url = traces_url(endpoint)?;
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        // Under the provider's 5 s shutdown wait, so a slow collector still gets the last batch.
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| {
            TroupeError::InvalidInput(format!("--otlp-traces-endpoint `{endpoint}`: {e}"))
        })?;
    let mut resource = Resource::builder();
    let named = std::env::var_os("OTEL_SERVICE_NAME").is_some()
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="));
    if !named {
        resource = resource.with_service_name("troupe");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    // The request's life is told by debug events inside its span; nothing else is exported.
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("troupe"))
        .with_filter(Targets::new().with_target("troupe", Level::DEBUG))
        .boxed();
    Ok((layer, Telemetry { provider }))
}

#[cfg(test)]
mod tests {
    use super::traces_url;

    #[test]
    fn traces_urls() {
        let ok = |e: &str| traces_url(e).unwrap();
        assert_eq!(
            ok("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            ok("http://collector:4318/"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(ok("http://c:9/custom/traces"), "http://c:9/custom/traces");
        assert_eq!(ok("HTTP://c:9/v1/traces?x=1"), "http://c:9/v1/traces?x=1");
        for (bad, why) in [
            ("https://c:4318", "TLS"),
            ("grpc://c:4317", "scheme is `grpc`"),
            ("localhost:4318", "not a URL"),
            ("http:///v1/traces", "no host"),
            ("http://c:4318?x=1", "collector's path"),
        ] {
            let e = traces_url(bad).unwrap_err().to_string();
            assert!(
                e.contains("--otlp-traces-endpoint") && e.contains(why),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_url_the_exporter_cannot_read_is_refused_by_name() {
        let Err(e) = super::otlp_layer("http://bad host:1/v1/traces") else {
            panic!("a URL with a space was taken");
        };
        assert!(
            e.to_string()
                .contains("--otlp-traces-endpoint `http://bad host:1"),
            "{e}"
        );
    }
}
