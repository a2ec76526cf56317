//! What a worker is paid, to the base unit: `earned` of its sessions' metered bytes, less
//! the fee each of its credits pays out of that pay.

use kvasir_api::ledger::HistoryEvent;
use kvasir_api::Client;
use kvasir_ledger::fees::{FeeBid, Lane};
use kvasir_ledger::{Address, Amount, Genesis, Keypair, Receipt, Storage, TxKind};

/// The fee one credit pays on this chain: every credit has the same size on a chain (its
/// fields are fixed-width but for the chain id), at the reserved lane's fixed price, and
/// the gateway tips none.
pub fn credit_fee(genesis: &Genesis) -> u64 {
    let Some(fees) = genesis.params.fees else {
        return 0;
    };
    let key = Keypair::from_seed(&[0; 32]);
    let receipt = Receipt {
        chain_id: genesis.chain_id(),
        hub: key.address(),
        session_id: 0,
        worker: key.address(),
        order: 0,
        cumulative_bytes: 0,
    };
    let bid = FeeBid::suggested(&fees, fees.min_base_fee, Lane::Reserved, Amount::ZERO);
    let credit =
        TxKind::Credit(receipt.sign(&key)).signed_paying(&genesis.chain_id(), Some(bid), &key, 0);
    credit.to_bytes().len() as u64 * fees.lane_fee.base_units()
}

/// How many credits paying `worker` the ledger at `client` has committed, from its history.
pub fn credits_of(client: &Client, worker: &Address) -> u64 {
    let mut credits = 0;
    let mut before: Option<String> = None;
    loop {
        let page = client.history(worker, before.as_deref()).unwrap();
        credits += page
            .entries
            .iter()
            .filter(|e| matches!(&e.event, HistoryEvent::Credit { worker: w, .. } if w == worker))
            .count() as u64;
        match page.next_before {
            Some(next) => before = Some(next),
            None => return credits,
        }
    }
}

/// What `worker`, whose key held nothing but its bond before it served, holds (balance and
/// pending) when it has earned `earned` base units in all: that, less its credits' fees.
pub fn expected_held(client: &Client, genesis: &Genesis, worker: &Address, earned: u64) -> u64 {
    earned - credits_of(client, worker) * credit_fee(genesis)
}

/// As `credits_of`, read from a stopped ledger's store.
pub fn credits_in_store(store: &dyn Storage, worker: &Address) -> u64 {
    let head = store.head().unwrap();
    (1..=head)
        .flat_map(|height| store.block(height).unwrap().unwrap().txs)
        .filter(|tx| matches!(&tx.tx.kind, TxKind::Credit(c) if c.receipt.worker == *worker))
        .count() as u64
}
