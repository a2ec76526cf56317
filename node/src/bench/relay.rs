//! `kvasir-node bench relay`: dispatch frames through the real gateway (TLS, raw splice) and
//! hub processes, between an in-process backbone client and an in-process worker that
//! answers each request with a response of the size it implies, signed as every answer is
//! (so the hub's hash and signature check are in the figures), next to the same frames over
//! one direct TLS WebSocket connection between two endpoints of the same stack (the
//! reference: `relay_vs_direct_wss`), and over bare loopback TCP for context, in the same
//! run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use anyhow::{bail, Context, Result};
use kvasir_ledger::keys::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use kvasir_devnet::Loopback;
use kvasir_wire::link::{connect, dial, next_frame, next_message, Connected, Dialed, Identity};
use kvasir_wire::tls;
use kvasir_wire::{request_hash, AnswerScope, Message, Relayed, Request, Response, Role};

#[derive(clap::Args)]
pub struct Args {
    /// Round trips timed for the latency figures (small frames).
    #[arg(long, default_value_t = 500)]
    frames: usize,
    /// Rows per large frame for the throughput figure (1,024 f32 each).
    #[arg(long, default_value_t = 256)]
    rows: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const HIDDEN: usize = 1024;
/// Large frames in flight at once for the throughput figure.
const WINDOW: usize = 4;

fn request(id: u64, session: u64, rows: usize) -> Message {
    Message::Request(Request {
        session,
        id,
        layer: 0,
        hidden: HIDDEN as u32,
        format: kvasir_wire::RowFormat::F32,
        rows: vec![0.25; rows * HIDDEN],
        experts: vec![(0, (0..rows as u32).collect())],
    })
}

/// Something that carries a request frame to its answerer and brings back the answer.
trait Path {
    async fn send(&mut self, frame: Vec<u8>) -> Result<()>;
    async fn receive(&mut self) -> Result<usize>;
}

struct Relay {
    tx: tokio::sync::mpsc::UnboundedSender<tokio_tungstenite::tungstenite::Bytes>,
    source: Dialed,
}

impl Path for Relay {
    async fn send(&mut self, frame: Vec<u8>) -> Result<()> {
        self.tx.send(frame.into()).context("hub link closed")
    }
    async fn receive(&mut self) -> Result<usize> {
        loop {
            let frame = next_frame(&mut self.source).await?;
            match Message::inspect(&frame)? {
                Relayed::Response { .. } => return Ok(frame.len()),
                Relayed::Failure { .. } => bail!("request failed: {:?}", Message::decode(&frame)),
                _ => continue,
            }
        }
    }
}

/// Length-prefixed frames over a plain TCP connection to an echo server.
struct Direct(TcpStream);

impl Path for Direct {
    async fn send(&mut self, frame: Vec<u8>) -> Result<()> {
        // One write per frame, as the WebSocket path makes.
        let mut framed = Vec::with_capacity(frame.len() + 4);
        framed.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        framed.extend_from_slice(&frame);
        self.0.write_all(&framed).await?;
        Ok(())
    }
    async fn receive(&mut self) -> Result<usize> {
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).await?;
        let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut frame).await?;
        Ok(frame.len())
    }
}

/// Frames over one TLS WebSocket connection (the product's own dialer, tokio-tungstenite over
/// rustls) to an echo server of the same stack: the swarm's link without a gateway or hub.
struct DirectWss {
    tx: tokio::sync::mpsc::UnboundedSender<tokio_tungstenite::tungstenite::Bytes>,
    source: Dialed,
}

impl Path for DirectWss {
    async fn send(&mut self, frame: Vec<u8>) -> Result<()> {
        self.tx.send(frame.into()).context("link closed")
    }
    async fn receive(&mut self) -> Result<usize> {
        Ok(next_frame(&mut self.source).await?.len())
    }
}

