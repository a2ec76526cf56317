//! The gateway's REST side: the ledger's API relayed to the public (reads and transaction
//! submission) when a ledger is configured.

use std::sync::Arc;

use anyhow::Result;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::http::{Method, StatusCode, Uri};
use axum::routing::get;
use axum::Router;

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
    let json = [(CONTENT_TYPE, "application/json")];
    let Some(ledger) = ledger.as_ref().clone() else {
        let body = br#"{"error":"not_found","message":"no such endpoint"}"#.to_vec();
        return (StatusCode::NOT_FOUND, json, body);
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let url = format!("{}{path}", ledger.trim_end_matches('/'));
    let answer = tokio::task::spawn_blocking(move || -> Result<(u16, Vec<u8>), String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let response = match method {
            Method::GET => agent.get(&url).call(),
            Method::POST => agent
                .post(&url)
                .content_type("application/json")
                .send(&body[..]),
            _ => {
                return Ok((
                    405,
                    br#"{"error":"method_not_allowed","message":"GET or POST"}"#.to_vec(),
                ))
            }
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
            json,
            bytes,
        ),
        Err(reason) => {
            let body =
                serde_json::json!({"error": "ledger_unreachable", "message": reason.to_string()});
            (StatusCode::BAD_GATEWAY, json, body.to_string().into_bytes())
        }
    }
}

