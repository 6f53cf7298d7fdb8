//! `troupe serve`: the HTTP front end (actix-web) — its routes, `/health`, `/v1/models`
//! and `/metrics`, the middleware every request passes (CORS, then `guard`), and the
//! server's life: it answers (503) while the model loads, and on SIGTERM or SIGINT it
//! drains — no new requests, those in flight finish within `--shutdown-timeout`, the rest
//! end with an error — then shuts the engine down and exits.

use std::time::{Duration, Instant};

use actix_cors::Cors;
use actix_web::dev::ServerHandle;
use actix_web::middleware::{Condition, from_fn};
use actix_web::{App, HttpResponse, HttpServer, web};
use serde_json::json;

use super::api::{ApiError, Flavor};
use super::guard;
use super::http::{ServerState, error_response};
use super::serve_options::ServeOptions;
use super::{anthropic, completions, openai, responses, tokenize};
use crate::engine::{EngineError, EngineHandle, ImageEngine};

pub use super::http::MAX_BODY_BYTES;

/// What a server serves once loaded: an engine, or an encode engine's encoder alone.
pub enum Served {
    Engine(EngineHandle),
    Encoder(ImageEngine),
}

/// An engine being loaded on the engine's runtime.
pub type Loading = tokio::task::JoinHandle<Result<Served, EngineError>>;

fn unhealthy(status: &str, reason: Option<&str>) -> HttpResponse {
    HttpResponse::ServiceUnavailable().json(json!({"status": status, "reason": reason}))
}

async fn health(st: web::Data<ServerState>) -> HttpResponse {
    if let Some(reason) = st.failure() {
        return unhealthy("failed", Some(reason));
    }
    if st.encoder().is_some() {
        return match st.gate.is_closed() {
            true => unhealthy("draining", None),
            false => HttpResponse::Ok().json(json!({"status": "ok", "role": "encode"})),
        };
    }
    let Ok(engine) = st.engine() else {
        return unhealthy("loading", None);
    };
    if st.gate.is_closed() {
        return unhealthy("draining", None);
    }
    match engine.status().await {
        Ok(s) => match s.failure {
            Some(reason) => unhealthy("failed", Some(&reason)),
            None => HttpResponse::Ok().json(json!({"status": "ok"})),
        },
        Err(e) => unhealthy("failed", Some(&e.to_string())),
    }
}

async fn models(st: web::Data<ServerState>) -> HttpResponse {
    match st.engine() {
        Ok(engine) => HttpResponse::Ok().json(json!({
            "object": "list",
            "data": [{"id": st.opts.served_model_name, "object": "model", "created": 0,
                      "owned_by": "troupe",
                      "max_model_len": engine.text().config.max_context_tokens}],
        })),
        Err(e) => error_response(&e, Flavor::OpenAi),
    }
}

/// `GET /v1/models/{id}`: the served model, or OpenAI's 404 for any other id.
async fn model(st: web::Data<ServerState>, id: web::Path<String>) -> HttpResponse {
    if *id != st.opts.served_model_name {
        let e = ApiError::status(
            404,
            format!(
                "model `{id}` is not served here (this server serves `{}`)",
                st.opts.served_model_name
            ),
        );
        return error_response(&e, Flavor::OpenAi);
    }
    match st.engine() {
        Ok(engine) => HttpResponse::Ok().json(json!({
            "id": st.opts.served_model_name, "object": "model", "created": 0,
            "owned_by": "troupe", "max_model_len": engine.text().config.max_context_tokens})),
        Err(e) => error_response(&e, Flavor::OpenAi),
    }
}

async fn metrics(st: web::Data<ServerState>) -> HttpResponse {
    let status = match (st.encoder(), st.engine()) {
        (Some(encoder), _) => Ok(encoder.status()),
        (None, engine) => status_of(engine).await,
    };
    match status {
        Ok(status) => HttpResponse::Ok()
            .content_type(super::metrics::CONTENT_TYPE)
            .body(st.metrics.render(&status)),
        Err(e) => error_response(&e, Flavor::OpenAi),
    }
}

async fn status_of(
    engine: Result<&EngineHandle, ApiError>,
) -> Result<crate::engine::EngineStatus, ApiError> {
    match engine {
        Ok(engine) => engine
            .status()
            .await
            .map_err(|e| ApiError::status(503, e.to_string())),
        Err(e) => Err(e),
    }
}

async fn not_found(req: actix_web::HttpRequest) -> HttpResponse {
    let e = ApiError::status(
        404,
        format!("no such route: {} {}", req.method(), req.path()),
    );
    error_response(&e, guard::flavor_of(req.path()))
}

/// The routes, for `serve` and for in-process tests.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/metrics", web::get().to(metrics))
        .route("/v1/models", web::get().to(models))
        .route("/v1/models/{id}", web::get().to(model))
        .route(
            "/v1/chat/completions",
            web::post().to(openai::chat_completions),
        )
        .route("/v1/completions", web::post().to(completions::completions))
        .route("/v1/responses", web::post().to(responses::create))
        .route("/v1/messages", web::post().to(anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            web::post().to(anthropic::count_tokens),
        )
        .route("/tokenize", web::post().to(tokenize::tokenize))
        .route("/detokenize", web::post().to(tokenize::detokenize))
        .route("/version", web::get().to(tokenize::version))
        .route("/tokenizer_info", web::get().to(tokenize::tokenizer_info))
        .default_service(web::to(not_found));
}

