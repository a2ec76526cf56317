//! What every swarm role does with a WebSocket carrying wire frames: the size limits, reading
//! the next frame, a writer task fed by a channel, and binding a listener that says where it
//! listens (tests and `dev` read that line).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::http::Uri;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Bytes, Message as WsMessage};
use tokio_tungstenite::WebSocketStream;

use kvasir_ledger::keys::Keypair;

use crate::wire::{ExpertId, Hello, Message, Role, MAX_FRAME};

/// A byte stream with or without TLS.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}
pub type Dialed = Source<Box<dyn Transport>>;

/// Who a client says it is in its hello.
pub struct Identity<'a> {
    pub key: &'a Keypair,
    pub role: Role,
    pub model_id: String,
    pub backend: String,
    pub experts: Vec<ExpertId>,
}

/// Dials the hub at `url` (through a gateway or directly) and answers its challenge as
/// `identity`: the open link and the session id the hub assigned.
pub async fn connect(
    url: &str,
    tls: &Arc<ClientConfig>,
    identity: Identity<'_>,
) -> Result<(mpsc::UnboundedSender<Bytes>, Dialed, u64)> {
    let (tx, mut source) = dial(url, tls).await?;
    let Message::Challenge(challenge) = next_message(&mut source).await? else {
        bail!("the hub did not open with a challenge");
    };
    let role = identity.role;
    let hello = Hello::answer(
        &challenge,
        identity.key,
        role,
        identity.model_id,
        identity.backend,
        identity.experts,
    );
    let _ = tx.send(Message::Hello(hello).encode().into());
    match next_message(&mut source).await? {
        Message::Welcome(welcome) => Ok((tx, source, welcome.session)),
        Message::Failure(failure) => bail!("the hub refused this {role:?}: {}", failure.message),
        _ => bail!("the hub refused this {role:?}"),
    }
}

/// Opens a WebSocket to `url`: `wss://` through TLS with `tls`'s roots, `ws://` in the clear
/// (for a LAN). Returns the sending channel and the receiving half.
pub async fn dial(
    url: &str,
    tls: &Arc<ClientConfig>,
) -> Result<(mpsc::UnboundedSender<Bytes>, Dialed)> {
    let uri: Uri = url
        .parse()
        .with_context(|| format!("{url:?} is not a URL"))?;
    let host = uri.host().context("the URL has no host")?.to_string();
    let secure = match uri.scheme_str() {
        Some("wss") => true,
        Some("ws") => false,
        _ => bail!("{url:?} must start with wss:// (or ws:// on a LAN)"),
    };
    let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
    let tcp = TcpStream::connect((host.as_str(), port))
        .await
        .with_context(|| format!("connecting to {host}:{port}"))?;
    tcp.set_nodelay(true)?;
    let stream: Box<dyn Transport> = if secure {
        let name = ServerName::try_from(host.clone())
            .with_context(|| format!("{host:?} is not a valid TLS server name"))?;
        Box::new(TlsConnector::from(tls.clone()).connect(name, tcp).await?)
    } else {
        Box::new(tcp)
    };
    let (ws, _) = tokio_tungstenite::client_async_with_config(url, stream, Some(ws_config()))
        .await
        .with_context(|| format!("WebSocket handshake with {url}"))?;
    Ok(split(ws))
}

/// WebSocket limits matching the wire protocol's: nothing larger is ever buffered.
pub fn ws_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_FRAME))
        .max_frame_size(Some(MAX_FRAME))
        .read_buffer_size(256 << 10)
}

/// The next wire frame, skipping control frames. A close, an end of stream or a text frame
/// ends the link.
pub async fn next_frame<S>(source: &mut S) -> Result<Bytes>
where
    S: Stream<Item = Result<WsMessage, tungstenite::Error>> + Unpin,
{
    loop {
        match source.next().await {
            Some(Ok(WsMessage::Binary(frame))) => return Ok(frame),
            Some(Ok(WsMessage::Ping(_) | WsMessage::Pong(_))) => continue,
            Some(Ok(WsMessage::Close(_))) | None => bail!("link closed"),
            Some(Ok(_)) => bail!("not a binary frame"),
            Some(Err(e)) => return Err(e).context("link failed"),
        }
    }
}

/// The next frame, decoded.
pub async fn next_message<S>(source: &mut S) -> Result<Message>
where
    S: Stream<Item = Result<WsMessage, tungstenite::Error>> + Unpin,
{
    Ok(Message::decode(&next_frame(source).await?)?)
}

pub type Source<T> = SplitStream<WebSocketStream<T>>;

/// Splits a link: frames sent on the returned channel are written in order by a task that
/// ends (closing the socket) when every sender is dropped or a write fails.
pub fn split<T>(ws: WebSocketStream<T>) -> (mpsc::UnboundedSender<Bytes>, Source<T>)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sink, source) = ws.split();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_frames(sink, rx));
    (tx, source)
}

async fn write_frames<T>(
    mut sink: SplitSink<WebSocketStream<T>, WsMessage>,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
) where
    T: AsyncRead + AsyncWrite + Unpin,
{
    while let Some(frame) = rx.recv().await {
        if sink.send(WsMessage::Binary(frame)).await.is_err() {
            return;
        }
    }
    let _ = sink.close().await;
}

/// Binds `addr` and prints `<role> listening on <addr>` (the bound port when 0 was asked).
pub async fn bind(role: &str, addr: SocketAddr) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("{role}: cannot listen on {addr}"))?;
    println!("{role} listening on {}", listener.local_addr()?);
    Ok(listener)
}
