//! `--listen`: the backbone's HTTP endpoints: `POST /generate` with JSON in and out, and the
//! OpenAI-compatible API under `/v1/` (`openai`, with the checkpoint's chat template from
//! `chat`). Every generation joins the shared decode batch (`batcher`): its micro-batches step
//! at once, each on its own.

pub(super) mod batcher;
pub(super) mod chat;
mod openai;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

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
use crate::listen::{Acceptor, Limits};
use crate::metrics::Exposition;
use batcher::{Batcher, Event, Job, Refused};
use chat::Chat;
use kvasir_wire::link;

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

/// The HTTP endpoints' state: the engine, the batch every generation joins, the sampling
/// settings from the command line, and the name the model is served under.
pub(super) struct Served {
    pub(super) engine: Arc<Engine>,
    pub(super) batcher: Batcher,
    pub(super) sampling: Sampling,
    pub(super) model_name: String,
    pub(super) chat: Chat,
    ids: AtomicU64,
}

impl Served {
    /// A fresh number for a response id.
    pub(super) fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// The tokens a generation ends at (never text).
    pub(super) fn end_tokens(&self) -> Vec<u32> {
        self.engine.model.config().end_tokens().to_vec()
    }
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

/// `GET /metrics`: the batch, dispatch counts and round trips, as Prometheus text.
#[utoipa::path(get, path = "/metrics", description = "Prometheus text: the batch (queued, running, cache, tokens, generations by end), remote requests, fallbacks, dispatch round trips.", responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(served): State<Arc<Served>>) -> String {
    let experts = &served.engine.experts;
    let counts = experts.stats();
    let batch = served.batcher.stats();
    Exposition::default()
        .gauge(
            "kvasir_backbone_queued_generations",
            "Generations waiting for a place in the batch.",
            batch.queued as u64,
        )
        .gauge(
            "kvasir_backbone_running_sequences",
            "Sequences placed in the batch's micro-batches.",
            batch.running as u64,
        )
        .gauge(
            "kvasir_backbone_cache_bytes",
            "Cache the running sequences hold, each counted at its full length.",
            batch.cache_bytes as u64,
        )
        .counter(
            "kvasir_backbone_generated_tokens_total",
            "Tokens told to callers.",
            batch.tokens,
        )
        .counter(
            "kvasir_backbone_generations_completed_total",
            "Generations that ended: at an end token, at max tokens or at a stop string.",
            batch.completed,
        )
        .counter(
            "kvasir_backbone_generations_hung_up_total",
            "Generations whose caller stopped listening before their end, queued or running.",
            batch.hung_up,
        )
        .counter(
            "kvasir_backbone_generations_failed_total",
            "Generations that failed (a failed step, a stopped batch, no memory for a cache).",
            batch.failed,
        )
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
#[utoipa::path(post, path = "/generate", description = "Generate `tokens` tokens (default 32, at most 4096) after `prompt`, in the decode batch shared with every other request.", request_body = GenerateRequest, responses((status = 200, body = GenerationReport), (status = 400, description = "Not JSON", body = ErrorBody), (status = 413, description = "Body over 64 KiB", body = ErrorBody), (status = 415, description = "Not application/json", body = ErrorBody), (status = 422, description = "JSON of another shape, an empty prompt, tokens out of range, or a prompt and tokens over the model's context", body = ErrorBody), (status = 429, description = "The queue of waiting requests is full", body = ErrorBody), (status = 503, description = "The backbone no longer generates", body = ErrorBody), (status = 500, description = "Generation failed", body = ErrorBody)))]
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
    let engine = &served.engine;
    let internal =
        |message: String| http_error(StatusCode::INTERNAL_SERVER_ERROR, "generation", message);
    let prompt_ids = engine
        .tokenizer
        .encode(&request.prompt)
        .map_err(|e| http_error(StatusCode::UNPROCESSABLE_ENTITY, "invalid", e.to_string()))?;
    let start = Instant::now();
    let mut events = served
        .batcher
        .submit(Job {
            prompt: prompt_ids.clone(),
            max_new: request.tokens,
            sampling: served.sampling,
        })
        .map_err(|refused| match refused {
            Refused::Busy => {
                let message = "the queue of waiting requests is full; retry later".to_string();
                http_error(StatusCode::TOO_MANY_REQUESTS, "busy", message)
            }
            Refused::Stopped => {
                let message = "this backbone no longer generates".to_string();
                http_error(StatusCode::SERVICE_UNAVAILABLE, "stopped", message)
            }
            Refused::Invalid(unfit) => http_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid",
                unfit.to_string(),
            ),
        })?;
    let mut token_ids = Vec::new();
    let logits_blake3 = loop {
        match events.recv().await {
            Some(Event::Token(token)) => token_ids.push(token),
            Some(Event::Done { logits_blake3, .. }) => break logits_blake3,
            Some(Event::Failed(message)) => return Err(internal(message)),
            None => return Err(internal("the generation ended without an answer".into())),
        }
    };
    let generate_s = start.elapsed().as_secs_f64();
    Ok(Json(GenerationReport {
        text: engine
            .tokenizer
            .decode(&token_ids)
            .map_err(|e| internal(e.to_string()))?,
        tokens_per_s: token_ids.len() as f64 / generate_s,
        token_ids,
        prompt_ids,
        generate_s,
        logits_blake3,
        load_s: None,
        backend: None,
        dispatch: Some(engine.experts.stats()),
        audit: Some(engine.experts.audit_report()),
    }))
}

/// How the HTTP endpoints run: the listener, its connection limits, the default sampling,
/// the model's public name, and the batch's bounds.
pub(super) struct Serving {
    pub(super) listen: std::net::SocketAddr,
    pub(super) limits: Limits,
    pub(super) sampling: Sampling,
    pub(super) model_name: String,
    pub(super) chat: Chat,
    pub(super) batch: batcher::Limits,
}

pub(super) async fn serve(engine: Arc<Engine>, serving: Serving) -> Result<()> {
    let batcher = Batcher::start(engine.clone(), serving.batch)?;
    let served = Arc::new(Served {
        engine,
        batcher,
        sampling: serving.sampling,
        model_name: serving.model_name,
        chat: serving.chat,
        ids: AtomicU64::new(0),
    });
    let app = Router::new()
        .route("/generate", post(generate_handler))
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
        .layer(DefaultBodyLimit::max(64 << 10))
        .with_state(served);
    let listener = link::bind("backbone", serving.listen).await?;
    axum::serve(Acceptor::new("backbone", listener, serving.limits), app).await?;
    Ok(())
}