fn cors(origins: &[String]) -> Cors {
    let cors = Cors::default()
        .allow_any_method()
        .allow_any_header()
        .expose_headers([guard::REQUEST_ID, "retry-after"])
        .max_age(3600);
    if origins.iter().any(|o| o == "*") {
        return cors.allow_any_origin();
    }
    origins
        .iter()
        .fold(cors, |cors, origin| cors.allowed_origin(origin))
}

pub fn state(opts: ServeOptions) -> web::Data<ServerState> {
    web::Data::new(ServerState::new(opts))
}

/// Serves `state` on `listener` until the server is stopped: by SIGTERM / SIGINT (after
/// a drain), or when `loading` fails. With `loading`, the engine is set when it is done;
/// without, `state` has its engine already.
pub fn serve_on(
    state: web::Data<ServerState>,
    listener: std::net::TcpListener,
    loading: Option<Loading>,
) -> std::io::Result<()> {
    let opts = state.opts.clone();
    let app_state = state.clone();
    let server = HttpServer::new(move || {
        let origins = &app_state.opts.allowed_origins;
        App::new()
            .app_data(app_state.clone())
            .wrap(from_fn(guard::guard))
            // Outermost: a preflight is answered before the key is asked for.
            .wrap(Condition::new(!origins.is_empty(), cors(origins)))
            .configure(configure)
    })
    .workers(opts.workers)
    .disable_signals()
    // The drain has waited for the requests already; what is left are idle connections.
    .shutdown_timeout(1)
    .listen(listener)?;
    actix_web::rt::System::new().block_on(async move {
        let server = server.run();
        let handle = server.handle();
        if let Some(loading) = loading {
            actix_web::rt::spawn(load(state.clone(), loading, handle.clone()));
        }
        if state.opts.drain_on_signal {
            actix_web::rt::spawn(drain_on_signal(state, handle));
        }
        server.await
    })
}

async fn load(st: web::Data<ServerState>, loading: Loading, server: ServerHandle) {
    match loading.await {
        Ok(Ok(Served::Engine(engine))) => {
            st.set_engine(engine);
            crate::notice::notice("the model is loaded");
        }
        Ok(Ok(Served::Encoder(encoder))) => {
            st.set_encoder(encoder);
            crate::notice::notice("the vision encoder is loaded (an encode engine)");
        }
        Ok(Err(e)) => {
            st.set_failure(e.to_string());
            server.stop(false).await;
        }
        Err(e) => {
            st.set_failure(format!("the engine's start was lost: {e}"));
            server.stop(false).await;
        }
    }
}

async fn drain_on_signal(st: web::Data<ServerState>, server: ServerHandle) {
    let name = match shutdown_signal().await {
        Ok(name) => name,
        Err(e) => {
            tracing::error!("cannot listen for shutdown signals ({e}); SIGTERM will not drain");
            return;
        }
    };
    crate::notice::notice(&format!(
        "{name}: draining ({} requests in flight, up to {} s; signal again to exit now)",
        st.gate.num_inside(),
        st.opts.shutdown_timeout.as_secs_f64()
    ));
    actix_web::rt::spawn(async {
        if let Ok(name) = shutdown_signal().await {
            crate::notice::notice(&format!("{name} again: exiting without draining"));
            std::process::exit(1);
        }
    });
    drain(&st).await;
    server.stop(true).await;
}

async fn shutdown_signal() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

async fn wait_until_empty(st: &ServerState, until: Instant) -> bool {
    while st.gate.num_inside() > 0 {
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Closes the gate, lets the requests in flight finish within the shutdown timeout,
/// ends the rest with an error their clients see, and shuts the engine down.
pub async fn drain(st: &ServerState) {
    st.gate.close();
    if let Some(hook) = st.drain_hook() {
        hook().await;
    }
    let finished = wait_until_empty(st, Instant::now() + st.opts.shutdown_timeout).await;
    if let Some(encoder) = st.encoder() {
        encoder.stop().await;
        return;
    }
    let Ok(engine) = st.engine() else {
        return;
    };
    if !finished {
        let left = st.gate.num_inside();
        engine
            .cancel_all(format!(
                "the server is shutting down and the request did not finish within --shutdown-timeout ({} s)",
                st.opts.shutdown_timeout.as_secs_f64()
            ))
            .await;
        // Long enough for the error events to be written to their clients.
        if !wait_until_empty(st, Instant::now() + Duration::from_secs(5)).await {
            tracing::warn!("{left} requests had not ended 5 s after they were cancelled");
        }
    }
    engine.clone().shutdown(false).await;
    crate::notice::notice("drained; the engine is shut down");
}
