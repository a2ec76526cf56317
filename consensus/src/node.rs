//! Starting the engine for one node: its network identity, configuration, WAL and the
//! application loop, and a handle to stop it.
//!
//! The network is Malachite's own libp2p over TCP (or QUIC, by the listen address), with
//! gossipsub for consensus messages and request-response for sync. Validators name each
//! other as persistent peers, and those are made explicit gossipsub peers, so that a small
//! set always delivers to every peer instead of relying on mesh formation. The per-IP
//! connection limit is raised because a test net runs every node on 127.0.0.1.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use bytesize::ByteSize;
use kvasir_ledger::{Genesis, Keypair};
use malachitebft_app_channel::app::config::{
    ConsensusConfig, DiscoveryConfig, GossipSubConfig, NodeConfig, P2pConfig, PubSubProtocol,
    ValuePayload, ValueSyncConfig,
};
use malachitebft_app_channel::app::engine::network::NetworkMsg;
use malachitebft_app_channel::app::engine::node::NodeRef;
use malachitebft_app_channel::app::net::Multiaddr;
use malachitebft_app_channel::app::types::codec::Codec;
use malachitebft_app_channel::app::types::core::SigningScheme;
use malachitebft_app_channel::{
    start_engine, ConsensusContext, EngineHandle, NetworkContext, NetworkIdentity, RequestContext,
    Signer, SyncContext, WalContext,
};
use tokio::task::JoinHandle;
use tracing::error;

use crate::app::{self, App};
use crate::chain::Chain;
use crate::codec::LedgerCodec;
use crate::context::{Address, LedgerContext, LedgerSigning, ValidatorSet};
use crate::signing::{LedgerSigner, LedgerVerifier};
use crate::store::Proposals;

/// How long sync waits between status broadcasts: how soon a node that fell behind learns
/// it has.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// Connections accepted from one IP address.
const MAX_CONNECTIONS_PER_IP: usize = 64;

/// How long stopping waits for the engine's actors.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how a node takes part in consensus.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The engine's WAL (`<home>/wal`) and the blocks proposed but not yet decided
    /// (`<home>/proposals`) live here.
    pub home: PathBuf,
    /// e.g. `/ip4/0.0.0.0/tcp/26656`.
    pub listen: Multiaddr,
    /// The other validators (and any node this one should stay connected to).
    pub persistent_peers: Vec<Multiaddr>,
    /// A name for logs.
    pub moniker: String,
}

struct EngineConfig {
    moniker: String,
    consensus: ConsensusConfig,
    value_sync: ValueSyncConfig,
}

impl NodeConfig for EngineConfig {
    fn moniker(&self) -> &str {
        &self.moniker
    }

    fn consensus(&self) -> &ConsensusConfig {
        &self.consensus
    }

    fn consensus_mut(&mut self) -> &mut ConsensusConfig {
        &mut self.consensus
    }

    fn value_sync(&self) -> &ValueSyncConfig {
        &self.value_sync
    }

    fn value_sync_mut(&mut self) -> &mut ValueSyncConfig {
        &mut self.value_sync
    }
}

fn engine_config(settings: &Settings, max_block_bytes: u64) -> EngineConfig {
    // A sync response carries a whole block, so it must fit the largest one.
    let max_response = ByteSize::b(max_block_bytes.saturating_add(1 << 20).max(10 << 20));
    let p2p = P2pConfig {
        listen_addr: settings.listen.clone(),
        persistent_peers: settings.persistent_peers.clone(),
        discovery: DiscoveryConfig {
            max_connections_per_ip: MAX_CONNECTIONS_PER_IP,
            ..DiscoveryConfig::default()
        },
        protocol: PubSubProtocol::GossipSub(GossipSubConfig::new(6, 12, 4, 2, false, true, true)),
        rpc_max_size: max_response,
        ..P2pConfig::default()
    };
    EngineConfig {
        moniker: settings.moniker.clone(),
        consensus: ConsensusConfig {
            p2p,
            value_payload: ValuePayload::ProposalAndParts,
            ..ConsensusConfig::default()
        },
        value_sync: ValueSyncConfig {
            status_update_interval: STATUS_INTERVAL,
            max_response_size: max_response,
            ..ValueSyncConfig::default()
        },
    }
}

/// The libp2p key of a validator: derived from its consensus seed, so its peer id is
/// stable, but a different key, so no secret signs in two protocols. A full node gets a
/// fresh one each start.
fn network_key(
    validator: Option<&Keypair>,
) -> anyhow::Result<malachitebft_app_channel::app::types::Keypair> {
    match validator {
        Some(key) => {
            let mut seed = blake3::derive_key("kvasir consensus p2p key v1", &*key.secret_bytes());
            malachitebft_app_channel::app::types::Keypair::ed25519_from_bytes(&mut seed)
                .context("deriving the p2p key")
        }
        None => Ok(malachitebft_app_channel::app::types::Keypair::generate_ed25519()),
    }
}

