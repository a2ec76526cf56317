//! `--listen`: the backbone's HTTP endpoint, `POST /generate` with JSON in and out.

use std::sync::Arc;

use anyhow::Result;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvasir_api::generation::{GenerateRequest, GenerationReport};
use kvasir_api::{ErrorBody, Object};
use kvasir_inference::generate::Sampling;
use utoipa::OpenApi;

use super::Engine;
use crate::link;
use crate::listen::{Acceptor, Limits};
use crate::metrics::Exposition;

/// Most tokens one HTTP request may ask for.
const MAX_HTTP_TOKENS: usize = 4096;

type Reply = Result<Json<GenerationReport>, (StatusCode, Json<ErrorBody>)>;

fn http_error(status: StatusCode, kind: &str, message: String) -> (StatusCode, Json<ErrorBody>) {
    let body = ErrorBody {
        error: kind.to_string(),
        message,
    };
    (status, Json(body))
}

/// The HTTP endpoint's state: the engine, one generation at a time (batching concurrent
/// requests is for a later change), and the sampling settings from the command line.
struct Served {
    engine: Arc<Engine>,
    turn: tokio::sync::Mutex<()>,
    sampling: Sampling,
}

/// The OpenAPI description of the backbone's endpoint.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Kvasir backbone",
        description = "Text generation with remote experts."
    ),
    paths(generate_handler, healthz, metrics)
)]
struct ApiDoc;

#[utoipa::path(get, path = "/healthz", description = "Liveness: the text `ok`.", responses((status = 200, description = "ok", body = String, content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok"
}

/// `GET /metrics`: dispatch counts and round trips, as Prometheus text.
#[utoipa::path(get, path = "/metrics", description = "Prometheus text: remote requests, fallbacks, dispatch round trips.", responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(served): State<Arc<Served>>) -> String {
    let experts = &served.engine.experts;
    let counts = experts.stats();
    Exposition::default()
        .counter(
            "kvasir_backbone_remote_requests_total",
            "Requests sent to workers (one per worker per layer step).",
            counts.remote_requests,
        )
        .counter(
            "kvasir_backbone_remote_evaluations_total",
            "Expert evaluations answered by workers.",
            counts.remote_evaluations,
        )
        .counter(
            "kvasir_backbone_fallbacks_total",
            "Requests computed locally after their worker failed, left or stalled.",
            counts.fallbacks,
        )
        .histogram(
            "kvasir_backbone_dispatch_round_trip_seconds",
            "From sending a request to a worker to its answer.",
            &experts.round_trip,
        )
        .text()
}

/// `POST /generate`: JSON in and out, errors as `{error, message}`.
#[utoipa::path(post, path = "/generate", description = "Generate `tokens` tokens (default 32, at most 4096) after `prompt`, one request at a time.", request_body = GenerateRequest, responses((status = 200, body = GenerationReport), (status = 400, description = "Not JSON", body = ErrorBody), (status = 413, description = "Body over 64 KiB", body = ErrorBody), (status = 415, description = "Not application/json", body = ErrorBody), (status = 422, description = "JSON of another shape, an empty prompt, or tokens out of range", body = ErrorBody), (status = 500, description = "Generation failed", body = ErrorBody)))]
async fn generate_handler(
    State(served): State<Arc<Served>>,
    body: Result<Json<Object<GenerateRequest>>, JsonRejection>,
) -> Reply {
    let Json(Object(request)) =
        body.map_err(|e| http_error(e.status(), "bad_request", e.body_text()))?;
    if request.prompt.is_empty() || request.tokens == 0 || request.tokens > MAX_HTTP_TOKENS {
        let message = format!("prompt must be non-empty and tokens in 1..={MAX_HTTP_TOKENS}");
        return Err(http_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
            message,
        ));
    }
    let _turn = served.turn.lock().await;
    let (engine, sampling) = (served.engine.clone(), served.sampling);
    let generation = tokio::task::spawn_blocking(move || {
        engine.generate(&request.prompt, request.tokens, sampling)
    })
    .await
    .map_err(|e| http_error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
    .map_err(|e| {
        http_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "generation",
            format!("{e:#}"),
        )
    })?;
    Ok(Json(generation))
}

pub(super) async fn serve(
    engine: Arc<Engine>,
    listen: std::net::SocketAddr,
    limits: Limits,
    sampling: Sampling,
) -> Result<()> {
    let served = Arc::new(Served {
        engine,
        turn: tokio::sync::Mutex::new(()),
        sampling,
    });
    let app = Router::new()
        .route("/generate", post(generate_handler))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
        .layer(DefaultBodyLimit::max(64 << 10))
        .with_state(served);
    let listener = link::bind("backbone", listen).await?;
    axum::serve(Acceptor::new("backbone", listener, limits), app).await?;
    Ok(())
}
