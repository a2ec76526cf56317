//! `kvasir-node hub`: LAN-only. Completes the WebSocket handshakes of workers (arriving
//! through the gateway's raw splice) and of the backbone, authenticates both by a signed
//! challenge, keeps the directory of which session holds which experts, relays dispatch
//! frames, meters each session's well-formed traffic in the registry and serves signed
//! cumulative receipts.
//!
//! Metering: a request's bytes and its response's bytes count when, and only when, the
//! response decodes, answers a request this hub relayed to that session, and carries exactly
//! the values the request implies. Anything else drops the worker and counts nothing.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::extract::State as AxumState;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use kvasir_ledger::genesis::Genesis;
use kvasir_ledger::keys::{Address, Keypair};
use kvasir_ledger::tx::Receipt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Bytes;

use crate::link::{self, next_frame, next_message};
use crate::registry::Registry;
use crate::wire::{Challenge, Directory, DirectoryEntry, Failure, Message, Relayed, Role, Welcome};

/// A client must complete the WebSocket handshake and its hello within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(clap::Args)]
pub struct Args {
    /// Where workers (through the gateway) and the backbone connect.
    #[arg(long, default_value = "127.0.0.1:7101")]
    listen: SocketAddr,
    /// The registry's HTTP endpoint (`GET /receipts`), polled by the gateway.
    #[arg(long, default_value = "127.0.0.1:7102")]
    registry_listen: SocketAddr,
    /// This hub's key file; receipts are signed with it (a hub authority of the chain).
    #[arg(long)]
    key: PathBuf,
    /// The chain's genesis.json (receipts name its chain id).
    #[arg(long)]
    genesis: PathBuf,
    /// Address of the one backbone allowed to attach.
    #[arg(long)]
    backbone: Address,
    /// Where the contribution registry is stored.
    #[arg(long, default_value = "kvasir-hub")]
    data_dir: PathBuf,
    /// Allow listening on a public address (the hub belongs on the LAN, behind the gateway).
    #[arg(long)]
    allow_public: bool,
}

struct Hub {
    key: Keypair,
    chain_id: String,
    backbone: Address,
    registry: Registry,
    links: Mutex<Links>,
}

#[derive(Default)]
struct Links {
    workers: BTreeMap<u64, WorkerLink>,
    backbone: Option<(u64, mpsc::UnboundedSender<Bytes>)>,
    backbone_connections: u64,
    /// Requests relayed and not yet answered: (session, request id) -> what answers them.
    outstanding: HashMap<(u64, u64), Outstanding>,
}

struct WorkerLink {
    entry: DirectoryEntry,
    tx: mpsc::UnboundedSender<Bytes>,
}

struct Outstanding {
    request_bytes: u64,
    response_values: usize,
}

impl Links {
    fn to_backbone(&self, frame: Bytes) {
        if let Some((_, tx)) = &self.backbone {
            let _ = tx.send(frame);
        }
    }

    fn send_directory(&self) {
        let sessions = self.workers.values().map(|w| w.entry.clone()).collect();
        self.to_backbone(Message::Directory(Directory { sessions }).encode().into());
    }
}

fn is_lan(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_private() || v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_loopback() || (v6.segments()[0] & 0xfe00) == 0xfc00,
    }
}

pub fn run(args: Args) -> Result<()> {
    for addr in [args.listen, args.registry_listen] {
        if !is_lan(addr.ip()) && !args.allow_public {
            bail!("{addr} is not a loopback or private address; the hub belongs on the LAN (pass --allow-public to override)");
        }
    }
    let genesis = Genesis::load(&args.genesis)?;
    let key = kvasir_wallet::keyfile::open(&args.key)?;
    if !genesis.is_hub(&key.address()) {
        tracing::warn!(hub = %key.address(), "this key is not a hub authority in genesis: the ledger will refuse its receipts");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let hub = Arc::new(Hub {
        key,
        chain_id: genesis.params.chain_id.clone(),
        backbone: args.backbone,
        registry: Registry::open(&args.data_dir.join("registry"))?,
        links: Mutex::new(Links::default()),
    });
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(serve(hub, args.listen, args.registry_listen))
}

async fn serve(hub: Arc<Hub>, listen: SocketAddr, registry_listen: SocketAddr) -> Result<()> {
    let listener = link::bind("hub", listen).await?;
    let registry = link::bind("hub registry", registry_listen).await?;
    let app = Router::new()
        .route("/receipts", get(receipts))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(hub.clone());
    tokio::spawn(async move { axum::serve(registry, app).await });
    loop {
        let (stream, peer) = listener.accept().await?;
        let hub = hub.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(hub, stream).await {
                tracing::info!(%peer, "connection ended: {e:#}");
            }
        });
    }
}

impl Hub {
    fn links(&self) -> MutexGuard<'_, Links> {
        // A panic while holding the lock is a bug elsewhere; the maps stay usable.
        self.links.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A frame from worker `session`: a response or failure answering a relayed request.
    fn relay_answer(&self, session: u64, frame: Bytes) -> Result<()> {
        let (id, values) = match Message::inspect(&frame)? {
            Relayed::Response { id, values } => (id, Some(values)),
            Relayed::Failure { id } => (id, None),
            _ => bail!("a worker may only send responses and failures"),
        };
        let asked = self.links().outstanding.remove(&(session, id));
        let Some(asked) = asked else {
            bail!("answer to request {id}, which this session was never sent");
        };
        if let Some(values) = values {
            if values != asked.response_values {
                bail!(
                    "response to request {id} carries {values} values, the request implies {}",
                    asked.response_values
                );
            }
            self.registry
                .meter(session, asked.request_bytes + frame.len() as u64)?;
        }
        self.links().to_backbone(frame);
        Ok(())
    }