/// A running node's engine and application loop.
pub struct Handle {
    engine: EngineHandle,
    app: JoinHandle<anyhow::Result<()>>,
}

impl Handle {
    /// Waits until the engine stops by itself: an actor failed, the engine halted rather
    /// than risk equivocating, or a decided block could not be committed (the error).
    pub async fn wait(&mut self) -> anyhow::Result<()> {
        (&mut self.app)
            .await
            .context("the consensus loop panicked")?
    }

    /// Stops the engine and waits for it and the application loop.
    pub async fn stop(self) -> anyhow::Result<()> {
        shut_down(&self.engine.actor).await;
        let _ = tokio::time::timeout(STOP_TIMEOUT, self.engine.handle).await;
        match tokio::time::timeout(STOP_TIMEOUT, self.app).await {
            Ok(done) => done.context("the consensus loop panicked")?,
            Err(_) => Ok(()),
        }
    }
}

/// Stops the engine's actors, then the engine. Stopping one child makes the node stop
/// itself and kill the others, and a killed actor skips its cleanup: the network's
/// listener and connections would outlive the engine. So the children are unlinked first
/// and stopped one by one, the network last.
async fn shut_down(node: &NodeRef) {
    let mut children = node.get_children();
    children.sort_by_key(|c| c.is_message_type_of::<NetworkMsg<LedgerContext>>() == Some(true));
    for child in &children {
        child.unlink(node.get_cell());
    }
    for child in children {
        let _ = child.stop_and_wait(None, Some(STOP_TIMEOUT)).await;
    }
    let _ = node.stop_and_wait(None, Some(STOP_TIMEOUT)).await;
}

/// Starts consensus for `chain` on the chain of `genesis`: as a validator when `validator`
/// holds one of its validators' keys, as a full node that follows and syncs when `None`.
pub async fn start<C: Chain>(
    genesis: &Genesis,
    validator: Option<Keypair>,
    settings: Settings,
    chain: C,
) -> anyhow::Result<Handle> {
    let validators = ValidatorSet::from_genesis(genesis)?;
    let transport = settings
        .listen
        .protocol_stack()
        .any(|p| matches!(p, "tcp" | "quic" | "quic-v1"));
    anyhow::ensure!(
        transport,
        "listen address {} names neither tcp nor quic",
        settings.listen
    );
    std::fs::create_dir_all(&settings.home)
        .with_context(|| format!("creating {}", settings.home.display()))?;
    let proposals = Proposals::open(&settings.home.join("proposals"))?;
    let key = validator.clone();
    let chain_id = genesis.chain_id();
    let codec = LedgerCodec::new(genesis.params.max_block_bytes);
    let p2p_key = network_key(validator.as_ref())?;
    let verifier = Box::new(LedgerVerifier::new(chain_id.clone()));

    let (identity, consensus) = match validator {
        Some(key) => {
            let address = Address(key.address());
            anyhow::ensure!(
                genesis.is_validator(&address.0),
                "{} is not a validator of {chain_id}",
                address
            );
            let signer = LedgerSigner::new(key, chain_id.clone());
            let proof = signer
                .sign_validator_proof(
                    LedgerSigning::encode_public_key(&address.0),
                    p2p_key.public().to_peer_id().to_bytes(),
                )
                .await
                .map_err(|e| anyhow::anyhow!("signing the validator proof: {e}"))?;
            let proof = codec.encode(&proof)?;
            let identity = NetworkIdentity::new_validator(
                settings.moniker.clone(),
                p2p_key,
                address.to_string(),
                proof,
            );
            let consensus = ConsensusContext::new_validator(address, verifier, Box::new(signer));
            (identity, consensus)
        }
        None => {
            // The engine wants an address even for a node that never signs; one no
            // validator holds is never in the set.
            let address = Address(Keypair::generate().address());
            let identity = NetworkIdentity::new(settings.moniker.clone(), p2p_key, None);
            (identity, ConsensusContext::new_full_node(address, verifier))
        }
    };

    let config = engine_config(&settings, genesis.params.max_block_bytes);
    let (channels, engine) = start_engine(
        LedgerContext,
        config,
        WalContext::new(settings.home.join("wal").join("consensus.wal"), codec),
        NetworkContext::new(identity, codec),
        consensus,
        SyncContext::new(codec),
        RequestContext::new(100),
    )
    .await
    .map_err(|e| anyhow::anyhow!("starting the consensus engine: {e:#}"))?;

    let app = App::new(chain, genesis, validators, key, proposals);
    let node = engine.actor.clone();
    let app = tokio::spawn(async move {
        let result = app::run(app, channels).await;
        if let Err(e) = &result {
            error!("consensus stops: {e:#}");
            shut_down(&node).await;
        }
        result
    });
    Ok(Handle { engine, app })
}
