//! The router's `/metrics` in Prometheus' text format: each engine's last report (load,
//! queue, KV held) and the router's counters (routed, re-routed, handed off, KV moved).

use std::collections::BTreeMap;
use std::fmt::Write;

use super::agent::EngineReport;

/// What the router has done since it started.
#[derive(Debug, Default, Clone)]
pub struct Counters {
    /// Requests answered by each engine (a reply came), by node name.
    pub routed: BTreeMap<String, u64>,
    /// Requests answered by another engine than the first picked.
    pub rerouted: u64,
    /// Replies an engine broke off after the client had part of them.
    pub failed_mid_reply: u64,
    /// Prompts prefilled on a prefill engine and their KV handed over, by that engine.
    pub hand_offs: BTreeMap<String, u64>,
    /// Hand-offs that failed (the decode engine then prefilled the prompt itself).
    pub failed_hand_offs: u64,
    /// Hand-offs by the transport their KV took (`shm`, `tcp`).
    pub hand_offs_by_transport: BTreeMap<String, u64>,
    pub kv_blocks_moved: u64,
    pub kv_bytes_moved: u64,
    /// Seconds spent sending KV blocks between engines.
    pub kv_transfer_secs: f64,
    /// Images encoded on an encode engine for another engine's prefill, by that engine.
    pub encoded_images: BTreeMap<String, u64>,
    /// Encode asks that failed (the prefilling engine then encoded the images itself).
    pub failed_encodes: u64,
}

/// The exposition of `reports`, `in_flight` (requests forwarded and not yet answered, by
/// node name) and `c`.
pub fn render(
    reports: &[EngineReport],
    in_flight: &BTreeMap<String, usize>,
    c: &Counters,
) -> String {
    let mut f = Families(String::new());
    engine_families(&mut f, reports, in_flight);
    counter_families(&mut f, c);
    f.0
}

/// The exposition being written, a metric family at a time.
struct Families(String);

impl Families {
    fn family(&mut self, name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in rows {
            let _ = writeln!(self.0, "{name}{labels} {value}");
        }
    }
}

fn one(v: f64) -> Vec<(String, f64)> {
    vec![(String::new(), v)]
}

/// Each engine's last report, and what the router has forwarded to it.
fn engine_families(
    f: &mut Families,
    reports: &[EngineReport],
    in_flight: &BTreeMap<String, usize>,
) {
    let per_engine = |value: &dyn Fn(&EngineReport) -> f64| -> Vec<(String, f64)> {
        reports
            .iter()
            .map(|r| {
                let labels = format!(
                    "{{engine=\"{}\",role=\"{}\"}}",
                    escape(&r.node_name),
                    escape(&r.role)
                );
                (labels, value(r))
            })
            .collect()
    };
    f.family(
        "troupe_router_engines",
        "gauge",
        "Engines in the router's view.",
        one(reports.len() as f64),
    );
    f.family(
        "troupe_router_engine_running",
        "gauge",
        "Requests running on each engine, as it last reported.",
        per_engine(&|r| r.num_running as f64),
    );
    f.family(
        "troupe_router_engine_waiting",
        "gauge",
        "Requests queued on each engine, as it last reported.",
        per_engine(&|r| r.num_waiting as f64),
    );
    f.family(
        "troupe_router_engine_queued_prefill_tokens",
        "gauge",
        "Prompt tokens each engine has queued or admitted and not yet computed.",
        per_engine(&|r| r.num_queued_prefill_tokens as f64),
    );
    f.family(
        "troupe_router_engine_kv_tokens",
        "gauge",
        "Tokens held in each engine's KV cache, as it last reported.",
        per_engine(&|r| r.num_kv_tokens as f64),
    );
    f.family(
        "troupe_router_engine_in_flight",
        "gauge",
        "Requests the router has forwarded to each engine and not yet seen answered.",
        per_engine(&|r| in_flight.get(&r.node_name).copied().unwrap_or(0) as f64),
    );
}

/// The router's own counters.
fn counter_families(f: &mut Families, c: &Counters) {
    let by_name = |m: &BTreeMap<String, u64>| -> Vec<(String, f64)> {
        m.iter()
            .map(|(n, v)| (format!("{{engine=\"{}\"}}", escape(n)), *v as f64))
            .collect()
    };
    f.family(
        "troupe_router_routed_total",
        "counter",
        "Requests each engine answered.",
        by_name(&c.routed),
    );
    f.family(
        "troupe_router_rerouted_total",
        "counter",
        "Requests answered by another engine than the first picked.",
        one(c.rerouted as f64),
    );
    f.family(
        "troupe_router_failed_mid_reply_total",
        "counter",
        "Streams an engine broke off after the client had part of them.",
        one(c.failed_mid_reply as f64),
    );
    f.family(
        "troupe_router_hand_offs_total",
        "counter",
        "Prompts each prefill engine prefilled and handed to a decode engine.",
        by_name(&c.hand_offs),
    );
    f.family(
        "troupe_router_failed_hand_offs_total",
        "counter",
        "Hand-offs that failed (the decode engine prefilled the prompt itself).",
        one(c.failed_hand_offs as f64),
    );
    let by_transport = c.hand_offs_by_transport.iter();
    f.family(
        "troupe_router_hand_offs_by_transport_total",
        "counter",
        "Hand-offs by the transport their KV took: shm (shared memory, the engines on one host) or tcp.",
        by_transport
            .map(|(t, n)| (format!("{{transport=\"{}\"}}", escape(t)), *n as f64))
            .collect(),
    );
    f.family(
        "troupe_router_encoded_images_total",
        "counter",
        "Images each encode engine encoded for another engine's prefill.",
        by_name(&c.encoded_images),
    );
    f.family(
        "troupe_router_failed_encodes_total",
        "counter",
        "Encode asks that failed (the prefilling engine encoded the images itself).",
        one(c.failed_encodes as f64),
    );
    f.family(
        "troupe_router_kv_transferred_bytes_total",
        "counter",
        "Bytes of KV blocks moved from prefill to decode engines.",
        one(c.kv_bytes_moved as f64),
    );
    f.family(
        "troupe_router_kv_transferred_blocks_total",
        "counter",
        "KV blocks moved from prefill to decode engines.",
        one(c.kv_blocks_moved as f64),
    );
    f.family(
        "troupe_router_kv_transfer_seconds_total",
        "counter",
        "Seconds spent sending KV blocks between engines.",
        one(c.kv_transfer_secs),
    );
}

/// A label value as the text format quotes it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
