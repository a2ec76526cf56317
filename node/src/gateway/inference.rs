//! The gateway's relay of the backbone's OpenAI-compatible API (`/v1/...`) to the public,
//! when `--backbone` names one: the request (already read whole, within the REST limits)
//! goes to the backbone over the LAN, and its answer comes back as it is produced, so a
//! streamed completion's events reach the client as the backbone sends them. Errors the
//! gateway itself gives are in that API's shape. One client address may have at most
//! `--max-generations-per-ip` requests in progress; a request holds its place until its
//! answer, a stream included, has been sent or the client has gone.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::Full;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvasir_api::openai::{ErrorDetail, ErrorResponse};
use std::sync::Arc;

use super::stats::Stats;
use crate::listen::{Limits, Places, Slot};

/// A backbone that takes no connection within this is unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The backbone must answer (its head; a stream's events may take longer) within this: a
/// request waits in its queue at most that long before the client hears why.
const HEAD_TIMEOUT: Duration = Duration::from_secs(120);

/// The backbone behind the gateway.
pub(super) struct Backbone {
    /// `http://host:port`, without a trailing slash.
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Requests in progress, per client address.
    in_progress: Arc<Places>,
    stats: Arc<Stats>,
}

impl Backbone {
    pub(super) fn new(url: &str, per_address: usize, stats: Arc<Stats>) -> Result<Backbone> {
        let base = url.trim_end_matches('/').to_string();
        let uri: Uri = base.parse().with_context(|| format!("--backbone {url}"))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            anyhow::bail!(
                "--backbone {url}: the relay reaches the backbone over plain http://HOST:PORT"
            );
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        Ok(Backbone {
            base,
            client: Client::builder(TokioExecutor::new()).build(connector),
            in_progress: Places::new(Limits::per_address(per_address)),
            stats,
        })
    }
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    error_with_code(status, kind, None, message)
}

fn error_with_code(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let body = ErrorResponse {
        error: ErrorDetail {
            message: message.into(),
            kind: kind.into(),
            param: None,
            code: code.map(str::to_string),
        },
    };
    (status, Json(body)).into_response()
}

/// `/v1/...`: passed to the backbone, its answer streamed back.
pub(super) async fn relay(
    State(backbone): State<Arc<Option<Backbone>>>,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let Some(backbone) = backbone.as_ref() else {
        let message = "this gateway serves no model (it was started without --backbone)";
        return error(StatusCode::NOT_FOUND, "not_found_error", message);
    };
    if method != Method::GET && method != Method::POST {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "GET or POST",
        );
    }
    let place = backbone.in_progress.admit(client.ip());
    backbone.stats.inference_request(place.is_some());
    let Some(place) = place else {
        let message = format!(
            "this address has {} requests in progress, the most this gateway serves it at once; retry when one ends",
            backbone.in_progress.per_address()
        );
        let code = Some("too_many_requests_in_progress");
        return error_with_code(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            code,
            &message,
        );
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let request = match Request::builder()
        .method(method)
        .uri(format!("{}{path}", backbone.base))
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
    {
        Ok(request) => request,
        Err(_) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", "bad path"),
    };
    match tokio::time::timeout(HEAD_TIMEOUT, backbone.client.request(request)).await {
        Ok(Ok(answer)) => {
            let (parts, body) = answer.into_parts();
            let mut response = Response::new(Body::new(Holding {
                body,
                _place: place,
            }));
            *response.status_mut() = parts.status;
            for header in [CONTENT_TYPE, CACHE_CONTROL] {
                if let Some(value) = parts.headers.get(&header) {
                    response.headers_mut().insert(header, value.clone());
                }
            }
            response
        }
        Ok(Err(e)) => {
            tracing::warn!("relaying {path} to the backbone: {e}");
            let message = "the model behind this gateway cannot be reached";
            error(StatusCode::BAD_GATEWAY, "server_error", message)
        }
        Err(_) => {
            tracing::warn!("relaying {path}: the backbone did not answer in time");
            let message = "the model behind this gateway did not answer in time";
            error(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
        }
    }
}

/// An answer's body holding its client's place, so that the place is freed when the answer
/// has been sent or the client has gone, not when its head was. Its length is the
/// backbone's, so a whole answer keeps its `content-length`.
struct Holding<B> {
    body: B,
    _place: Slot,
}

impl<B: HttpBody + Unpin> HttpBody for Holding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
