//! `troupe serve`: the HTTP front end (actix-web) — its routes, `/health`, `/v1/models`
//! and `/metrics`. Each API's handlers live with its codec; what they share is in `http`.

use crate::sync::Shared as Arc;

use actix_web::{App, HttpResponse, HttpServer, web};
use serde_json::json;

use super::api::{ApiError, Flavor};
use super::http::{ServerState, error_response};
use super::metrics::Metrics;
use super::{anthropic, openai, responses};
use crate::engine::EngineHandle;

pub use super::http::MAX_BODY_BYTES;

async fn health(st: web::Data<ServerState>) -> HttpResponse {
    match st.engine.status().await {
        Ok(_) => HttpResponse::Ok().json(json!({"status": "ok"})),
        Err(e) => error_response(&ApiError::status(503, e.to_string()), Flavor::OpenAi),
    }
}

async fn models(st: web::Data<ServerState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "troupe",
                  "max_model_len": st.engine.text().config.max_context_tokens}],
    }))
}

async fn metrics(st: web::Data<ServerState>) -> HttpResponse {
    match st.engine.status().await {
        Ok(status) => HttpResponse::Ok()
            .content_type(super::metrics::CONTENT_TYPE)
            .body(st.metrics.render(&status)),
        Err(e) => error_response(&ApiError::status(503, e.to_string()), Flavor::OpenAi),
    }
}

async fn not_found() -> HttpResponse {
    error_response(&ApiError::status(404, "no such route"), Flavor::OpenAi)
}

/// The routes, for `serve` and for in-process tests.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/metrics", web::get().to(metrics))
        .route("/v1/models", web::get().to(models))
        .route(
            "/v1/chat/completions",
            web::post().to(openai::chat_completions),
        )
        .route("/v1/completions", web::post().to(openai::completions))
        .route("/v1/responses", web::post().to(responses::create))
        .route("/v1/messages", web::post().to(anthropic::messages))
        .default_service(web::to(not_found));
}

pub fn state(engine: EngineHandle, model_name: String) -> web::Data<ServerState> {
    web::Data::new(ServerState {
        engine,
        model_name,
        metrics: Arc::new(Metrics::new()),
    })
}

/// Serves on `listener` until the process is stopped.
pub fn serve_on(
    engine: EngineHandle,
    model_name: String,
    listener: std::net::TcpListener,
) -> std::io::Result<()> {
    let state = state(engine, model_name);
    let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(configure))
        .workers(2)
        .listen(listener)?;
    actix_web::rt::System::new().block_on(server.run())
}

pub fn serve(
    engine: EngineHandle,
    model_name: String,
    host: &str,
    port: u16,
) -> std::io::Result<()> {
    let listener = std::net::TcpListener::bind((host, port))?;
    eprintln!("troupe: serving on http://{host}:{port}");
    serve_on(engine, model_name, listener)
}
