//! What every swarm role does with a WebSocket carrying wire frames: the size limits, reading
//! the next frame, a writer task fed by a channel (which can also ping the peer), a read half
//! that gives up on a silent peer (`Idle`), and binding a listener that says where it listens
//! (tests and `dev` read that line).
//!
//! Keepalive: the hub pings every link (`Keepalive`); a peer answers while it polls its read
//! half (tungstenite queues the pong when it reads a ping and writes it on the next read), and
//! `next_frame` passes over pings and pongs. Whoever wraps its read half in `Idle` drops a link
//! from which nothing at all, not even a pong or a ping, arrived for the idle timeout.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval, MissedTickBehavior, Sleep};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, Uri};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Bytes, Message as WsMessage};
use tokio_tungstenite::WebSocketStream;

use kvasir_primitives::keys::Keypair;

use crate::{
    Challenge, ExpertId, Hello, Message, Role, MAX_FRAME, PREVIOUS_VERSION, SUBPROTOCOL, VERSION,
};

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
    /// The market order a backbone acts for; zero for none (and for workers).
    pub order: u64,
}

/// A link on which the hub welcomed us.
pub struct Connected {
    pub tx: mpsc::UnboundedSender<Bytes>,
    pub source: Dialed,
    /// The session the hub assigned (0 for the backbone).
    pub session: u64,
    /// What the hub opened with: its chain id and key are part of every answer signed on
    /// this link (`wire::AnswerScope`).
    pub challenge: Challenge,
    /// What the hub's welcome asked its operator to read (empty for nothing): a client logs
    /// it as a warning.
    pub notice: String,
}

/// Dials the hub at `url` (through a gateway or directly) and answers its challenge as
/// `identity`. A hub on an older protocol version is reported as such: it does not take the
/// subprotocol (`dial`), or its challenge is of another version ("the hub's challenge:
/// protocol version 5, this node speaks 4").
pub async fn connect(
    url: &str,
    tls: &Arc<ClientConfig>,
    identity: Identity<'_>,
) -> Result<Connected> {
    let (tx, mut source) = dial(url, tls).await?;
    let opening = next_message(&mut source)
        .await
        .context("the hub's challenge")?;
    let Message::Challenge(challenge) = opening else {
        bail!("the hub did not open with a challenge");
    };
    let role = identity.role;
    let hello = Hello::answer_for_order(
        &challenge,
        identity.key,
        role,
        identity.model_id,
        identity.backend,
        identity.experts,
        identity.order,
    );
    let _ = tx.send(Message::Hello(hello).encode().into());
    let reply = next_message(&mut source)
        .await
        .context("the hub's answer to our hello")?;
    match reply {
        Message::Welcome(welcome) => Ok(Connected {
            tx,
            source,
            session: welcome.session,
            challenge,
            notice: welcome.notice,
        }),
        Message::Failure(failure) => bail!("the hub refused this {role:?}: {}", failure.message),
        _ => bail!("the hub refused this {role:?}"),
    }
}

/// Opens a WebSocket to `url`: `wss://` through TLS with `tls`'s roots, `ws://` in the clear
/// (for a LAN), offering the subprotocol of this version ([`SUBPROTOCOL`]). Returns the
/// sending channel and the receiving half. A hub that does not take the subprotocol speaks an
/// older version, and is reported as such.
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
    let mut request = url
        .into_client_request()
        .with_context(|| format!("{url:?} is not a WebSocket URL"))?;
    request.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    let (ws, _) = tokio_tungstenite::client_async_with_config(request, stream, Some(ws_config()))
        .await
        .map_err(|e| match e {
            tungstenite::Error::Protocol(tungstenite::error::ProtocolError::SecWebSocketSubProtocolError(_)) => {
                anyhow::anyhow!("the hub did not take subprotocol {SUBPROTOCOL}: it speaks a protocol version older than {VERSION}")
            }
            e => anyhow::Error::new(e),
        })
        .with_context(|| format!("WebSocket handshake with {url}"))?;
    Ok(split(ws, None))
}

/// Completes a client's WebSocket handshake (the hub's side of `dial`), within
/// `ws_config`'s limits. The link speaks this version when the client offers [`SUBPROTOCOL`]
/// (which the answer then names), else [`PREVIOUS_VERSION`]: a client of that version offers
/// none, and must be written its own version's frames from the first one on.
pub async fn accept<T>(stream: T) -> Result<(WebSocketStream<T>, u8), tungstenite::Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut version = VERSION;
    // The callback's type is tungstenite's, whose error is a whole HTTP response.
    #[allow(clippy::result_large_err)]
    let ws = tokio_tungstenite::accept_hdr_async_with_config(
        stream,
        |request: &Request, response| {
            let (response, spoken) = negotiate(request, response);
            version = spoken;
            Ok(response)
        },
        Some(ws_config()),
    )
    .await?;
    Ok((ws, version))
}