/// Accepts TLS WebSocket connections and sends every binary message back.
async fn wss_echo_server(listener: TcpListener, tls: Arc<ServerConfig>) {
    let acceptor = TlsAcceptor::from(tls);
    while let Ok((stream, _)) = listener.accept().await {
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(stream).await else {
                return;
            };
            let Ok((ws, _)) = kvasir_wire::link::accept(stream).await else {
                return;
            };
            let (mut sink, mut source) = ws.split();
            while let Ok(frame) = next_frame(&mut source).await {
                if sink.send(WsMessage::Binary(frame)).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn echo_server(listener: TcpListener) {
    while let Ok((mut stream, _)) = listener.accept().await {
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let mut len = [0u8; 4];
            while stream.read_exact(&mut len).await.is_ok() {
                let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
                if stream.read_exact(&mut frame).await.is_err()
                    || stream.write_all(&len).await.is_err()
                    || stream.write_all(&frame).await.is_err()
                {
                    return;
                }
            }
        });
    }
}

/// A worker that answers every request with zeros of the implied size, signed.
async fn answering_worker(url: String, cert: std::path::PathBuf) -> Result<()> {
    let tls = tls::client(Some(&cert))?;
    let key = Keypair::generate();
    let identity = Identity {
        key: &key,
        role: Role::Worker,
        model_id: "bench".into(),
        backend: "cpu".into(),
        experts: vec![(0, 0)],
        order: 0,
    };
    let Connected {
        tx,
        mut source,
        session,
        challenge,
        ..
    } = connect(&url, &tls, identity).await?;
    let scope = AnswerScope::new(&challenge, session, "bench");
    // Like the echo server on the direct path, it does no more than answer (and sign, which
    // every worker must): the request is inspected, not copied out.
    loop {
        let frame = next_frame(&mut source).await?;
        if let Relayed::Request {
            id,
            response_values,
            ..
        } = Message::inspect(&frame)?
        {
            let response = Response::unsigned(id, vec![0f32; response_values]);
            let frame = response.signed_frame(&scope, request_hash(&frame), &key);
            tx.send(frame.into())?;
        }
    }
}

struct Figures {
    p50: Duration,
    p99: Duration,
    bytes_per_s: f64,
}

async fn measure(
    path: &mut impl Path,
    session: u64,
    frames: usize,
    rows: usize,
) -> Result<Figures> {
    let mut times = Vec::with_capacity(frames);
    for id in 0..frames as u64 {
        let start = Instant::now();
        path.send(request(id, session, 1).encode()).await?;
        path.receive().await?;
        times.push(start.elapsed());
    }
    times.sort();
    // Each large frame has its own id (the hub pairs answers with requests by id).
    let big = |id: usize| request((frames + id) as u64, session, rows).encode();
    let size = big(0).len();
    let rounds = (64 << 20) / (2 * size) + WINDOW;
    let start = Instant::now();
    let mut bytes = 0;
    for id in 0..WINDOW {
        path.send(big(id)).await?;
    }
    for round in 0..rounds {
        bytes += size + path.receive().await?;
        if round + WINDOW < rounds {
            path.send(big(round + WINDOW)).await?;
        }
    }
    Ok(Figures {
        p50: times[times.len() / 2],
        p99: times[times.len() * 99 / 100],
        bytes_per_s: bytes as f64 / start.elapsed().as_secs_f64(),
    })
}

pub fn run(args: Args) -> Result<()> {
    if args.frames == 0 || args.rows == 0 {
        bail!("--frames and --rows must be positive");
    }
    let scratch = tempfile::tempdir()?;
    let swarm = Loopback::on_dev_chain(scratch.path())?;
    let runtime = tokio::runtime::Runtime::new()?;
    let cert = swarm.cert.clone();
    let (relay, direct, wss) = runtime.block_on(async {
        let url = Loopback::swarm_url(swarm.gateway_addr.port());
        tokio::spawn(async move {
            if let Err(e) = answering_worker(url, cert).await {
                tracing::error!("bench worker: {e:#}");
            }
        });
        let tls = tls::client(None)?;
        let identity = Identity {
            key: &swarm.backbone,
            role: Role::Backbone,
            model_id: "bench".into(),
            backend: "cpu".into(),
            experts: vec![],
            order: 0,
        };
        let hub = format!("ws://{}", swarm.hub_addr);
        let Connected { tx, mut source, .. } = connect(&hub, &tls, identity).await?;
        let session = loop {
            if let Message::Directory(d) = next_message(&mut source).await? {
                if let Some(entry) = d.sessions.first() {
                    break entry.session;
                }
            }
        };
        let relay = measure(&mut Relay { tx, source }, session, args.frames, args.rows).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(echo_server(listener));
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let direct = measure(&mut Direct(stream), session, args.frames, args.rows).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let wss_cert = scratch.path().join("wss-cert.pem");
        tokio::spawn(wss_echo_server(listener, tls::self_signed(&wss_cert)?));
        let (tx, source) = dial(
            &format!("wss://localhost:{port}/"),
            &tls::client(Some(&wss_cert))?,
        )
        .await?;
        let wss = measure(
            &mut DirectWss { tx, source },
            session,
            args.frames,
            args.rows,
        )
        .await?;
        anyhow::Ok((relay, direct, wss))
    })?;
    let ratio = relay.bytes_per_s / direct.bytes_per_s;
    let wss_ratio = relay.bytes_per_s / wss.bytes_per_s;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if args.json {
        let value = serde_json::json!({
            "relay_bytes_per_s": relay.bytes_per_s, "direct_wss_bytes_per_s": wss.bytes_per_s,
            "direct_tcp_bytes_per_s": direct.bytes_per_s,
            "relay_vs_direct_wss": wss_ratio, "relay_vs_direct_tcp": ratio,
            "relay_p50_ms": ms(relay.p50), "relay_p99_ms": ms(relay.p99),
            "direct_wss_p50_ms": ms(wss.p50), "direct_wss_p99_ms": ms(wss.p99),
            "direct_tcp_p50_ms": ms(direct.p50), "direct_tcp_p99_ms": ms(direct.p99),
        });
        println!("{value}");
        return Ok(());
    }
    println!("kvasir-node bench relay: worker -> gateway (TLS) -> hub -> backbone, vs one direct TLS WebSocket, vs bare loopback TCP");
    println!(
        "{:<28} {:>14} {:>14} {:>14}",
        "figure", "relay", "direct wss", "direct tcp"
    );
    println!(
        "{:<28} {:>9.1} MB/s {:>9.1} MB/s {:>9.1} MB/s",
        format!("throughput ({} KiB frames)", args.rows * HIDDEN * 4 / 1024),
        relay.bytes_per_s / 1e6,
        wss.bytes_per_s / 1e6,
        direct.bytes_per_s / 1e6
    );
    let p50: fn(&Figures) -> Duration = |f| f.p50;
    let p99: fn(&Figures) -> Duration = |f| f.p99;
    for (name, pick) in [
        ("round trip p50 (4 KiB)", p50),
        ("round trip p99 (4 KiB)", p99),
    ] {
        println!(
            "{:<28} {:>11.3} ms {:>11.3} ms {:>11.3} ms",
            name,
            ms(pick(&relay)),
            ms(pick(&wss)),
            ms(pick(&direct))
        );
    }
    println!(
        "{:<28} {:>14.3}  target >= 0.6",
        "relay_vs_direct_wss", wss_ratio
    );
    println!(
        "{:<28} {:>14.3}  (bare TCP, for context)",
        "relay_vs_direct_tcp", ratio
    );
    Ok(())
}
