//! `kvasir-node gateway`: the only public face, one TLS port. A WebSocket upgrade on the
//! swarm path is handed to the hub and from then on bytes are copied both ways without
//! parsing a frame (`splice`); every other request is the REST API (`proxy`). It also
//! credits the hub's receipts on the ledger (`crediting`). It may touch the network, TLS and
//! the ledger's API; it never decodes a dispatch frame.

mod crediting;
mod inference;
mod proxy;
mod splice;
mod stall;
mod stats;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::ConnectInfo;
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use kvasir_api::Client;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use crate::listen::{Acceptor, Limits};
pub use crediting::Crediting;
use kvasir_devnet::chain::{dev_address, dev_genesis_hash, refuse_exposed_dev_chain};
use kvasir_wire::link;
use kvasir_wire::tls;
use proxy::{api, Upstream};
use splice::{is_swarm_upgrade, read_head, Rewind};
use stall::{WriteStall, WRITE_STALL};
use stats::{Counted, Stats};

/// The path workers upgrade on.
pub const SWARM_PATH: &str = "/swarm";
/// A TLS handshake or request head slower than this is dropped.
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
    /// The backbone's `--listen` address (`http://HOST:PORT`, on the LAN): its
    /// OpenAI-compatible API is served to the public under `/v1/`, streams included.
    #[arg(long)]
    backbone: Option<String>,
    /// `/v1/` requests one address (for IPv6, one /64) may have in progress at once; more are
    /// answered 429 in that API's error shape, so that no one client holds the backbone's
    /// whole batch and queue. A streamed answer holds its place until it ends.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    max_generations_per_ip: u64,
    /// The hub's registry (`http://HOST:PORT`), polled for receipts to credit.
    #[arg(long, requires_all = ["ledger", "key"])]
    registry: Option<String>,
    /// The gateway key that signs credits (a gateway authority of the chain).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Milliseconds between registry polls.
    #[arg(long, default_value_t = DEFAULT_CREDIT_INTERVAL_MS)]
    credit_interval_ms: u64,
    /// Milliseconds the relay waits for the ledger's whole answer before answering 504.
    #[arg(long, default_value_t = 10_000)]
    ledger_timeout_ms: u64,
    /// Serve the published dev chain on an address that is not loopback (refused without:
    /// anyone can sign with its keys).
    #[arg(long)]
    allow_dev_chain: bool,
    #[command(flatten)]
    limits: Limits,
}

/// The gateway's registry polling interval unless `--credit-interval-ms` says otherwise
/// (`bench credit` measures its latency with it).
pub const DEFAULT_CREDIT_INTERVAL_MS: u64 = 1000;

/// Whether this gateway would serve the published dev chain: its credit key is that chain's
/// published gateway key, or the ledger it relays holds the dev genesis (block 0's previous
/// hash is the genesis hash). A ledger that cannot be reached yet is not held against it.
fn serves_dev_chain(args: &Args) -> Result<bool> {
    if let Some(key) = &args.key {
        if kvasir_keyfile::address(key)? == dev_address("gateway")? {
            return Ok(true);
        }
    }
    let Some(ledger) = &args.ledger else {
        return Ok(false);
    };
    match Client::new(ledger).block(0) {
        Ok(block) => Ok(block.prev_hash == dev_genesis_hash()?),
        Err(e) => {
            tracing::warn!("could not ask {ledger} which chain it holds: {e}");
            Ok(false)
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    refuse_exposed_dev_chain("gateway", &[args.listen], args.allow_dev_chain, || {
        serves_dev_chain(&args)
    })?;
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
    let stats = Arc::new(Stats::default());
    if let (Some(registry), Some(ledger), Some(key)) = (&args.registry, &args.ledger, &args.key) {
        let crediting = Crediting::new(
            Client::new(ledger),
            Client::new(registry),
            kvasir_keyfile::open(key)?,
            stats.clone(),
        );
        let interval = Duration::from_millis(args.credit_interval_ms);
        std::thread::spawn(move || crediting.run(interval, &AtomicBool::new(false)));
    }
    let runtime = tokio::runtime::Runtime::new()?;
    let upstream = args
        .ledger
        .as_deref()
        .map(|url| Upstream::new(url, Duration::from_millis(args.ledger_timeout_ms)))
        .transpose()?;
    let backbone = args
        .backbone
        .as_deref()
        .map(|url| {
            let per_address = usize::try_from(args.max_generations_per_ip).unwrap_or(usize::MAX);
            inference::Backbone::new(url, per_address, stats.clone())
        })
        .transpose()?;
    runtime.block_on(async {
        // The relay's client spawns its connection tasks on this runtime.
        let api = api(upstream, backbone, stats.clone());
        let listener = link::bind("gateway", args.listen).await?;
        let tls = TlsAcceptor::from(config);
        let acceptor = Acceptor::new("gateway", listener, args.limits);
        serve(tls, acceptor, args.hub, api, stats).await
    })
}

async fn serve(
    tls: TlsAcceptor,
    listener: Acceptor,
    hub: SocketAddr,
    api: Router,
    stats: Arc<Stats>,
) -> Result<()> {
    loop {
        let (stream, peer, slot) = listener.next().await;
        let (tls, api, stats) = (tls.clone(), api.clone(), stats.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(tls, stream, peer, hub, api, stats).await {
                tracing::debug!(%peer, "connection ended: {e:#}");
            }
            drop(slot);
        });
    }
}

async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    hub: SocketAddr,
    api: Router,
    stats: Arc<Stats>,
) -> Result<()> {
    stream.set_nodelay(true)?;
    let handshake = async {
        let mut tls = tokio::time::timeout(HEAD_TIMEOUT, acceptor.accept(stream))
            .await
            .context("TLS handshake timed out")??;
        let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut tls))
            .await
            .context("request head timed out")??;
        anyhow::Ok((tls, head))
    };
    let (tls, head) = handshake.await.inspect_err(|_| stats.failed_handshake())?;
    if is_swarm_upgrade(&head) {
        let mut upstream = TcpStream::connect(hub)
            .await
            .with_context(|| format!("hub {hub} unreachable"))?;
        upstream.set_nodelay(true)?;
        let _open = stats.swarm_connection();
        upstream.write_all(&head).await?;
        stats.spliced_to_hub(head.len());
        let mut tls = Counted {
            inner: tls,
            stats: stats.clone(),
        };
        tokio::io::copy_bidirectional_with_sizes(
            &mut tls,
            &mut upstream,
            SPLICE_BUFFER,
            SPLICE_BUFFER,
        )
        .await?;
        return Ok(());
    }
    stats.api_connection();
    let io = TokioIo::new(Rewind {
        prefix: head,
        at: 0,
        inner: WriteStall::new(tls, WRITE_STALL),
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .serve_connection(
            io,
            // Each request carries its client's address (the `/v1/` relay caps by it).
            TowerToHyperService::new(api.layer(Extension(ConnectInfo(peer)))),
        )
        .await?;
    Ok(())
}
