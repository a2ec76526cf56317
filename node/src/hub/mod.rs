//! `kvasir-node hub`: LAN-only. Completes the WebSocket handshakes of workers (arriving
//! through the gateway's raw splice) and of the backbone, authenticates both by a signed
//! challenge, keeps the directory of which session holds which experts, relays dispatch
//! frames, meters each session's well-formed traffic in the registry and serves signed
//! cumulative receipts.
//!
//! Liveness: the hub pings every link every `--ping-interval-ms` and drops one (a worker
//! leaves the directory) from which nothing, not even a pong, arrived for
//! `--idle-timeout-ms`, or that does not take a frame within that time.
//!
//! Metering: a request's bytes and its response's bytes count when, and only when, the
//! response decodes, answers a request this hub relayed to that session, carries exactly
//! the values the request implies, and carries the worker's answer signature over exactly
//! that request and response (`kvasir_wire::AnswerScope`: this hub's chain id and key, the session,
//! the model of its hello). Anything else drops the worker and counts nothing; a wrong-sized
//! or badly signed answer is also reported to the backbone as a failure at once, so it
//! computes those experts locally.
//!
//! Bonds: with `--ledger`, a worker is admitted only while the ledger says its key has at
//! least the chain's `min_bond` bonded and is not jailed: asked at its hello, and again every
//! `--bond-recheck-ms` while it is connected (`standing`); a worker refused either time is
//! told why.
//!
//! The room: `relay` (frames between backbone and sessions, what is unanswered), `metering`
//! (what an answer earns, a pure function), `registry` (the counts in sled), `receipts`
//! (signing them for the gateway), `standing` (re-checking connected keys). It may touch the
//! wire protocol and its own registry; of the ledger it only reads accounts (`bonds`).

mod metering;
mod receipts;
mod registry;
mod relay;
mod standing;
mod versions;

#[cfg(fuzzing)]
pub use relay::fuzzing::relay_script;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::routing::get;
use axum::Router;
use kvasir_ledger::genesis::Genesis;
use kvasir_ledger::keys::{Address, Keypair};
use tokio::net::TcpStream;
use utoipa::OpenApi;

use crate::bonds::BondCheck;
use crate::engine::Backend;
use crate::listen::{Acceptor, Limits};
use kvasir_devnet::chain::{dev_genesis_hash, refuse_exposed_dev_chain};
use kvasir_wire::link::{self, next_frame, Idle, Keepalive};
use kvasir_wire::{Challenge, DirectoryEntry, Failure, Message, Role, Welcome, WireError};
use receipts::{receipts, RegistryDoc};
use registry::Registry;
use relay::{distinct_claims, Links, DIRECTORY_INTERVAL};
use versions::Versions;

