//! The gateway's REST side: the ledger's API relayed to the public (reads and transaction
//! submission) when a ledger is configured, over one pooled async HTTP client with connect
//! and response timeouts. The public sees the ledger's answer, or the API's own
//! `{error, message}` when the ledger cannot be reached or is too slow, never the text of an
//! internal error (that goes to the log).
//!
//! Every request's body is read in full before it is routed, within `BODY_TIMEOUT` and
//! `MAX_REQUEST` (`read_body`): a client trickling its body gets a 408 and the connection is
//! closed; one sending too much gets a 413.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{CONNECTION, CONTENT_TYPE};
use axum::http::{HeaderValue, Method, Request, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Json, Router};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvasir_api::ErrorBody;

use super::inference::{self, Backbone};
use super::stats::Stats;

/// Largest request relayed: a signed transaction is well under a kilobyte.
const MAX_REQUEST: usize = 64 << 10;
/// Largest answer relayed (a page of history, a hub's sessions).
const MAX_ANSWER: usize = 16 << 20;
/// A ledger that does not accept a connection within this is unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// A request body must arrive in full within this of its head (the head's own limit).
const BODY_TIMEOUT: Duration = super::HEAD_TIMEOUT;

/// The ledger nodes behind the gateway and the pooled client that reaches them. A request
/// that cannot reach one node (no connection) goes to the next; the gateway stays with the
/// node that answered.
pub(super) struct Upstream {
    /// `http://host:port` of each node, without a trailing slash.
    bases: Vec<String>,
    /// The one that answered last.
    current: AtomicUsize,
    client: Client<HttpConnector, Full<Bytes>>,
    /// A whole exchange (answer read to its end) longer than this is given up on.
    timeout: Duration,
}

impl Upstream {
    /// The ledger nodes at `urls` (comma-separated): plain HTTP, as on the LAN behind the
    /// gateway.
    pub(super) fn new(urls: &str, timeout: Duration) -> Result<Upstream> {
        let mut bases = Vec::new();
        for url in urls.split(',').map(str::trim) {
            let base = url.trim_end_matches('/').to_string();
            let uri: Uri = base.parse().with_context(|| format!("--ledger {url}"))?;
            if uri.scheme_str() != Some("http") || uri.authority().is_none() {
                bail!("--ledger {url}: the relay reaches the ledger over plain http://HOST:PORT");
            }
            bases.push(base);
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Upstream {
            bases,
            current: AtomicUsize::new(0),
            client,
            timeout,
        })
    }

    /// One exchange with a ledger node: its status, content type and body.
    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Option<HeaderValue>, Bytes)> {
        let first = self.current.load(Ordering::Relaxed);
        let mut last_error = None;
        for offset in 0..self.bases.len() {
            let index = (first + offset) % self.bases.len();
            let request = Request::builder()
                .method(method.clone())
                .uri(format!("{}{path}", self.bases[index]))
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))?;
            let response = match self.client.request(request).await {
                Ok(response) => response,
                // Only a node that took no connection is passed over: one that took the
                // request may have acted on it.
                Err(e) if e.is_connect() => {
                    last_error = Some(e);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            self.current.store(index, Ordering::Relaxed);
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
                .to_bytes();
            return Ok((parts.status, parts.headers.get(CONTENT_TYPE).cloned(), body));
        }
        match last_error {
            Some(e) => Err(e.into()),
            None => bail!("no ledger node configured"),
        }
    }
}

fn error(status: StatusCode, error: &str, message: &str) -> Response {
    let body = ErrorBody {
        error: error.into(),
        message: message.into(),
    };
    (status, Json(body)).into_response()
}

/// The public REST API: the ledger's, relayed (reads and transaction submission), when a
/// ledger is configured, and the backbone's OpenAI-compatible API under `/v1/` when one is.
pub(super) fn api(
    ledger: Option<Upstream>,
    backbone: Option<Backbone>,
    stats: Arc<Stats>,
) -> Router {
    // The gateway's own counts; the ledger's /metrics stays on the ledger's LAN listener.
    let metrics = move || {
        let stats = stats.clone();
        async move { stats.text() }
    };
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route(
            "/v1/{*rest}",
            any(inference::relay).with_state(Arc::new(backbone)),
        )
        .fallback_service(any(relay_to_ledger).with_state(Arc::new(ledger)))
        .layer(middleware::from_fn(read_body))
}

/// Reads the whole body of `request` (at most `MAX_REQUEST` bytes, within `BODY_TIMEOUT`)
/// before passing it on: 408 for a body too slow, which also closes the connection (the rest
/// of the body is never read), 413 for one too large.
async fn read_body(request: axum::extract::Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_REQUEST).collect());
    match read.await {
        Ok(Ok(body)) => {
            next.run(Request::from_parts(parts, Body::from(body.to_bytes())))
                .await
        }
        Ok(Err(e)) if e.is::<LengthLimitError>() => error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            &format!("the request body is over {} KiB", MAX_REQUEST >> 10),
        ),
        Ok(Err(_)) => error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the request body could not be read",
        ),
        Err(_) => {
            let mut response = error(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                "the request body did not arrive in time",
            );
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}

/// Passes a GET or POST through to the ledger and its answer back.
async fn relay_to_ledger(
    State(ledger): State<Arc<Option<Upstream>>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let Some(ledger) = ledger.as_ref() else {
        return error(StatusCode::NOT_FOUND, "not_found", "no such endpoint");
    };
    if method != Method::GET && method != Method::POST {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "GET or POST",
        );
    }
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    match tokio::time::timeout(ledger.timeout, ledger.exchange(method, path, body)).await {
        Ok(Ok((status, content_type, body))) => {
            let mut response = (status, body).into_response();
            if let Some(content_type) = content_type {
                response.headers_mut().insert(CONTENT_TYPE, content_type);
            }
            response
        }
        Ok(Err(e)) => {
            tracing::warn!("relaying {path} to the ledger: {e:#}");
            error(
                StatusCode::BAD_GATEWAY,
                "ledger_unreachable",
                "the ledger behind this gateway cannot be reached",
            )
        }
        Err(_) => {
            tracing::warn!("relaying {path}: the ledger did not answer in time");
            error(
                StatusCode::GATEWAY_TIMEOUT,
                "ledger_timeout",
                "the ledger behind this gateway did not answer in time",
            )
        }
    }
}
