//! `troupe serve`: its flags and its run — the port is bound first and answers 503 while
//! the model loads; the server runs until SIGTERM / SIGINT has drained it.

use std::time::Duration;

use clap::{Args, ValueEnum};

use super::engine_runtime;
use crate::cluster::agent::{self, JoinConfig};
use crate::cluster::encode_agent;
use crate::engine::flags::{EngineFlags, parse_duration};
use crate::engine::{Engine, EngineError, ImageEngine};
use crate::error::{Result, TroupeError};
use crate::model::hub;
use crate::protocol::serve_options::{ServeOptions, default_allowed_hosts};
use crate::protocol::server::Served;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OpenRoute {
    Health,
    Metrics,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    /// One JSON object a line, with the request's span fields.
    Json,
}

#[derive(Args)]
pub struct ServeArgs {
    /// A known model name, a GGUF file or an HF model directory.
    #[arg(long, default_value = hub::DEFAULT_MODEL)]
    model: String,
    /// The model as `vllm serve MODEL` takes it: the same as --model.
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    model_positional: Option<String>,
    /// The name clients send as `model` and `/v1/models` lists (default: --model).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The address to listen on (`0.0.0.0`: every interface; then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The HTTP port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Join the cluster of `troupe router --listen HOST:PORT` as one of its engines.
    #[arg(long, value_name = "HOST:PORT")]
    cluster: Option<String>,
    /// What this engine does in the cluster: both prefill and decode (a data-parallel
    /// replica), or only one of them (prefill/decode disaggregation: the router has a
    /// prefill engine prefill each prompt and hand its KV to a decode engine). The KV moves
    /// through the prefix store (a 1 GiB host tier unless --kv-host-cache-bytes says).
    /// `encode` (a vision-language model): this engine only encodes requests' images, the
    /// router picking it by the fewest image patches in flight, and sends the rows to the
    /// engines that prefill them (E/P/D).
    #[arg(long, value_enum, default_value = "both", requires = "cluster")]
    role: ClusterRole,
    /// On SIGTERM, move the requests a peer can continue exactly (one completion, no
    /// grammar, no frequency or presence penalty, no prompt scores) with their KV to the
    /// engine named here, or with `auto` to the least loaded other engine that decodes;
    /// their clients' streams go on through this process. The rest finish here.
    #[arg(long, value_name = "NODE|auto", requires = "cluster")]
    drain_to: Option<String>,
    /// How this engine's KV blocks reach a peer (prefill/decode hand-offs, drains):
    /// `auto` through shared memory to a peer on this host (a region only this user can
    /// open, proven by the cluster's cookie), over the cluster's TCP connection to others
    /// or where shared memory fails; `tcp` always over TCP.
    #[arg(long, value_enum, default_value = "auto", requires = "cluster")]
    kv_transport: KvTransportArg,
    /// This engine's name in the cluster, unique in it (default: engine-HOST-PORT).
    #[arg(long, requires = "cluster")]
    node_name: Option<String>,
    /// The secret the cluster's nodes share.
    #[arg(long, env = "TROUPE_CLUSTER_COOKIE", default_value = crate::cluster::DEFAULT_COOKIE)]
    cluster_cookie: String,
    #[command(flatten)]
    api_keys: super::api_keys::ApiKeys,
    /// Routes that answer without a key when keys are set: `health`, `metrics`.
    #[arg(long, value_enum, value_delimiter = ',')]
    open_routes: Vec<OpenRoute>,
    /// Origins browser pages may call from (`*`: any). Default: none (no CORS headers,
    /// so browsers keep other sites' pages out).
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Host header names accepted. Default: on a loopback address only the loopback names
    /// (a DNS-rebinding page sends its own name); elsewhere any.
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Hosts whose images requests may give by http(s) URL (vLLM's flag); the server
    /// fetches them (10 s, 20 MiB, no redirects). Default: none, base64 data URLs only.
    #[arg(long, value_delimiter = ',')]
    allowed_media_domains: Vec<String>,
    /// Generation requests admitted beyond the running batch (--max-num-seqs); past
    /// them a request gets 429 with Retry-After at once.
    #[arg(long, default_value_t = 512)]
    max_queued_requests: usize,
    /// A request still waiting for admission after this long ends with an error
    /// (`30`, `90s`, `2m`). Default: no limit.
    #[arg(long, value_parser = parse_duration)]
    queue_timeout: Option<Duration>,
    /// A generation request is stopped with an error after this long. Default: no limit.
    #[arg(long, value_parser = parse_duration)]
    request_timeout: Option<Duration>,
    /// A request body not received within this long is refused (408).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    body_read_timeout: Duration,
    /// After SIGTERM / SIGINT, how long requests in flight may take to finish before
    /// they end with an error.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    shutdown_timeout: Duration,
    /// Rank / sampler restarts allowed within --rank-restart-window before the engine
    /// counts a failure as permanent (then `/health` is 503 with the reason).
    #[arg(long, default_value_t = 8)]
    max_rank_restarts: usize,
    /// The window --max-rank-restarts counts restarts in (`10m`, `1h`).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    rank_restart_window: Duration,
    /// HTTP worker threads (default: the machine's cores, 2 to 8).
    #[arg(long)]
    http_workers: Option<usize>,
    /// Log lines as text or JSON (RUST_LOG filters them; default `warn`).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Export every request's span over OTLP/HTTP (protobuf) to this collector URL, e.g.
    /// http://localhost:4318/v1/traces; a `traceparent` header joins the caller's trace.
    #[arg(long)]
    pub otlp_traces_endpoint: Option<String>,
    #[command(flatten)]
    engine: EngineFlags,
    /// The ids of the flags given, not left at their defaults (`--role encode` refuses
    /// those that do not apply to it).
    #[arg(skip)]
    pub given: Vec<String>,
}

impl ServeArgs {
    /// The model to serve: the positional one, else --model.
    fn model(&self) -> &str {
        self.model_positional.as_deref().unwrap_or(&self.model)
    }

