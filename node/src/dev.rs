//! `kvasir-node dev`: the newcomer's first command. Until the swarm lands (backbone, hub,
//! gateway and workers as processes), it runs the ledger half of the loop in one process:
//! a hub-signed receipt for the announcement's first internet session is credited by the
//! gateway key to a worker's wallet, stays pending through the challenge window, settles,
//! and the whole chain is re-verified from genesis. A second run reuses the data dir and
//! meters the next session.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::mempool::Mempool;
use kvasir_ledger::{
    check_stateless, produce_block, verify_chain, Address, Amount, Genesis, Keypair, Receipt,
    SignedTx, State, Store, TxKind,
};

use crate::genesis::{genesis_path, install_dev_chain, key_path};

/// Bytes relayed in the announcement's first internet session.
const SEED_SESSION_BYTES: u64 = 1_277_952;

#[derive(clap::Args)]
pub struct Args {
    /// Where the dev chain, its keys and the worker's wallet live; reused by later runs.
    #[arg(long, default_value = "kvasir-data")]
    data_dir: PathBuf,
}

/// The dev chain's ledger and its block producer.
struct DevChain {
    store: Store,
    state: State,
    validator: Keypair,
}

impl DevChain {
    /// Produces and durably commits one block holding `txs`; every one must be accepted.
    fn commit_block(&mut self, txs: Vec<SignedTx>) -> Result<()> {
        let mut mempool = Mempool::new(txs.len().max(1));
        for checked in check_stateless(self.state.genesis(), txs) {
            mempool.insert(checked?)?;
        }
        let candidates = mempool.candidates(mempool.len());
        let produced = produce_block(&self.state, &candidates, &self.validator, now_ms())?;
        if let Some((hash, error)) = produced.rejected.first() {
            bail!("transaction {hash} was rejected: {error}");
        }
        self.store.commit(&produced.block, &produced.changes)?;
        self.state = produced.state;
        Ok(())
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The worker's own wallet key: created on the first run, reused after.
fn worker_key(path: &Path) -> Result<Keypair> {
    if !path.exists() {
        Keypair::generate().write_key_file(path)?;
    }
    Keypair::read_key_file(path).with_context(|| format!("reading {}", path.display()))
}

/// `bytes / unit_bytes` as exact decimal text with up to six places, for display.
fn units_text(bytes: u64, unit_bytes: u64) -> String {
    let micro = u128::from(bytes) * 1_000_000 / u128::from(unit_bytes);
    let text = format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn describe(state: &State, who: &Address) -> String {
    let account = state.account(who);
    let pending: Vec<String> = account
        .pending
        .iter()
        .map(|p| format!("{} settling at height {}", p.amount, p.settle_height))
        .collect();
    let pending = if pending.is_empty() {
        "none".to_string()
    } else {
        pending.join(", ")
    };
    format!("settled {}, pending {pending}", account.balance)
}

pub fn run(args: Args) -> Result<()> {
    let dir = &args.data_dir;
    let genesis = if genesis_path(dir).exists() {
        Genesis::load(&genesis_path(dir))?
    } else {
        install_dev_chain(dir)?
    };
    let key = |role: &str| {
        let path = key_path(dir, role);
        Keypair::read_key_file(&path).with_context(|| format!("reading {}", path.display()))
    };
    let (validator, gateway, hub, faucet) = (
        key("validator")?,
        key("gateway")?,
        key("hub")?,
        key("faucet")?,
    );
    let worker = worker_key(&key_path(dir, "worker-1"))?.address();
    let ledger_dir = dir.join("ledger");
    let store = Store::open_or_create(&ledger_dir, &genesis)?;
    let state = store.load_state()?;
    let mut chain = DevChain {
        store,
        state,
        validator,
    };

    println!(
        "Kvasir dev chain {} (genesis {}) in {}",
        genesis.params.chain_id,
        genesis.hash(),
        dir.display()
    );
    println!("  The swarm (backbone, hub, gateway, workers) lands in later issues; this run");
    println!("  exercises the ledger they settle on, with the real keys, signatures and storage.");
    let session_id = chain
        .state
        .receipts()
        .filter(|(k, _)| k.hub == hub.address())
        .count() as u64
        + 1;
    let receipt = Receipt {
        chain_id: genesis.params.chain_id.clone(),
        hub: hub.address(),
        session_id,
        worker,
        cumulative_bytes: SEED_SESSION_BYTES,
    };
    let earned = genesis
        .earned(SEED_SESSION_BYTES)
        .context("reward overflows")?;
    println!(
        "session {session_id}: hub signed a receipt for {SEED_SESSION_BYTES} bytes relayed by worker {worker}"
    );
    println!(
        "  {} units x {} per unit = {earned}",
        units_text(SEED_SESSION_BYTES, genesis.params.unit_bytes),
        genesis.params.reward_per_unit
    );
    let nonce = |who: &Keypair| chain.state.account(&who.address()).nonce;
    let chain_id = &genesis.params.chain_id;
    let credit = TxKind::Credit(receipt.sign(&hub)).signed(chain_id, &gateway, nonce(&gateway));
    let tip = TxKind::Transfer {
        to: worker,
        amount: Amount::parse("1")?,
    }
    .signed(chain_id, &faucet, nonce(&faucet));
    chain.commit_block(vec![credit, tip])?;
    println!(
        "block {}: gateway credit + faucet transfer of 1 KVR committed",
        chain.state.height()
    );
    println!("  worker: {}", describe(&chain.state, &worker));
    for _ in 0..genesis.params.challenge_window {
        chain.commit_block(Vec::new())?;
    }
    println!(
        "blocks up to {}: the {}-block challenge window passes",
        chain.state.height(),
        genesis.params.challenge_window
    );
    println!("  worker: {}", describe(&chain.state, &worker));
    let report = verify_chain(&chain.store, |_, _| {})?;
    println!(
        "chain re-verified from genesis: {} blocks, {} transactions, state root {}",
        report.blocks, report.transactions, report.state_root
    );
    println!(
        "verify it yourself: cargo run --release -p kvasir-node -- verify-chain --data-dir {}",
        ledger_dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::units_text;

    #[test]
    fn units_are_exact_decimals() {
        assert_eq!(units_text(1_277_952, 1_000_000), "1.277952");
        assert_eq!(units_text(2_000_000, 1_000_000), "2");
        assert_eq!(units_text(1, 3), "0.333333");
    }
}
