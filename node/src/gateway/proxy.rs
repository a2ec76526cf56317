//! The gateway's REST side: the ledger's API relayed to the public (reads and transaction
//! submission) when a ledger is configured.

use std::sync::Arc;

use anyhow::Result;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::http::{Method, StatusCode, Uri};
use axum::routing::get;
use axum::Router;
use kvasir_api::ErrorBody;

/// The public REST API: the ledger's, relayed (reads and transaction submission), when a
/// ledger is configured; the market comes with a later change.
pub(super) fn api(ledger: Option<String>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .fallback(relay_to_ledger)
        .layer(DefaultBodyLimit::max(64 << 10))
        .with_state(Arc::new(ledger))
}

/// Passes a GET or POST through to the ledger and its answer back.
async fn relay_to_ledger(
    State(ledger): State<Arc<Option<String>>>,
    method: Method,
    uri: Uri,
    body: axum::body::Bytes,
) -> (StatusCode, [(HeaderName, &'static str); 1], Vec<u8>) {
    let json = || [(CONTENT_TYPE, "application/json")];
    let error = |status: StatusCode, error: &str, message: String| {
        let body = ErrorBody {
            error: error.into(),
            message,
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        (status, json(), bytes)
    };
    let Some(ledger) = ledger.as_ref().clone() else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no such endpoint".into(),
        );
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let url = format!("{}{path}", ledger.trim_end_matches('/'));
    if method != Method::GET && method != Method::POST {
        let message = "GET or POST".to_string();
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            message,
        );
    }
    let answer = tokio::task::spawn_blocking(move || -> Result<(u16, Vec<u8>), String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let response = match method {
            Method::POST => agent
                .post(&url)
                .content_type("application/json")
                .send(&body[..]),
            _ => agent.get(&url).call(),
        };
        let mut response = response.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes = response
            .body_mut()
            .read_to_vec()
            .map_err(|e| e.to_string())?;
        Ok((status, bytes))
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|inner| inner);
    match answer {
        Ok((status, bytes)) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            json(),
            bytes,
        ),
        Err(reason) => error(StatusCode::BAD_GATEWAY, "ledger_unreachable", reason),
    }
}
