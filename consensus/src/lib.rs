//! BFT replication of the Kvasir ledger: the Malachite engine (Tendermint) decides each
//! block among the validators genesis names, and a `Chain` builds, checks and commits
//! blocks. A decided block is committed with a certificate of its validators' precommits
//! that the ledger can check offline (`kvasir_ledger::Certificate::verify`).
//!
//! The node calls `start` with its chain, genesis and key; everything else here is how the
//! engine is driven.

#![forbid(unsafe_code)]

mod app;
mod certificates;
mod chain;
mod codec;
mod context;
mod node;
mod parts;
mod signing;
mod store;

pub use chain::Chain;
pub use malachitebft_app_channel::app::net::Multiaddr;
pub use node::{start, Handle, Settings};

#[cfg(test)]
mod tests {
    use kvasir_ledger::genesis::{Authorities, ChainParams};
    use kvasir_ledger::{Amount, Genesis, Keypair};

    /// A valid genesis naming `n` validators, and their keys in address order.
    pub(crate) fn genesis_with(n: u8) -> (Genesis, Vec<Keypair>) {
        let mut keys: Vec<Keypair> = (0..n).map(|i| Keypair::from_seed(&[100 + i; 32])).collect();
        keys.sort_by_key(Keypair::address);
        let genesis = Genesis {
            genesis_time_ms: 1_764_000_000_000,
            params: ChainParams {
                chain_id: "kvasir-test".into(),
                format: kvasir_ledger::genesis::FORMAT,
                unit_bytes: 1_000_000,
                reward_per_unit: Amount::ZERO,
                challenge_window: 3,
                block_interval_ms: 100,
                max_block_txs: 100,
                max_block_bytes: 1 << 20,
                rewards_pool: Amount::ZERO,
                min_new_account: Amount::ZERO,
                min_bond: Amount::ZERO,
                unbonding_blocks: 0,
                slash_fraction: Default::default(),
                reporter_share: Default::default(),
                jail_blocks: 0,
                fees: Some(kvasir_ledger::fees::DEFAULT_FEES),
            },
            allocations: Vec::new(),
            authorities: Authorities {
                validators: keys.iter().map(Keypair::address).collect(),
                gateways: Vec::new(),
                hubs: Vec::new(),
            },
            models: Vec::new(),
        };
        (genesis, keys)
    }
}
