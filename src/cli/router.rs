//! `troupe router`: the cluster's node (engines connect to it) and its HTTP front.

use clap::Args;

use super::engine_runtime;
use crate::cluster::DEFAULT_COOKIE;
use crate::cluster::registry::{self, Registry};
use crate::cluster::router::{self as front, RouterState};
use crate::error::{Result, TroupeError};
use crate::model::{self, hub};
use crate::protocol::serve_options::default_allowed_hosts;
use crate::route::RouteConfig;
use crate::sync::Shared;

#[derive(Args)]
pub struct RouterArgs {
    /// The served model (its tokenizer and chat template hash prompts as the engines do).
    #[arg(long, default_value = hub::DEFAULT_MODEL)]
    model: String,
    /// The cluster's address, where engines connect (`serve --cluster HOST:PORT`).
    #[arg(long, default_value = "127.0.0.1:9300")]
    listen: String,
    /// The address the HTTP front listens on (`0.0.0.0`: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The HTTP port clients call.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The secret the cluster's nodes share.
    #[arg(long, env = "TROUPE_CLUSTER_COOKIE", default_value = DEFAULT_COOKIE)]
    cluster_cookie: String,
    /// Prompts with more tokens than this left to compute go to a prefill engine first
    /// (where the cluster has one) and their KV to the decode engine; shorter ones are
    /// prefilled by the decode engine.
    #[arg(long, default_value_t = RouteConfig::default().min_hand_off_tokens)]
    min_hand_off_tokens: usize,
    /// Host header values accepted (default on a loopback --host: the loopback names;
    /// elsewhere any), against DNS rebinding as `serve` checks it.
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>>,
    #[command(flatten)]
    api_keys: super::api_keys::ApiKeys,
}

pub fn run_router(args: RouterArgs) -> Result<()> {
    let text = model::load_text(&model::resolve_model_path(&args.model)?)?;
    let (cluster_host, cluster_port) = args
        .listen
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            TroupeError::InvalidInput(format!("--listen {}: expected HOST:PORT", args.listen))
        })?;
    let cluster_ip = super::serve::cluster_ip(&cluster_host, &args.cluster_cookie)?;
    let runtime = engine_runtime()?;
    let registry = Shared::new(Registry::default());
    runtime.block_on(async {
        let server = ractor_cluster::NodeServer::new(
            cluster_port,
            args.cluster_cookie.clone(),
            crate::cluster::agent::ROUTER_NODE_PREFIX
                .trim_end_matches('@')
                .to_string(),
            cluster_host.clone(),
            None,
            // Each engine learns from the router's node of the others and connects to
            // them: prefill engines send KV to decode engines directly.
            Some(ractor_cluster::node::NodeConnectionMode::Transitive),
        )
        .with_listen_addr(cluster_ip);
        ractor::Actor::spawn(None, server, ())
            .await
            .map_err(|e| TroupeError::InvalidInput(format!("--listen {}: {e}", args.listen)))
    })?;
    runtime.spawn(registry::poll(registry.clone()));
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port)).map_err(|e| {
        TroupeError::InvalidInput(format!("cannot serve on {}:{}: {e}", args.host, args.port))
    })?;
    crate::notice::notice(&format!(
        "routing on http://{}:{} for the engines of cluster {}",
        args.host, args.port, args.listen
    ));
    let allowed_hosts = args
        .allowed_hosts
        .clone()
        .or_else(|| default_allowed_hosts(&args.host));
    let mut state = RouterState::new(registry, text, allowed_hosts);
    state.cfg.min_hand_off_tokens = args.min_hand_off_tokens;
    state.api_keys = args.api_keys.checked()?;
    let state = actix_web::web::Data::new(state);
    let server = actix_web::HttpServer::new(move || {
        use actix_web::web;
        actix_web::App::new()
            .app_data(state.clone())
            .app_data(web::PayloadConfig::new(4 << 20))
            .route("/health", web::get().to(front::health))
            .route("/router/engines", web::get().to(front::engines))
            .route("/metrics", web::get().to(front::metrics))
            .default_service(web::to(front::forward))
    })
    .listen(listener)
    .map_err(|e| TroupeError::InvalidInput(e.to_string()))?;
    actix_web::rt::System::new()
        .block_on(server.run())
        .map_err(|e| TroupeError::InvalidInput(e.to_string()))?;
    drop(runtime);
    Ok(())
}
