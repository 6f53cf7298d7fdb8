//! Prometheus metrics for `troupe serve`: request and token counters and latency
//! histograms that handlers record into, and gauges read from an `EngineStatus` at scrape
//! time.
//!
//! Recording is lock-free (atomics inside `prometheus-client`, plus a read lock on the
//! label family after a label set's first use), so one `Metrics` in an `Arc` is shared by
//! every worker. `render` writes the Prometheus text format 0.0.4 ([`CONTENT_TYPE`]).
//! Engine gauges live in a registry built per render rather than in shared gauges set
//! before encoding: two concurrent scrapes then never mix two statuses in one page.

use prometheus_client::encoding::{EncodeLabelSet, prometheus_text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::api::EngineStatus;

/// The `Content-Type` of what `render` returns.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

const PREFIX: &str = "troupe";

/// Bucket bounds in seconds, vLLM's, so dashboards built for it read the same.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const INTER_TOKEN_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    status: u16,
}

/// A gauge holding an `f64`. Its storage is the gauge's own atomic (prometheus-client's
/// `Atomic` is implemented for std's types only), hence std here and not `crate::sync`.
type FloatGauge = Gauge<f64, crate::sync::GaugeAtomicU64>;

pub struct Metrics {
    /// Counters and histograms; handlers write through the clones below.
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    ttft_secs: Histogram,
    inter_token_secs: Histogram,
    e2e_secs: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let requests = Family::<RequestLabels, Counter>::default();
        // Counter names get their `_total` suffix from the encoder.
        registry.register(
            "requests",
            "HTTP requests by endpoint and response status",
            requests.clone(),
        );
        let prompt_tokens = Counter::default();
        registry.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            prompt_tokens.clone(),
        );
        let generation_tokens = Counter::default();
        registry.register(
            "generation_tokens",
            "Generated tokens",
            generation_tokens.clone(),
        );
        let ttft_secs = Histogram::new(TTFT_BUCKETS);
        registry.register_with_unit(
            "time_to_first_token",
            "Time from receiving a request to its first generated token",
            Unit::Seconds,
            ttft_secs.clone(),
        );
        let inter_token_secs = Histogram::new(INTER_TOKEN_BUCKETS);
        registry.register_with_unit(
            "inter_token_latency",
            "Time between consecutive generated tokens of one request",
            Unit::Seconds,
            inter_token_secs.clone(),
        );
        let e2e_secs = Histogram::new(E2E_BUCKETS);
        registry.register_with_unit(
            "e2e_request_latency",
            "Time from receiving a request to its last token",
            Unit::Seconds,
            e2e_secs.clone(),
        );
        Metrics {
            registry,
            requests,
            prompt_tokens,
            generation_tokens,
            ttft_secs,
            inter_token_secs,
            e2e_secs,
        }
    }

    pub fn record_request(&self, endpoint: &str, status: u16) {
        let labels = RequestLabels {
            endpoint: endpoint.to_string(),
            status,
        };
        self.requests.get_or_create(&labels).inc();
    }

    pub fn record_tokens(&self, num_prompt_tokens: usize, num_generation_tokens: usize) {
        self.prompt_tokens.inc_by(num_prompt_tokens as u64);
        self.generation_tokens.inc_by(num_generation_tokens as u64);
    }

    pub fn observe_ttft_secs(&self, secs: f64) {
        self.ttft_secs.observe(secs);
    }

    pub fn observe_inter_token_secs(&self, secs: f64) {
        self.inter_token_secs.observe(secs);
    }

    pub fn observe_e2e_secs(&self, secs: f64) {
        self.e2e_secs.observe(secs);
    }

    /// The text exposition: everything recorded so far, then the gauges of `status`.
    pub fn render(&self, status: &EngineStatus) -> String {
        let mut text = String::new();
        // Writing into a `String` cannot fail, and our metrics encode no fallible values.
        prometheus_text::encode(&mut text, &self.registry).expect("encoding into a String");
        prometheus_text::encode(&mut text, &status_registry(status))
            .expect("encoding into a String");
        text
    }
}

/// The fraction of the KV pool in use; 0 for an empty pool rather than NaN.
fn kv_cache_usage_ratio(s: &EngineStatus) -> f64 {
    if s.num_total_blocks == 0 {
        return 0.0;
    }
    let free = s.num_free_blocks.min(s.num_total_blocks);
    1.0 - free as f64 / s.num_total_blocks as f64
}