    fn options(&self, max_num_seqs: usize) -> Result<ServeOptions> {
        let mut opts = ServeOptions::new(
            self.served_model_name
                .clone()
                .unwrap_or_else(|| self.model().to_string()),
        );
        opts.api_keys = self.api_keys.checked()?;
        opts.open_health = self.open_routes.contains(&OpenRoute::Health);
        opts.open_metrics = self.open_routes.contains(&OpenRoute::Metrics);
        if opts.api_keys.is_empty() && !self.open_routes.is_empty() {
            return Err(TroupeError::InvalidInput(
                "--open-routes names routes open without a key: give --api-key too".into(),
            ));
        }
        opts.allowed_origins = self.allowed_origins.clone();
        opts.allowed_media_domains = self.allowed_media_domains.clone();
        opts.allowed_hosts = if self.allowed_hosts.is_empty() {
            default_allowed_hosts(&self.host)
        } else {
            Some(self.allowed_hosts.clone())
        };
        if self.max_queued_requests == 0 {
            return Err(TroupeError::InvalidInput(
                "--max-queued-requests must be at least 1".into(),
            ));
        }
        opts.max_queued_requests = self.max_queued_requests;
        opts.max_running_requests = max_num_seqs;
        opts.request_timeout = self.request_timeout;
        opts.body_read_timeout = self.body_read_timeout;
        opts.shutdown_timeout = self.shutdown_timeout;
        if let Some(n) = self.http_workers {
            opts.workers = n.max(1);
        }
        Ok(opts)
    }
}

/// `--role`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ClusterRole {
    Both,
    Prefill,
    Decode,
    Encode,
}

/// `--kv-transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum KvTransportArg {
    Auto,
    Tcp,
}

/// The host tier a prefill or decode engine keeps KV blocks in unless told otherwise.
const HAND_OFF_HOST_CACHE_BYTES: usize = 1 << 30;

/// Serve flags an encode engine has no use for: it answers no requests and moves none.
const NOT_FOR_ENCODE: [&str; 10] = [
    "served_model_name",
    "drain_to",
    "kv_transport",
    "allowed_media_domains",
    "max_queued_requests",
    "queue_timeout",
    "request_timeout",
    "body_read_timeout",
    "max_rank_restarts",
    "rank_restart_window",
];

/// `--role encode` loads the vision tower alone: the language model's flags (every
/// engine flag but `--device`) and those of requests are refused by name.
fn refuse_for_encode(given: &[String]) -> Result<()> {
    let flags = EngineFlags::augment_args(clap::Command::new("engine"));
    let engine_ids: Vec<&str> = flags.get_arguments().map(|a| a.get_id().as_str()).collect();
    let refused: Vec<String> = (given.iter())
        .filter(|id| {
            (engine_ids.contains(&id.as_str()) && *id != "device")
                || NOT_FOR_ENCODE.contains(&id.as_str())
        })
        .map(|id| format!("--{}", id.replace('_', "-")))
        .collect();
    match refused.is_empty() {
        true => Ok(()),
        false => Err(TroupeError::InvalidInput(format!(
            "--role encode runs the model's vision encoder alone, without its language model: \
             {} do not apply to it",
            refused.join(", ")
        ))),
    }
}

