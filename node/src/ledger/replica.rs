//! The ledger as the consensus engine drives it (`kvasir_consensus::Chain`): the engine
//! asks this node's validator for a block when it proposes, has every proposal checked
//! before this node votes for it, and hands over each decided block with its certificate to
//! commit. All of it goes through `Ledger`'s own `propose`, `validate` and `commit`, the pure
//! `produce_block` and `apply_block` underneath, so what a validator proposes and what every
//! node accepts are checked by the same code.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use kvasir_consensus::{Chain, Handle, Multiaddr, Settings};
use kvasir_ledger::{Address, Certificate, Genesis, Hash, Keypair};

use super::{Args, Ledger};

/// Starts consensus for `ledger`: as a validator with `validator`, else as a full node; its
/// write-ahead log lives in the ledger's data directory.
pub async fn start(
    genesis: &Genesis,
    validator: Option<Keypair>,
    args: &Args,
    ledger: Arc<Ledger>,
) -> Result<Handle> {
    let moniker = match &validator {
        Some(key) => format!("validator {}", key.address()),
        None => "full node".to_string(),
    };
    let settings = Settings {
        home: args.data_dir.join("consensus"),
        listen: multiaddr(args.p2p_listen)?,
        persistent_peers: args
            .peers
            .iter()
            .map(|p| multiaddr(*p))
            .collect::<Result<_>>()?,
        moniker,
    };
    kvasir_consensus::start(genesis, validator, settings, Replica(ledger)).await
}

/// The libp2p address of a TCP listener.
fn multiaddr(addr: SocketAddr) -> Result<Multiaddr> {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) => format!("/ip4/{ip}"),
        std::net::IpAddr::V6(ip) => format!("/ip6/{ip}"),
    };
    format!("{ip}/tcp/{}", addr.port())
        .parse()
        .with_context(|| format!("{addr} as a network address"))
}

pub struct Replica(pub Arc<Ledger>);

impl Chain for Replica {
    fn committed_height(&self) -> u64 {
        self.0.state().height()
    }

    fn propose(&mut self, height: u64) -> anyhow::Result<(Hash, Vec<u8>)> {
        self.0.propose(height)
    }

    fn validate(
        &mut self,
        height: u64,
        author: Option<&Address>,
        bytes: &[u8],
    ) -> Result<Hash, String> {
        self.0
            .validate(height, author, bytes)
            .map_err(|e| format!("{e:#}"))
    }

    fn commit(&mut self, bytes: &[u8], certificate: &Certificate) -> anyhow::Result<()> {
        self.0.commit(bytes, certificate)
    }

    fn decided(&self, height: u64) -> anyhow::Result<Option<(Vec<u8>, Certificate)>> {
        self.0.decided(height)
    }
}
