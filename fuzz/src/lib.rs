//! What the targets share: the dev chain (its genesis and its published keys), so that fuzzed
//! transactions and blocks can be re-signed by keys the chain knows and reach the checks behind
//! the signatures.

use kvasir_ledger::{Genesis, Keypair, State};
use std::sync::OnceLock;

pub struct DevChain {
    pub state: State,
    pub validator: Keypair,
    pub gateway: Keypair,
    pub hub: Keypair,
    pub faucet: Keypair,
}

fn key(text: &str) -> Keypair {
    kvasir_keyfile::parse(text, None).expect("a dev key")
}

pub fn dev_chain() -> &'static DevChain {
    static CHAIN: OnceLock<DevChain> = OnceLock::new();
    CHAIN.get_or_init(|| {
        let genesis = Genesis::from_json(include_str!("../../genesis/dev/genesis.json"))
            .expect("the dev genesis");
        DevChain {
            state: State::from_genesis(genesis),
            validator: key(include_str!("../../genesis/dev/keys/validator.key")),
            gateway: key(include_str!("../../genesis/dev/keys/gateway.key")),
            hub: key(include_str!("../../genesis/dev/keys/hub.key")),
            faucet: key(include_str!("../../genesis/dev/keys/faucet.key")),
        }
    })
}

/// Balances plus pending rewards, which every block must leave as genesis made them.
pub fn assert_supply_kept(state: &State) {
    assert_eq!(
        state.total_money(),
        u128::from(state.genesis().total_supply().base_units()),
        "supply changed"
    );
}