pub fn run_serve(args: ServeArgs) -> Result<()> {
    let encodes = args.role == ClusterRole::Encode;
    if encodes {
        refuse_for_encode(&args.given)?;
    }
    let path = args.engine.model_path(args.model())?;
    let mut cfg = args.engine.config(&path)?;
    let moves_kv = !matches!(args.role, ClusterRole::Both | ClusterRole::Encode);
    if (moves_kv || args.drain_to.is_some()) && cfg.kv_store.host_bytes == 0 {
        cfg.kv_store.host_bytes = HAND_OFF_HOST_CACHE_BYTES;
    }
    cfg.queue_timeout = args.queue_timeout;
    cfg.max_rank_restarts = args.max_rank_restarts;
    cfg.rank_restart_window = args.rank_restart_window;
    let opts = args.options(cfg.max_num_seqs)?;
    let serving = || format!("cannot serve on {}:{}", args.host, args.port);
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .map_err(|e| TroupeError::InvalidInput(format!("{}: {e}", serving())))?;
    if opts.api_keys.is_empty() && opts.allowed_hosts.is_none() {
        tracing::warn!(
            "serving on {} with no --api-key and no --allowed-hosts: anyone who reaches the port can use it",
            args.host
        );
    }
    let runtime = engine_runtime()?;
    let listen_ip = match &args.cluster {
        Some(_) => Some(cluster_ip(&args.host, &args.cluster_cookie)?),
        None => None,
    };
    let join = args
        .cluster
        .clone()
        .zip(listen_ip)
        .map(|(router, listen_ip)| JoinConfig {
            router,
            node_name: args
                .node_name
                .clone()
                .unwrap_or_else(|| format!("engine-{}-{}", args.host, args.port)),
            cookie: args.cluster_cookie.clone(),
            http_url: format!("http://{}:{}", args.host, args.port),
            role: format!("{:?}", args.role).to_lowercase(),
            block_size: cfg.block_size,
            listen_ip,
            kv_shared_memory: args.kv_transport == KvTransportArg::Auto,
        });
    let state = crate::protocol::server::state(opts);
    let (hooked, drain_to) = (state.clone(), args.drain_to.clone());
    let shutdown_timeout = args.shutdown_timeout;
    let loading = runtime.spawn(async move {
        if encodes {
            let encoder =
                (ImageEngine::load(&cfg.model_path, cfg.device).await).map_err(|e| match e {
                    EngineError::Spawn(why) => EngineError::Spawn(format!("--role encode: {why}")),
                    other => other,
                })?;
            if let Some(join) = join {
                let agent = encode_agent::join(encoder.clone(), join)
                    .await
                    .map_err(EngineError::Spawn)?;
                hooked.set_drain_hook(Box::new(move || {
                    Box::pin(agent::drain(agent.clone(), None, shutdown_timeout))
                }));
            }
            return Ok(Served::Encoder(encoder));
        }
        let engine = Engine::spawn(cfg).await?;
        if let Some(join) = join {
            // The engine answers HTTP only once it is in the cluster: a router that
            // sees it can send to it.
            let agent = agent::join(engine.clone(), join)
                .await
                .map_err(EngineError::Spawn)?;
            // On SIGTERM the cluster hears of it first: nothing new comes here, and
            // with --drain-to the requests move.
            hooked.set_drain_hook(Box::new(move || {
                Box::pin(agent::drain(
                    agent.clone(),
                    drain_to.clone(),
                    shutdown_timeout,
                ))
            }));
        }
        Ok(Served::Engine(engine))
    });
    crate::notice::notice(&format!(
        "serving on http://{}:{} (answering 503 until the model is loaded)",
        args.host, args.port
    ));
    crate::protocol::server::serve_on(state.clone(), listener, Some(loading))
        .map_err(|e| TroupeError::InvalidInput(format!("{}: {e}", serving())))?;
    drop(runtime);
    match (state.engine(), state.failure()) {
        (Err(_), Some(reason)) => Err(TroupeError::InvalidInput(reason.to_string())),
        _ => Ok(()),
    }
}

/// The address a cluster node listens on: the given host, which the router (and its
/// clients' requests) reach it by, so not a wildcard; off loopback only with a cookie of
/// the deployment's own.
pub(super) fn cluster_ip(host: &str, cookie: &str) -> Result<std::net::IpAddr> {
    let ip: std::net::IpAddr = if host == "localhost" {
        std::net::Ipv4Addr::LOCALHOST.into()
    } else {
        host.parse().map_err(|_| {
            TroupeError::InvalidInput(format!("--host {host}: a cluster node needs an IP address"))
        })?
    };
    if ip.is_unspecified() {
        return Err(TroupeError::InvalidInput(format!(
            "--host {host} with --cluster: the router reaches an engine at its --host, so give a routable address"
        )));
    }
    if !ip.is_loopback() && cookie == crate::cluster::DEFAULT_COOKIE {
        return Err(TroupeError::InvalidInput(
            "--cluster-cookie (or TROUPE_CLUSTER_COOKIE): a cluster off loopback needs a secret of its own".into(),
        ));
    }
    Ok(ip)
}