/// A client must complete the WebSocket handshake and its hello within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often each link is pinged unless `--ping-interval-ms` says otherwise.
const DEFAULT_PING_INTERVAL_MS: u64 = 15_000;

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
    /// Serve the published dev chain on an address that is not loopback (refused without:
    /// anyone can sign with its keys).
    #[arg(long)]
    allow_dev_chain: bool,
    /// Connections held at once (workers arrive through the gateway, so all from its address:
    /// the hub caps only the total, above the gateway's own cap so that the backbone always
    /// finds room).
    #[arg(long, default_value_t = 8192)]
    max_connections: usize,
    /// A request unanswered this long after it reached the hub is failed to the backbone, and
    /// an answer after it earns nothing. Keep it below the backbone's `--dispatch-timeout-ms`
    /// (5000) by more than the backbone takes to get a request here (the backbone's clock
    /// starts before it encodes and sends): an answer in between would be paid although the
    /// backbone, having computed it itself, neither uses nor audits it.
    #[arg(long, default_value_t = 4000)]
    answer_deadline_ms: u64,
    /// Every link (workers and the backbone) is pinged this often.
    #[arg(long, default_value_t = DEFAULT_PING_INTERVAL_MS, value_parser = clap::value_parser!(u64).range(1..))]
    ping_interval_ms: u64,
    /// A link from which nothing arrives (no frame, no pong) for this long is dropped; keep it
    /// well above `--ping-interval-ms`, and at least the workers' `--idle-timeout-ms`.
    #[arg(long, default_value_t = link::DEFAULT_IDLE_TIMEOUT_MS)]
    idle_timeout_ms: u64,
    /// The ledger API, asked at every worker's hello, and again every `--bond-recheck-ms` for
    /// each connected key, whether the key is bonded (at least the chain's min_bond) and not
    /// jailed; a worker that is not is refused, or dropped, with the reason (which it logs).
    /// A key whose standing cannot be read (the ledger unreachable) is refused at hello; a
    /// connected one keeps serving for 30 s of that before it is dropped. Without --ledger, on
    /// a chain with bonds, workers are admitted unchecked (with a warning).
    #[arg(long)]
    ledger: Option<String>,
    /// How often (with --ledger) the standing of every connected worker's key is asked again:
    /// one account read per distinct key each time.
    #[arg(long, default_value_t = standing::DEFAULT_RECHECK_MS, value_parser = clap::value_parser!(u64).range(1..))]
    bond_recheck_ms: u64,
    /// Until this time (RFC 3339, `2027-01-31T00:00:00Z`) also admit workers of the previous
    /// wire protocol version (3), so that an upgrade does not cut them off; they are warned in
    /// this hub's log. Without it, or after it, they are refused with a failure saying to
    /// upgrade. A backbone must always speak this version.
    #[arg(long, value_parser = parse_time)]
    previous_wire_until: Option<std::time::SystemTime>,
}

fn parse_time(text: &str) -> Result<std::time::SystemTime, String> {
    humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("{text:?} is not an RFC 3339 time (2027-01-31T00:00:00Z): {e}"))
}

struct Hub {
    key: Keypair,
    chain_id: String,
    backbone: Address,
    registry: Registry,
    links: Mutex<Links>,
    answer_deadline: Duration,
    keepalive: Keepalive,
    /// Whether a worker's key may serve; none: every key may.
    bonds: Option<BondCheck>,
    /// The ledger, to check that a backbone acting for an order may (`--ledger`).
    ledger: Option<kvasir_api::Client>,
    versions: Versions,
}

#[cfg(any(test, fuzzing))]
impl Hub {
    /// A hub with a fresh registry in `dir`, no links yet.
    fn for_tests(dir: &std::path::Path, answer_deadline: Duration) -> Hub {
        let key = Keypair::generate();
        Hub {
            chain_id: "kvasir-test".into(),
            backbone: key.address(),
            key,
            registry: Registry::open(&dir.join("registry")).expect("a registry"),
            links: Mutex::new(Links::default()),
            answer_deadline,
            keepalive: Keepalive {
                ping: Duration::from_millis(DEFAULT_PING_INTERVAL_MS),
                idle: Duration::from_millis(link::DEFAULT_IDLE_TIMEOUT_MS),
            },
            bonds: None,
            ledger: None,
            versions: Versions::default(),
        }
    }
}

fn is_lan(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_private() || v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_loopback() || (v6.segments()[0] & 0xfe00) == 0xfc00,
    }
}