/// The answer to a client's WebSocket upgrade, and the version the link speaks (`accept`).
fn negotiate(request: &Request, mut response: Response) -> (Response, u8) {
    let offered = request
        .headers()
        .get_all("Sec-WebSocket-Protocol")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|protocol| protocol.trim() == SUBPROTOCOL);
    if !offered {
        return (response, PREVIOUS_VERSION);
    }
    response.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    (response, VERSION)
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

/// A link silent this long is given up on unless a role's `--idle-timeout-ms` says otherwise
/// (three of the hub's default ping intervals).
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 45_000;

/// How a link is kept alive: a ping every `ping`; a write that cannot finish within `idle`
/// (the peer reads nothing) ends the writer.
#[derive(Clone, Copy, Debug)]
pub struct Keepalive {
    pub ping: Duration,
    pub idle: Duration,
}

/// Splits a link: frames sent on the returned channel are written in order by a task that
/// ends (closing the socket) when every sender is dropped or a write fails. With `keepalive`
/// the task also pings the peer and gives up on a write that stalls.
pub fn split<T>(
    ws: WebSocketStream<T>,
    keepalive: Option<Keepalive>,
) -> (mpsc::UnboundedSender<Bytes>, Source<T>)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    split_as(ws, keepalive, VERSION)
}

/// As `split`, for a link of protocol `version`: every frame sent is written with that
/// version in its header (`crate::restamped`), as a hub writes to a client of
/// `PREVIOUS_VERSION` the frames it relays.
pub fn split_as<T>(
    ws: WebSocketStream<T>,
    keepalive: Option<Keepalive>,
    version: u8,
) -> (mpsc::UnboundedSender<Bytes>, Source<T>)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sink, source) = ws.split();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_frames(sink, rx, keepalive, version));
    (tx, source)
}

async fn write_frames<T>(
    mut sink: SplitSink<WebSocketStream<T>, WsMessage>,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    keepalive: Option<Keepalive>,
    version: u8,
) where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut pings = keepalive.map(|k| {
        let mut pings = tokio::time::interval_at(Instant::now() + k.ping, k.ping);
        pings.set_missed_tick_behavior(MissedTickBehavior::Delay);
        pings
    });
    let limit = keepalive.map(|k| k.idle);
    loop {
        let message = tokio::select! {
            frame = rx.recv() => match frame {
                Some(frame) if version == VERSION => WsMessage::Binary(frame),
                Some(frame) => WsMessage::Binary(crate::restamped(&frame, version).into()),
                None => break,
            },
            () = next_ping(&mut pings) => WsMessage::Ping(Bytes::new()),
        };
        if !within(limit, sink.send(message)).await {
            return;
        }
    }
    within(limit, sink.close()).await;
}

