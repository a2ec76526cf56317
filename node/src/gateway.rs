//! `kvasir-node gateway`: the only public face, one TLS port. A WebSocket upgrade on the
//! swarm path is handed to the hub and from then on bytes are copied both ways without
//! parsing a frame (the raw splice); every other request is the REST API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::http::{Method, StatusCode, Uri};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use kvasir_wallet::client::Client;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use crate::crediting::Crediting;
use crate::link;
use crate::tls;

/// The path workers upgrade on.
pub const SWARM_PATH: &str = "/swarm";
/// A request head larger than this, or slower than the timeout, is dropped.
const MAX_HEAD: usize = 16 << 10;
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes moved per read in the splice (tokio's default of 8 KiB costs a syscall and a TLS
/// record per 8 KiB of a megabyte-sized dispatch frame).
const SPLICE_BUFFER: usize = 256 << 10;

#[derive(clap::Args)]
pub struct Args {
    /// The public TLS port (443 where permitted).
    #[arg(long, default_value = "0.0.0.0:443")]
    listen: SocketAddr,
    /// PEM certificate chain.
    #[arg(long, requires = "tls_key", conflicts_with = "self_signed")]
    tls_cert: Option<PathBuf>,
    /// PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Generate a self-signed certificate for localhost (dev); workers pass it as `--ca`.
    #[arg(long, required_unless_present = "tls_cert")]
    self_signed: bool,
    /// Where the self-signed certificate is written.
    #[arg(long, default_value = "gateway-cert.pem")]
    cert_out: PathBuf,
    /// The hub's swarm listener.
    #[arg(long, default_value = "127.0.0.1:7101")]
    hub: SocketAddr,
    /// The ledger's REST API: served to the public through this gateway, and where credits go.
    #[arg(long)]
    ledger: Option<String>,
    /// The hub's registry (`http://HOST:PORT`), polled for receipts to credit.
    #[arg(long, requires_all = ["ledger", "key"])]
    registry: Option<String>,
    /// The gateway key that signs credits (a gateway authority of the chain).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Milliseconds between registry polls.
    #[arg(long, default_value_t = 1000)]
    credit_interval_ms: u64,
}

pub fn run(args: Args) -> Result<()> {
    let config = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => tls::server_from_files(cert, key)?,
        _ => {
            let config = tls::self_signed(&args.cert_out)?;
            println!(
                "self-signed certificate written to {}",
                args.cert_out.display()
            );
            config
        }
    };
    if let (Some(registry), Some(ledger), Some(key)) = (&args.registry, &args.ledger, &args.key) {
        let crediting = Crediting {
            ledger: Client::new(ledger),
            registry: Client::new(registry),
            key: kvasir_wallet::keyfile::open(key)?,
        };
        let interval = Duration::from_millis(args.credit_interval_ms);
        std::thread::spawn(move || crediting.run(interval, &AtomicBool::new(false)));
    }
    let runtime = tokio::runtime::Runtime::new()?;
    let api = api(args.ledger.clone());
    runtime.block_on(serve(TlsAcceptor::from(config), args.listen, args.hub, api))
}

async fn serve(
    acceptor: TlsAcceptor,
    listen: SocketAddr,
    hub: SocketAddr,
    api: Router,
) -> Result<()> {
    let listener = link::bind("gateway", listen).await?;
    loop {
        let (stream, peer) = listener.accept().await?;
        let (acceptor, api) = (acceptor.clone(), api.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(acceptor, stream, hub, api).await {
                tracing::debug!(%peer, "connection ended: {e:#}");
            }
        });
    }
}

/// The public REST API: the ledger's, relayed (reads and transaction submission), when a
/// ledger is configured; the market comes with a later change.
fn api(ledger: Option<String>) -> Router {
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

async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    hub: SocketAddr,
    api: Router,
) -> Result<()> {
    stream.set_nodelay(true)?;
    let mut tls = tokio::time::timeout(HEAD_TIMEOUT, acceptor.accept(stream))
        .await
        .context("TLS handshake timed out")??;
    let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut tls))
        .await
        .context("request head timed out")??;
    if is_swarm_upgrade(&head) {
        let mut upstream = TcpStream::connect(hub)
            .await
            .with_context(|| format!("hub {hub} unreachable"))?;
        upstream.set_nodelay(true)?;
        upstream.write_all(&head).await?;
        tokio::io::copy_bidirectional_with_sizes(
            &mut tls,
            &mut upstream,
            SPLICE_BUFFER,
            SPLICE_BUFFER,
        )
        .await?;
        return Ok(());
    }
    let io = TokioIo::new(Rewind {
        prefix: head,
        at: 0,
        inner: tls,
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(io, TowerToHyperService::new(api))
        .await?;
    Ok(())
}

/// Reads until the end of the HTTP request head; returns everything read (the head and
/// whatever followed it in the same reads).
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("closed before the end of the request head");
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(buf);
        }
        if buf.len() > MAX_HEAD {
            bail!("request head over {MAX_HEAD} bytes");
        }
    }
}

/// `GET /swarm` with `Upgrade: websocket`; decided on the head alone, the frames that follow
/// are never looked at.
fn is_swarm_upgrade(head: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(head.split(|b| *b == 0).next().unwrap_or_default()) else {
        return false;
    };
    let mut lines = text.split("\r\n");
    let target = lines.next().and_then(|line| {
        let mut parts = line.split(' ');
        (parts.next() == Some("GET"))
            .then(|| parts.next())
            .flatten()
    });
    let path = target.map(|t| t.split('?').next().unwrap_or_default());
    path == Some(SWARM_PATH)
        && lines.take_while(|l| !l.is_empty()).any(|l| {
            l.split_once(':').is_some_and(|(name, value)| {
                name.trim().eq_ignore_ascii_case("upgrade")
                    && value.trim().eq_ignore_ascii_case("websocket")
            })
        })
}

/// A stream that first replays bytes already read from it.
struct Rewind<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.at);
            buf.put_slice(&self.prefix[self.at..self.at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_websocket_get_on_the_swarm_path_is_spliced() {
        let upgrade =
            b"GET /swarm HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        assert!(is_swarm_upgrade(upgrade));
        assert!(is_swarm_upgrade(
            b"GET /swarm?v=1 HTTP/1.1\r\nupgrade:  WebSocket \r\n\r\n"
        ));
        for other in [
            &b"GET /swarm HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"POST /swarm HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"GET /swarmy HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n\r\nUpgrade: websocket\r\n\r\n",
            b"\xff\xfe",
            b"",
        ] {
            assert!(!is_swarm_upgrade(other), "{other:?}");
        }
    }
}