pub fn run(args: Args) -> Result<()> {
    if args.idle_timeout_ms <= args.ping_interval_ms {
        bail!("--idle-timeout-ms must be longer than --ping-interval-ms, or honest links are dropped between pings");
    }
    for addr in [args.listen, args.registry_listen] {
        if !is_lan(addr.ip()) && !args.allow_public {
            bail!("{addr} is not a loopback or private address; the hub belongs on the LAN (pass --allow-public to override)");
        }
    }
    let genesis = Genesis::load(&args.genesis)?;
    refuse_exposed_dev_chain(
        "hub",
        &[args.listen, args.registry_listen],
        args.allow_dev_chain,
        || Ok(genesis.hash() == dev_genesis_hash()?),
    )?;
    let key = kvasir_keyfile::open(&args.key)?;
    if !genesis.is_hub(&key.address()) {
        tracing::warn!(hub = %key.address(), "this key is not a hub authority in genesis: the ledger will refuse its receipts");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let bonds = args.ledger.as_deref().map(BondCheck::new).transpose()?;
    if bonds.is_none() && genesis.bonds_required() {
        tracing::warn!("no --ledger: workers are admitted without checking their bonds");
    }
    let hub = Arc::new(Hub {
        key,
        chain_id: genesis.chain_id(),
        backbone: args.backbone,
        registry: Registry::open(&args.data_dir.join("registry"))?,
        links: Mutex::new(Links::default()),
        answer_deadline: Duration::from_millis(args.answer_deadline_ms),
        keepalive: Keepalive {
            ping: Duration::from_millis(args.ping_interval_ms),
            idle: Duration::from_millis(args.idle_timeout_ms),
        },
        bonds,
        ledger: args.ledger.as_deref().map(kvasir_api::Client::new),
        versions: Versions {
            previous_wire_until: args.previous_wire_until,
        },
    });
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(serve(
        hub,
        args.listen,
        args.registry_listen,
        args.max_connections,
        Duration::from_millis(args.bond_recheck_ms),
    ))
}

async fn serve(
    hub: Arc<Hub>,
    listen: SocketAddr,
    registry_listen: SocketAddr,
    max_connections: usize,
    bond_recheck: Duration,
) -> Result<()> {
    let listener = link::bind("hub", listen).await?;
    let registry = link::bind("hub registry", registry_listen).await?;
    let app = Router::new()
        .route("/receipts", get(receipts))
        .route(
            "/openapi.json",
            get(|| async { axum::Json(RegistryDoc::openapi()) }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(
                |axum::extract::State(hub): axum::extract::State<Arc<Hub>>| async move {
                    hub.metrics_text()
                },
            ),
        )
        .with_state(hub.clone());
    // The gateway's poll is the registry's only client; a small cap is plenty.
    let registry = Acceptor::new("hub registry", registry, Limits::total(256));
    tokio::spawn(async move { axum::serve(registry, app).await });
    let clock = hub.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(DIRECTORY_INTERVAL);
        loop {
            tick.tick().await;
            clock.tick(std::time::Instant::now());
        }
    });
    if hub.bonds.is_some() {
        // Its own thread: each check is a blocking HTTP request.
        let watcher = hub.clone();
        std::thread::Builder::new()
            .name("hub-standing".into())
            .spawn(move || {
                if let Some(bonds) = &watcher.bonds {
                    watcher.watch_standing(bonds, bond_recheck);
                }
            })
            .context("starting the bond re-check")?;
    }
    let listener = Acceptor::new("hub", listener, Limits::total(max_connections));
    loop {
        let (stream, peer, slot) = listener.next().await;
        let hub = hub.clone();
        tokio::spawn(async move {
            match connection(hub, stream).await {
                // An operator must see this one: that peer will never work until upgraded.
                Err(e) if of_another_version(&e) => {
                    tracing::warn!(%peer, "peer speaks another protocol version: {e:#}")
                }
                Err(e) => tracing::info!(%peer, "connection ended: {e:#}"),
                Ok(()) => {}
            }
            drop(slot);
        });
    }
}

/// Whether `error` is a frame of another protocol version.
fn of_another_version(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|cause| matches!(cause.downcast_ref(), Some(WireError::Version { .. })))
}