fn prefix_cache_hit_ratio(s: &EngineStatus) -> f64 {
    if s.num_prefix_queried_blocks == 0 {
        return 0.0;
    }
    s.num_prefix_hit_blocks as f64 / s.num_prefix_queried_blocks as f64
}

fn status_registry(s: &EngineStatus) -> Registry {
    let mut registry = Registry::with_prefix(PREFIX);
    let mut int_gauge = |name: &str, help: &str, value: usize| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(value).unwrap_or(i64::MAX));
        registry.register(name, help, g);
    };
    int_gauge(
        "num_requests_running",
        "Requests scheduled on the device",
        s.num_running,
    );
    int_gauge(
        "num_requests_waiting",
        "Requests queued for admission",
        s.num_waiting,
    );
    int_gauge(
        "num_queued_prefill_tokens",
        "Prompt tokens queued or admitted and not yet computed",
        s.num_queued_prefill_tokens,
    );
    int_gauge(
        "kv_cache_total_blocks",
        "Blocks in the paged KV pool",
        s.num_total_blocks,
    );
    let mut float_gauge = |name: &str, help: &str, value: f64| {
        let g = FloatGauge::default();
        g.set(value);
        registry.register(name, help, g);
    };
    float_gauge(
        "kv_cache_usage_ratio",
        "Fraction of KV blocks in use (1 - free / total)",
        kv_cache_usage_ratio(s),
    );
    float_gauge(
        "moe_lb",
        "EPLB: the worst MoE layer's slowest-rank load over the mean (0: no statistics)",
        s.moe_lb,
    );
    float_gauge(
        "moe_lb_measured",
        "EPLB: the slowest expert-parallel rank's busy time over the mean since the placement last changed (0: not measured)",
        s.measured_moe_lb,
    );
    float_gauge(
        "prefix_cache_hit_ratio",
        "Prefix-cache hit blocks over queried blocks since start",
        prefix_cache_hit_ratio(s),
    );
    let mut counter = |name: &str, help: &str, value: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        registry.register(name, help, c);
    };
    counter(
        "spec_verify_rows",
        "Decode rows that verified draft tokens (speculative decoding)",
        s.num_spec_verify_rows,
    );
    counter(
        "spec_draft_tokens",
        "Draft tokens proposed (the confidence budget's cuts included)",
        s.num_spec_draft_tokens,
    );
    counter(
        "spec_verified_tokens",
        "Draft tokens verified",
        s.num_spec_verified_tokens,
    );
    counter(
        "spec_accepted_tokens",
        "Draft tokens accepted",
        s.num_spec_accepted_tokens,
    );
    counter(
        "spec_sat_out_rows",
        "Steps a speculating sequence sat out waiting for its drafts' verification",
        s.num_spec_sat_out_rows,
    );
    counter(
        "host_sampled_rows",
        "Sampled rows whose logits were copied to the host's sampler",
        s.num_host_sampled_rows,
    );
    counter(
        "swa_resumed_hits",
        "DeepSeek-V4 prefix hits resumed from a saved sliding-window state (no replay)",
        s.num_resumed_hits,
    );
    counter(
        "swa_replayed_hits",
        "DeepSeek-V4 prefix hits that replayed the tokens before the hit to rebuild the state",
        s.num_replayed_hits,
    );
    let k = &s.kv_store;
    counter(
        "kv_store_bytes_read",
        "Prefix store: bytes read from disk",
        k.bytes_read,
    );
    counter(
        "kv_store_bytes_written",
        "Prefix store: bytes written to disk",
        k.bytes_written,
    );
    counter(
        "kv_store_corrupt_blocks",
        "Prefix store: disk blocks that failed their checksum or key (treated as misses)",
        k.corrupt_blocks,
    );
    counter(
        "encoded_images",
        "Images the vision encoder encoded (each once per engine while its rows are cached)",
        s.num_encoded_images,
    );
    counter(
        "image_cache_hits",
        "Image lookups that found the encoder's rows cached (a repeated image, or encoded ahead)",
        s.num_image_cache_hits,
    );
    counter(
        "received_images",
        "Images whose encoder rows an encode engine sent here (E/P/D)",
        s.num_received_images,
    );
    counter(
        "kv_store_dropped_writes",
        "Prefix store: blocks not written to disk because the writer was behind",
        k.dropped_writes,
    );
    let hits = Family::<TierLabels, Counter>::default();
    let evictions = Family::<TierLabels, Counter>::default();
    for (tier, hit, evicted) in [
        ("device", s.num_prefix_hit_blocks, 0),
        ("host", k.host_hit_blocks, k.host_evictions),
        ("disk", k.disk_hit_blocks, k.disk_evictions + k.disk_expired),
    ] {
        let labels = TierLabels { tier };
        hits.get_or_create(&labels).inc_by(hit);
        evictions.get_or_create(&labels).inc_by(evicted);
    }
    registry.register(
        "prefix_hit_blocks",
        "Prompt blocks found in each tier of the prefix cache (device, host memory, disk)",
        hits,
    );
    registry.register(
        "prefix_evicted_blocks",
        "Blocks dropped from each tier (the disk's past their time to live included)",
        evictions,
    );
    // Per draft position, where any row reached it.
    let verified = Family::<PositionLabels, Counter>::default();
    let accepted = Family::<PositionLabels, Counter>::default();
    for (i, (&v, &a)) in s
        .spec_verified_by_position
        .iter()
        .zip(&s.spec_accepted_by_position)
        .enumerate()
        .filter(|(_, (v, _))| **v > 0)
    {
        let labels = PositionLabels { position: i };
        verified.get_or_create(&labels).inc_by(v);
        accepted.get_or_create(&labels).inc_by(a);
    }
    registry.register(
        "spec_verified_by_position",
        "Drafts verified at each draft position (0: the first draft of a row)",
        verified,
    );
    registry.register(
        "spec_accepted_by_position",
        "Drafts accepted at each draft position (every earlier draft of the row accepted)",
        accepted,
    );
    registry
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PositionLabels {
    position: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample line `series` (name plus label block, exactly as printed).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|line| {
            let value = line.strip_prefix(series)?.strip_prefix(' ')?;
            value.trim().parse().ok()
        })
    }

    fn approx(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Metrics>();
    }

    #[test]
    fn counters_count_per_label_set() {
        let m = Metrics::new();
        m.record_request("/v1/completions", 200);
        m.record_request("/v1/completions", 200);
        m.record_request("/v1/completions", 400);
        m.record_request("/v1/chat/completions", 200);
        m.record_tokens(10, 3);
        m.record_tokens(5, 4);
        let text = m.render(&EngineStatus::default());
        let req = |endpoint: &str, status: u16| {
            sample(
                &text,
                &format!("troupe_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
            )
        };
        assert_eq!(req("/v1/completions", 200), Some(2.0), "{text}");
        assert_eq!(req("/v1/completions", 400), Some(1.0), "{text}");
        assert_eq!(req("/v1/chat/completions", 200), Some(1.0), "{text}");
        assert_eq!(req("/v1/chat/completions", 400), None, "{text}");
        assert_eq!(sample(&text, "troupe_prompt_tokens_total"), Some(15.0));
        assert_eq!(sample(&text, "troupe_generation_tokens_total"), Some(7.0));
        assert!(
            text.contains("# TYPE troupe_requests_total counter"),
            "{text}"
        );
    }

    #[test]
    fn histograms_count_sum_and_bucket() {
        let m = Metrics::new();
        for secs in [0.003, 0.05, 0.3] {
            m.observe_ttft_secs(secs);
        }
        m.observe_inter_token_secs(0.02);
        m.observe_inter_token_secs(0.02);
        m.observe_e2e_secs(3.0);
        let text = m.render(&EngineStatus::default());
        let name = "troupe_time_to_first_token_seconds";
        assert_eq!(sample(&text, &format!("{name}_count")), Some(3.0), "{text}");
        assert!(
            approx(sample(&text, &format!("{name}_sum")), 0.353),
            "{text}"
        );
        // Buckets are cumulative: le=0.005 holds 0.003; le=0.06 adds 0.05; le=0.5 adds 0.3.
        let bucket = |le: &str| sample(&text, &format!("{name}_bucket{{le=\"{le}\"}}"));
        assert_eq!(bucket("0.001"), Some(0.0), "{text}");
        assert_eq!(bucket("0.005"), Some(1.0), "{text}");
        assert_eq!(bucket("0.06"), Some(2.0), "{text}");
        assert_eq!(bucket("0.25"), Some(2.0), "{text}");
        assert_eq!(bucket("0.5"), Some(3.0), "{text}");
        assert_eq!(bucket("+Inf"), Some(3.0), "{text}");
        let itl = "troupe_inter_token_latency_seconds";
        assert_eq!(sample(&text, &format!("{itl}_count")), Some(2.0));
        assert!(approx(sample(&text, &format!("{itl}_sum")), 0.04));
        let e2e = "troupe_e2e_request_latency_seconds";
        assert_eq!(sample(&text, &format!("{e2e}_count")), Some(1.0));
        assert!(approx(sample(&text, &format!("{e2e}_sum")), 3.0));
        assert!(text.contains(&format!("# TYPE {e2e} histogram")), "{text}");
    }

    #[test]
    fn gauges_come_from_the_status() {
        let m = Metrics::new();
        let status = EngineStatus {
            num_running: 3,
            num_waiting: 2,
            num_free_blocks: 25,
            num_total_blocks: 100,
            num_prefix_queried_blocks: 8,
            num_prefix_hit_blocks: 6,
            num_spec_verify_rows: 4,
            kv_store: crate::api::KvStoreStats {
                host_hit_blocks: 5,
                disk_hit_blocks: 7,
                disk_evictions: 2,
                disk_expired: 1,
                bytes_written: 4096,
                ..Default::default()
            },
            num_spec_draft_tokens: 26,
            num_spec_verified_tokens: 20,
            num_spec_accepted_tokens: 11,
            spec_verified_by_position: {
                let mut v = [0; 16];
                v[..5].copy_from_slice(&[4, 4, 4, 4, 4]);
                v
            },
            spec_accepted_by_position: {
                let mut a = [0; 16];
                a[..4].copy_from_slice(&[4, 3, 3, 1]);
                a
            },
            ..Default::default()
        };
        let text = m.render(&status);
        assert_eq!(sample(&text, "troupe_spec_verify_rows_total"), Some(4.0));
        assert_eq!(sample(&text, "troupe_spec_draft_tokens_total"), Some(26.0));
        assert_eq!(
            sample(&text, "troupe_spec_verified_tokens_total"),
            Some(20.0)
        );
        let at = |name: &str, p: usize| {
            sample(
                &text,
                &format!("troupe_spec_{name}_by_position_total{{position=\"{p}\"}}"),
            )
        };
        assert_eq!(at("verified", 4), Some(4.0), "{text}");
        assert_eq!(at("accepted", 1), Some(3.0), "{text}");
        assert_eq!(at("accepted", 4), Some(0.0), "{text}");
        assert_eq!(at("verified", 5), None, "{text}");
        assert_eq!(
            sample(&text, "troupe_spec_accepted_tokens_total"),
            Some(11.0)
        );
        let tier = |name: &str, t: &str| {
            sample(
                &text,
                &format!("troupe_prefix_{name}_blocks_total{{tier=\"{t}\"}}"),
            )
        };
        assert_eq!(tier("hit", "device"), Some(6.0), "{text}");
        assert_eq!(tier("hit", "host"), Some(5.0), "{text}");
        assert_eq!(tier("hit", "disk"), Some(7.0), "{text}");
        assert_eq!(tier("evicted", "disk"), Some(3.0), "{text}");
        assert_eq!(
            sample(&text, "troupe_kv_store_bytes_written_total"),
            Some(4096.0)
        );
        assert_eq!(sample(&text, "troupe_num_requests_running"), Some(3.0));
        assert_eq!(sample(&text, "troupe_num_requests_waiting"), Some(2.0));
        assert_eq!(sample(&text, "troupe_kv_cache_total_blocks"), Some(100.0));
        assert!(approx(sample(&text, "troupe_kv_cache_usage_ratio"), 0.75));
        assert!(approx(sample(&text, "troupe_prefix_cache_hit_ratio"), 0.75));
        assert!(
            text.contains("# TYPE troupe_kv_cache_usage_ratio gauge"),
            "{text}"
        );

        // A later scrape shows the new status, not a mix.
        let idle = EngineStatus {
            num_free_blocks: 100,
            num_total_blocks: 100,
            ..Default::default()
        };
        let text = m.render(&idle);
        assert_eq!(sample(&text, "troupe_num_requests_running"), Some(0.0));
        assert!(approx(sample(&text, "troupe_kv_cache_usage_ratio"), 0.0));
    }

    #[test]
    fn ratios_are_zero_when_undefined() {
        let text = Metrics::new().render(&EngineStatus::default());
        assert_eq!(
            sample(&text, "troupe_kv_cache_usage_ratio"),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "troupe_prefix_cache_hit_ratio"),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "troupe_kv_cache_total_blocks"),
            Some(0.0),
            "{text}"
        );
        assert!(!text.contains("NaN"), "{text}");
    }
}
