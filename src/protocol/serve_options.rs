//! `ServeOptions`: what an operator sets on `troupe serve` beyond the engine — the name
//! clients ask for, who may call, from which pages and host names, how many requests may
//! wait, and how long anything may take.

use std::net::IpAddr;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The `model` clients send and `/v1/models` lists.
    pub served_model_name: String,
    /// Keys a client must present (empty: no authentication).
    pub api_keys: Vec<String>,
    /// `/health` and `/metrics` answer without a key.
    pub open_health: bool,
    pub open_metrics: bool,
    /// Origins a browser page may call from (`*`: any); empty: no CORS headers at all.
    pub allowed_origins: Vec<String>,
    /// Host header names accepted (`None`: any).
    pub allowed_hosts: Option<Vec<String>>,
    /// Hosts images may be fetched from by URL (`--allowed-media-domains`; empty: none).
    pub allowed_media_domains: Vec<String>,
    /// Generation requests admitted beyond the engine's running batch; past it, 429.
    pub max_queued_requests: usize,
    /// The engine's running batch (`--max-num-seqs`): admitted without queueing.
    pub max_running_requests: usize,
    /// A generation request's life in the engine, from its submission to its last byte.
    pub request_timeout: Option<Duration>,
    /// How long reading a request's body may take.
    pub body_read_timeout: Duration,
    /// After SIGTERM / SIGINT, how long requests in flight may take to finish.
    pub shutdown_timeout: Duration,
    /// actix-web worker threads (the HTTP side; the engine has its own).
    pub workers: usize,
    /// SIGTERM / SIGINT drain the server (off where the process is not the server's
    /// own, as in tests).
    pub drain_on_signal: bool,
}

impl ServeOptions {
    pub fn new(served_model_name: impl Into<String>) -> Self {
        ServeOptions {
            served_model_name: served_model_name.into(),
            api_keys: Vec::new(),
            open_health: false,
            open_metrics: false,
            allowed_origins: Vec::new(),
            allowed_hosts: None,
            allowed_media_domains: Vec::new(),
            max_queued_requests: 512,
            max_running_requests: 256,
            request_timeout: None,
            body_read_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            workers: std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)),
            drain_on_signal: true,
        }
    }

    /// Requests the admission gate lets in at once.
    pub fn admission_limit(&self) -> usize {
        self.max_running_requests + self.max_queued_requests
    }
}

/// The Host names a server bound to `bind` accepts by default: on loopback only the
/// loopback names (a page on another site that rebinds its DNS name to 127.0.0.1 sends
/// its own name, and is refused); bound beyond loopback, any (the operator names them
/// with `--allowed-hosts`, since the server cannot know its public names).
pub fn default_allowed_hosts(bind: &str) -> Option<Vec<String>> {
    let loopback = bind == "localhost" || bind.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    loopback.then(|| {
        ["localhost", "127.0.0.1", "[::1]", "::1"]
            .map(String::from)
            .to_vec()
    })
}

/// Whether a Host header value (with or without a port) is in `allowed`.
pub fn host_allowed(header: &str, allowed: &[String]) -> bool {
    let name = if let Some(rest) = header.strip_prefix('[') {
        // [v6]:port
        rest.split(']').next().map(|h| format!("[{h}]"))
    } else {
        header
            .rsplit_once(':')
            .map_or(Some(header.to_string()), |(h, port)| {
                Some(if port.chars().all(|c| c.is_ascii_digit()) {
                    h.to_string()
                } else {
                    header.to_string()
                })
            })
    };
    name.is_some_and(|n| allowed.iter().any(|a| a.eq_ignore_ascii_case(&n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_binds_accept_only_loopback_names() {
        let allowed = default_allowed_hosts("127.0.0.1").unwrap();
        assert!(host_allowed("127.0.0.1:8000", &allowed));
        assert!(host_allowed("localhost", &allowed));
        assert!(host_allowed("LOCALHOST:1", &allowed));
        assert!(host_allowed("[::1]:8000", &allowed));
        assert!(!host_allowed("evil.example:8000", &allowed));
        assert!(!host_allowed("localhost.evil.example", &allowed));
        assert!(!host_allowed("", &allowed));
        assert_eq!(default_allowed_hosts("0.0.0.0"), None);
        assert!(default_allowed_hosts("::1").is_some());
    }
}