async fn connection(hub: Arc<Hub>, stream: TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    let (ws, challenge, hello, version) = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let (ws, version) = link::accept(stream).await?;
        // Frames written to a client of the previous version carry its version.
        let (tx, mut source) = link::split_as(ws, Some(hub.keepalive), version);
        let challenge = Challenge {
            nonce: rand::random(),
            hub: hub.key.address(),
            chain_id: hub.chain_id.clone(),
        };
        let _ = tx.send(Message::Challenge(challenge.clone()).encode().into());
        let hello = match Message::decode_as(&next_frame(&mut source).await?, version)
            .context("the hello")?
        {
            Message::Hello(hello) => hello,
            _ => bail!("expected a hello"),
        };
        anyhow::Ok(((tx, source), challenge, hello, version))
    })
    .await
    .context("handshake timed out")??;
    if !hello.verify(&challenge) {
        bail!("hello from {} does not answer this challenge", hello.key);
    }
    let (tx, source) = ws;
    let mut source = Idle::new(source, hub.keepalive.idle);
    // Every frame the hub itself writes to this link is of the link's version (the writer
    // stamps only the header; a hello's and a welcome's bodies differ between versions).
    let send = |message: Message| {
        let _ = tx.send(message.encode_as(version).into());
    };
    let refuse =
        |why: &dyn std::fmt::Display| send(Message::Failure(Failure::new(0, why.to_string())));
    let notice = match hub
        .versions
        .admit(version, &hello, std::time::SystemTime::now())
    {
        Ok(notice) => notice,
        Err(why) => {
            refuse(&why);
            bail!("refused {:?} {}: {why}", hello.role, hello.key);
        }
    };
    if version != kvasir_wire::VERSION {
        tracing::warn!(worker = %hello.key, "admitted on wire protocol version {version}: {notice}");
    }
    match hello.role {
        Role::Worker => {
            if Backend::named(&hello.backend).is_none() {
                let why = format!(
                    "backend {:?} is not one that gives the reference bits (cpu, cuda)",
                    hello.backend
                );
                refuse(&why);
                bail!("refused {}: {why}", hello.key);
            }
            let standing = {
                let (hub, key) = (hub.clone(), hello.key);
                tokio::task::spawn_blocking(move || {
                    hub.bonds.as_ref().map_or(Ok(()), |b| b.standing(&key))
                })
                .await?
            };
            if let Err(why) = standing {
                refuse(&why);
                bail!("refused {}: {why}", hello.key);
            }
            let experts = match distinct_claims(hello.experts) {
                Ok(experts) => experts,
                Err(why) => {
                    refuse(&why);
                    bail!("refused {}: {why}", hello.key);
                }
            };
            let session = hub.registry.new_session()?;
            let entry = DirectoryEntry {
                session,
                worker: hello.key,
                model_id: hello.model_id,
                experts,
            };
            let claimed = entry.experts.len();
            let mut expelled = {
                // The welcome goes out under the lock, so no relayed request can precede it.
                let mut links = hub.links();
                let expelled = match links.add_worker(entry, tx.clone()) {
                    Ok(expelled) => expelled,
                    Err(why) => {
                        refuse(&why);
                        bail!("refused {}: {why}", hello.key);
                    }
                };
                if version == kvasir_wire::PREVIOUS_VERSION {
                    links.of_previous_version(session);
                }
                send(Message::Welcome(Welcome::new(session, notice)));
                expelled
            };
            tracing::info!(session, worker = %hello.key, experts = claimed, "worker attached");
            // A session of the previous version ends with its window.
            let mut window = std::pin::pin!(hub.versions.window_end(version));
            let result = async {
                loop {
                    tokio::select! {
                        frame = next_frame(&mut source) => {
                            hub.relay_answer(session, versions::as_current(frame?, version)?)?
                        }
                        why = &mut window => {
                            refuse(&why);
                            bail!("dropped {}: {why}", hello.key);
                        }
                        // Already out of the directory and told why (`Hub::expel`).
                        why = &mut expelled => match why {
                            Ok(why) => bail!("dropped {}: {why}", hello.key),
                            // Removed without a reason: only this connection does that,
                            // after this loop, so this is a bug elsewhere; end cleanly.
                            Err(_) => bail!("session {session} was removed"),
                        },
                    }
                }
            }
            .await;
            hub.remove_worker(session);
            result
        }
        Role::Backbone if hello.key == hub.backbone => {
            if hello.order != 0 {
                let (hub, key, order) = (hub.clone(), hello.key, hello.order);
                let checked = tokio::task::spawn_blocking(move || hub.may_act_for(&key, order));
                if let Err(why) = checked.await? {
                    refuse(&format!("{why:#}"));
                    bail!("refused the backbone: {why:#}");
                }
            }
            send(Message::Welcome(Welcome::new(0, notice)));
            let (stop, mut stopped) = tokio::sync::oneshot::channel();
            let connection = hub.links().attach_backbone(tx, hello.order, stop);
            tracing::info!(order = hello.order, "backbone attached");
            let result = async {
                loop {
                    tokio::select! {
                        frame = next_frame(&mut source) => hub.relay_request(connection, frame?)?,
                        why = &mut stopped => match why {
                            Ok(why) => bail!("backbone dropped: {why}"),
                            // Replaced by a newer connection of the backbone.
                            Err(_) => bail!("backbone connection {connection} replaced"),
                        },
                    }
                }
            }
            .await;
            hub.links()
                .detach_backbone(connection, std::time::Instant::now());
            result
        }
        Role::Backbone => bail!("{} is not this hub's backbone", hello.key),
    }
}