/// The next tick of `pings`; never, without pings.
async fn next_ping(pings: &mut Option<Interval>) {
    match pings {
        Some(pings) => {
            pings.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Whether `write` succeeded, within `limit` when there is one.
async fn within<E>(limit: Option<Duration>, write: impl Future<Output = Result<(), E>>) -> bool {
    match limit {
        Some(limit) => matches!(tokio::time::timeout(limit, write).await, Ok(Ok(()))),
        None => write.await.is_ok(),
    }
}

/// A link's read half that fails (a `TimedOut` I/O error) once nothing at all, no frame, ping
/// or pong, has arrived for `idle`. Time spent not polling it counts: what arrived meanwhile
/// is read before the deadline is looked at.
pub struct Idle<S> {
    inner: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> Idle<S> {
    pub fn new(inner: S, idle: Duration) -> Idle<S> {
        Idle {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl<S> Stream for Idle<S>
where
    S: Stream<Item = Result<WsMessage, tungstenite::Error>> + Unpin,
{
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<S::Item>> {
        let this = &mut *self;
        if let Poll::Ready(item) = this.inner.poll_next_unpin(cx) {
            this.deadline.as_mut().reset(Instant::now() + this.idle);
            return Poll::Ready(item);
        }
        ready!(this.deadline.as_mut().poll(cx));
        let silent = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("nothing arrived for {:?}", this.idle),
        );
        Poll::Ready(Some(Err(tungstenite::Error::Io(silent))))
    }
}

/// Binds `addr` and prints `<role> listening on <addr>` (the bound port when 0 was asked).
pub async fn bind(role: &str, addr: SocketAddr) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("{role}: cannot listen on {addr}"))?;
    println!("{role} listening on {}", listener.local_addr()?);
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEEPALIVE: Keepalive = Keepalive {
        ping: Duration::from_millis(50),
        idle: Duration::from_millis(400),
    };

    /// A server end with `KEEPALIVE` (its read half under `Idle`) and a plain client end, over
    /// loopback.
    async fn pair() -> (
        (mpsc::UnboundedSender<Bytes>, Idle<Source<TcpStream>>),
        (mpsc::UnboundedSender<Bytes>, Source<TcpStream>),
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let (ws, _) = tokio_tungstenite::client_async(format!("ws://{addr}/"), tcp)
                .await
                .unwrap();
            split(ws, None)
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let (ws, _) = accept(tcp).await.unwrap();
        let (tx, source) = split(ws, Some(KEEPALIVE));
        (
            (tx, Idle::new(source, KEEPALIVE.idle)),
            client.await.unwrap(),
        )
    }

    fn upgrade(protocols: &[&str]) -> (Response, u8) {
        let mut request = Request::new(());
        for protocol in protocols {
            request.headers_mut().append(
                "Sec-WebSocket-Protocol",
                HeaderValue::from_str(protocol).unwrap(),
            );
        }
        negotiate(&request, Response::new(()))
    }

    /// The subprotocol of this version, alone or among others, makes a link of this version
    /// and is named in the answer; none (a client of the previous version), or others only,
    /// a link of the previous version with no subprotocol named.
    #[test]
    fn the_offered_subprotocol_picks_the_links_version() {
        for offered in [&[SUBPROTOCOL][..], &["chat, kvasir.4"], &["x", SUBPROTOCOL]] {
            let (response, version) = upgrade(offered);
            assert_eq!(version, VERSION, "{offered:?}");
            assert_eq!(response.headers()["Sec-WebSocket-Protocol"], SUBPROTOCOL);
        }
        for offered in [&[][..], &["kvasir.3"], &["kvasir.40"]] {
            let (response, version) = upgrade(offered);
            assert_eq!(version, PREVIOUS_VERSION, "{offered:?}");
            assert!(response.headers().get("Sec-WebSocket-Protocol").is_none());
        }
    }

    /// A client of this version dialing a server that does not take its subprotocol (a hub
    /// of an older version) is told so.
    #[tokio::test]
    async fn a_hub_that_ignores_the_subprotocol_is_an_older_one() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let _ws = tokio_tungstenite::accept_async(tcp).await;
        });
        let tls = crate::tls::client(None).unwrap();
        let error = dial(&url, &tls).await.err().expect("refused");
        assert!(format!("{error:#}").contains("older than 4"), "{error:#}");
    }

    #[tokio::test]
    async fn a_peer_that_reads_answers_pings_and_stays() {
        let ((_server_tx, mut server), (client_tx, mut client)) = pair().await;
        let server = tokio::spawn(async move { next_frame(&mut server).await });
        // The client reads (passing over the pings, answering each) for twice the server's
        // idle timeout, then sends a frame: the server, reading all along, is still there.
        let reading = tokio::time::timeout(KEEPALIVE.idle * 2, next_frame(&mut client)).await;
        assert!(reading.is_err(), "only pings were sent, yet: {reading:?}");
        client_tx.send(Bytes::from_static(b"still here")).unwrap();
        let frame = server.await.unwrap().expect("the link survived");
        assert_eq!(&frame[..], b"still here");
    }

    #[tokio::test]
    async fn a_hub_on_the_old_protocol_version_is_reported_as_such() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/", listener.local_addr().unwrap());
        let hub = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let (ws, _) = accept(tcp).await.unwrap();
            let (tx, source) = split(ws, None);
            let challenge = Challenge {
                nonce: [1; 32],
                hub: Keypair::from_seed(&[1; 32]).address(),
                chain_id: "kvasir-test".into(),
            };
            let mut frame = Message::Challenge(challenge).encode();
            frame[4] = 1;
            tx.send(frame.into()).unwrap();
            (tx, source)
        });
        let key = Keypair::from_seed(&[2; 32]);
        let identity = Identity {
            key: &key,
            role: Role::Worker,
            model_id: "m".into(),
            backend: "cpu".into(),
            experts: vec![],
            order: 0,
        };
        let tls = crate::tls::client(None).unwrap();
        let refused = connect(&url, &tls, identity).await;
        let error = format!("{:#}", refused.err().expect("refused"));
        assert_eq!(
            error,
            "the hub's challenge: protocol version 1, this node speaks 4"
        );
        drop(hub.await.unwrap());
    }

    #[tokio::test]
    async fn a_peer_that_reads_nothing_is_dropped_within_the_idle_timeout() {
        let ((_server_tx, mut server), _client) = pair().await;
        let start = std::time::Instant::now();
        let ended = tokio::time::timeout(KEEPALIVE.idle * 3, next_frame(&mut server))
            .await
            .expect("a silent peer must be given up on");
        let error = format!("{:#}", ended.expect_err("nothing was sent"));
        assert!(error.contains("nothing arrived"), "{error}");
        assert!(start.elapsed() >= KEEPALIVE.idle, "{:?}", start.elapsed());
    }
}