    /// A frame from the backbone: a request for one worker session.
    fn relay_request(&self, frame: Bytes) -> Result<()> {
        let Relayed::Request {
            session,
            id,
            response_values,
        } = Message::inspect(&frame)?
        else {
            bail!("a backbone may only send requests");
        };
        let mut links = self.links();
        let Some(worker) = links.workers.get(&session) else {
            let message = format!("session {session} is not connected");
            links.to_backbone(Message::Failure(Failure { id, message }).encode().into());
            return Ok(());
        };
        let _ = worker.tx.send(frame.clone());
        links.outstanding.insert(
            (session, id),
            Outstanding {
                request_bytes: frame.len() as u64,
                response_values,
            },
        );
        Ok(())
    }

    fn remove_worker(&self, session: u64) {
        let mut links = self.links();
        links.workers.remove(&session);
        let lost: Vec<u64> = links
            .outstanding
            .keys()
            .filter(|(s, _)| *s == session)
            .map(|(_, id)| *id)
            .collect();
        for id in lost {
            links.outstanding.remove(&(session, id));
            let message = format!("session {session} left");
            links.to_backbone(Message::Failure(Failure { id, message }).encode().into());
        }
        links.send_directory();
    }
}

async fn connection(hub: Arc<Hub>, stream: TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    let (ws, challenge, hello) = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let ws =
            tokio_tungstenite::accept_async_with_config(stream, Some(link::ws_config())).await?;
        let (tx, mut source) = link::split(ws);
        let challenge = Challenge {
            nonce: rand::random(),
            hub: hub.key.address(),
            chain_id: hub.chain_id.clone(),
        };
        let _ = tx.send(Message::Challenge(challenge.clone()).encode().into());
        let hello = match next_message(&mut source).await? {
            Message::Hello(hello) => hello,
            _ => bail!("expected a hello"),
        };
        anyhow::Ok(((tx, source), challenge, hello))
    })
    .await
    .context("handshake timed out")??;
    if !hello.verify(&challenge) {
        bail!("hello from {} does not answer this challenge", hello.key);
    }
    let (tx, mut source) = ws;
    match hello.role {
        Role::Worker => {
            let session = hub.registry.open_session(hello.key)?;
            let _ = tx.send(Message::Welcome(Welcome { session }).encode().into());
            tracing::info!(session, worker = %hello.key, experts = hello.experts.len(), "worker attached");
            let entry = DirectoryEntry {
                session,
                worker: hello.key,
                model_id: hello.model_id,
                experts: hello.experts,
            };
            {
                let mut links = hub.links();
                links.workers.insert(session, WorkerLink { entry, tx });
                links.send_directory();
            }
            let result = async {
                loop {
                    hub.relay_answer(session, next_frame(&mut source).await?)?;
                }
            }
            .await;
            hub.remove_worker(session);
            result
        }
        Role::Backbone if hello.key == hub.backbone => {
            let _ = tx.send(Message::Welcome(Welcome { session: 0 }).encode().into());
            let connection = {
                let mut links = hub.links();
                links.backbone_connections += 1;
                let connection = links.backbone_connections;
                links.backbone = Some((connection, tx));
                links.send_directory();
                connection
            };
            tracing::info!("backbone attached");
            let result = async {
                loop {
                    hub.relay_request(next_frame(&mut source).await?)?;
                }
            }
            .await;
            let mut links = hub.links();
            if links
                .backbone
                .as_ref()
                .is_some_and(|(c, _)| *c == connection)
            {
                links.backbone = None;
            }
            result
        }
        Role::Backbone => bail!("{} is not this hub's backbone", hello.key),
    }
}

#[derive(serde::Serialize)]
struct ReceiptView {
    session_id: u64,
    worker: Address,
    cumulative_bytes: u64,
    /// The signed receipt, borsh-encoded, in hex: what a Credit transaction carries.
    signed: String,
}

/// `GET /receipts`: every session's signed cumulative receipt.
async fn receipts(
    AxumState(hub): AxumState<Arc<Hub>>,
) -> Result<Json<serde_json::Value>, (StatusCode, Json<serde_json::Value>)> {
    let internal = |e: anyhow::Error| {
        let body = serde_json::json!({"error": "internal", "message": format!("{e:#}")});
        (StatusCode::INTERNAL_SERVER_ERROR, Json(body))
    };
    let signer = hub.clone();
    let sessions = tokio::task::spawn_blocking(move || signer.registry.sessions())
        .await
        .map_err(|e| internal(e.into()))?
        .map_err(internal)?;
    let receipts: Vec<ReceiptView> = sessions
        .into_iter()
        .map(|(session_id, record)| {
            let signed = Receipt {
                chain_id: hub.chain_id.clone(),
                hub: hub.key.address(),
                session_id,
                worker: record.worker,
                cumulative_bytes: record.cumulative_bytes,
            }
            .sign(&hub.key);
            ReceiptView {
                session_id,
                worker: record.worker,
                cumulative_bytes: record.cumulative_bytes,
                signed: hex::encode(borsh::to_vec(&signed).unwrap_or_default()),
            }
        })
        .collect();
    Ok(Json(serde_json::json!({
        "chain_id": hub.chain_id,
        "hub": hub.key.address(),
        "receipts": receipts,
    })))
}