impl Hub {
    /// Drops the attached backbone if its order has closed on the ledger (or its key may no
    /// longer act for it): workers must not go on serving an order that no longer pays. A
    /// ledger that cannot be read changes nothing. Blocking (one HTTP request).
    fn recheck_order(&self) {
        let order = self.links().backbone_order();
        if order == 0 {
            return;
        }
        let Some(ledger) = &self.ledger else {
            return;
        };
        // Only a definite answer drops it: the order closed, another key acts for it, or the
        // ledger has no such order. A ledger or proxy that fails to answer changes nothing.
        let why = match ledger.order(order) {
            Err(kvasir_api::ClientError::Api { status: 404, .. }) => {
                format!("the ledger has no order {order}")
            }
            Err(_) => return,
            Ok(view) => match refusal(&view, &self.backbone) {
                Some(why) => why,
                None => return,
            },
        };
        if self.links().stop_backbone(order, &why) {
            tracing::warn!("dropping the backbone of order {order}: {why}");
        }
    }

    /// Whether `key` may run the backbone for market `order`: the order is live on the
    /// ledger and `key` is its buyer or its delegate. Blocking (one HTTP request).
    fn may_act_for(&self, key: &Address, order: u64) -> Result<()> {
        let ledger = self
            .ledger
            .as_ref()
            .context("this hub has no --ledger to check the order a backbone acts for")?;
        let found = ledger
            .order(order)
            .with_context(|| format!("reading order {order}"))?;
        match refusal(&found, key) {
            Some(why) => bail!("{why}"),
            None => Ok(()),
        }
    }
}

/// Why `key` may not run the backbone for `order`: closed or paused, or neither its buyer
/// nor its delegate; `None` when it may.
fn refusal(order: &kvasir_api::market::OrderView, key: &Address) -> Option<String> {
    // Paused, its escrow cannot pay the next block: its workers must not be kept busy.
    if order.state == "closed" || order.state == "paused" {
        return Some(format!("order {} is {}", order.id, order.state));
    }
    if order.buyer != *key && order.delegate != Some(*key) {
        return Some(format!(
            "{key} is neither the buyer nor the delegate of order {}",
            order.id
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_of_another_version_is_told_apart_from_other_failures() {
        let mut frame = Message::Welcome(Welcome::new(1, "")).encode();
        frame[4] = 1;
        let old = anyhow::Error::from(Message::decode(&frame).unwrap_err()).context("the hello");
        assert!(of_another_version(&old));
        assert_eq!(
            format!("{old:#}"),
            "the hello: protocol version 1, this node speaks 4"
        );
        frame[0] = b'X';
        let garbage = anyhow::Error::from(Message::decode(&frame).unwrap_err());
        assert!(!of_another_version(&garbage));
    }
}
