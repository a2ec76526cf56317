//! `kvasir-node ledger`: the ledger service. Admits signed transactions (stateless checks,
//! and the stateful ones when the nonce is the account's next), produces a block every
//! genesis interval with the validator key, or sooner when a full block's worth is waiting
//! (so a backlog drains at the speed of verification, not one block per interval), commits
//! it atomically, and serves the REST API (`api`). Ctrl-C or SIGTERM stops between blocks:
//! nothing is ever half-committed.
//!
//! The room: the service itself (admission, the block producer) here, its REST API in `api`.
//! It may touch the ledger crate and its store; nothing of the swarm.

mod api;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::mempool::{Mempool, MempoolError};
use kvasir_ledger::tx::check_stateful;
use kvasir_ledger::{
    check_stateless, produce_block, Genesis, Hash, Keypair, SignedTx, SledStore, State, Storage,
    TxError,
};

use crate::link;

/// Transactions waiting at most; beyond, submissions are refused until blocks drain it.
const MEMPOOL_CAPACITY: usize = 100_000;

#[derive(clap::Args)]
pub struct Args {
    /// The chain's genesis.json.
    #[arg(long)]
    genesis: PathBuf,
    /// Where blocks and state are stored (created on first start).
    #[arg(long, default_value = "kvasir-ledger")]
    data_dir: PathBuf,
    /// The REST API's address.
    #[arg(long, default_value = "127.0.0.1:7200")]
    listen: SocketAddr,
    /// The validator key that signs blocks (a validator named in genesis).
    #[arg(long)]
    key: PathBuf,
}

/// Why a submitted transaction was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Invalid(#[from] TxError),
    #[error(transparent)]
    Mempool(#[from] MempoolError),
}

/// What became of a transaction that left the mempool without being committed.
#[derive(Clone, Debug)]
pub struct Rejection(pub String);

pub struct Ledger {
    pub store: SledStore,
    state: RwLock<State>,
    mempool: Mutex<Mempool>,
    /// The genesis' max_block_txs: what makes a block full.
    block_limit: usize,
    /// Signalled when the mempool holds a full block.
    full: Condvar,
    rejected: Mutex<HashMap<Hash, Rejection>>,
    validator: Keypair,
    pub blocks_produced: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Ledger {
    pub fn open(genesis: &Genesis, dir: &std::path::Path, validator: Keypair) -> Result<Ledger> {
        if !genesis.is_validator(&validator.address()) {
            bail!("{} is not a validator of this chain", validator.address());
        }
        let store = SledStore::open_or_create(dir, genesis)?;
        if store.genesis()?.hash() != genesis.hash() {
            bail!("{} holds another chain than this genesis", dir.display());
        }
        let state = store.load_state()?;
        Ok(Ledger {
            store,
            state: RwLock::new(state),
            mempool: Mutex::new(Mempool::new(MEMPOOL_CAPACITY)),
            block_limit: genesis.params.max_block_txs as usize,
            full: Condvar::new(),
            rejected: Mutex::new(HashMap::new()),
            validator,
            blocks_produced: Default::default(),
        })
    }

    /// The state at the head (cheap: states share structure).
    pub fn state(&self) -> State {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Admits each of `txs` to the mempool (signatures batch-verified in parallel); per
    /// transaction its hash or why it was refused.
    pub fn submit(&self, txs: Vec<SignedTx>) -> Vec<Result<Hash, Refusal>> {
        let state = self.state();
        let checked = check_stateless(state.genesis(), txs);
        let mut mempool = lock(&self.mempool);
        let verdicts = checked
            .into_iter()
            .map(|verified| {
                let verified = verified?;
                let account = state.account(&verified.tx().tx.sender);
                // The next transaction of its sender can be checked in full now; later
                // nonces wait for their predecessors and are checked in block production.
                if verified.tx().tx.nonce <= account.nonce {
                    check_stateful(&state, verified.tx())?;
                }
                Ok(mempool.insert(verified)?)
            })
            .collect();
        if mempool.len() >= self.block_limit {
            self.full.notify_one();
        }
        verdicts
    }

    /// Waits until `deadline`, or less if a full block's worth of transactions is waiting.
    pub fn wait_for_block(&self, deadline: Instant) {
        let timeout = deadline.saturating_duration_since(Instant::now());
        let waiting = lock(&self.mempool);
        let _ = self
            .full
            .wait_timeout_while(waiting, timeout, |mempool| mempool.len() < self.block_limit);
    }

    pub fn is_pending(&self, hash: &Hash) -> bool {
        lock(&self.mempool).contains(hash)
    }

    pub fn rejection(&self, hash: &Hash) -> Option<Rejection> {
        lock(&self.rejected).get(hash).cloned()
    }

    pub fn mempool_len(&self) -> usize {
        lock(&self.mempool).len()
    }

    /// Produces and commits the next block from the mempool (possibly empty).
    pub fn produce(&self) -> Result<()> {
        let state = self.state();
        let candidates = lock(&self.mempool).candidates(self.block_limit);
        let produced = produce_block(&state, &candidates, &self.validator, now_ms())?;
        self.store.commit(&produced.block, &produced.changes)?;
        let included = produced.block.txs.iter().map(SignedTx::hash);
        let dropped: Vec<Hash> = produced.rejected.iter().map(|(h, _)| *h).collect();
        lock(&self.mempool).remove(included.chain(dropped.iter().copied()));
        let mut rejected = lock(&self.rejected);
        for (hash, error) in produced.rejected {
            rejected.insert(hash, Rejection(error.to_string()));
        }
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = produced.state;
        self.blocks_produced.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

pub fn run(args: Args) -> Result<()> {
    let genesis = Genesis::load(&args.genesis)?;
    let validator = kvasir_keyfile::open(&args.key)?;
    let ledger = Arc::new(
        Ledger::open(&genesis, &args.data_dir, validator)
            .with_context(|| format!("opening the ledger in {}", args.data_dir.display()))?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let interval = Duration::from_millis(genesis.params.block_interval_ms.max(1));
    let producer = {
        let (ledger, stop) = (ledger.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut next = Instant::now() + interval;
            while !stop.load(Ordering::Relaxed) {
                ledger.wait_for_block(next);
                // A full block made early leaves the regular schedule as it was.
                if Instant::now() >= next {
                    next += interval;
                }
                if let Err(e) = ledger.produce() {
                    // Storage failing under us: stop rather than serve a head that cannot move.
                    eprintln!("error: producing a block: {e:#}");
                    std::process::exit(1);
                }
            }
        })
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = link::bind("ledger", args.listen).await?;
        let app = api::router(ledger.clone());
        axum::serve(listener, app)
            .with_graceful_shutdown(crate::shutdown::requested())
            .await?;
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    if producer.join().is_err() {
        bail!("the block producer panicked");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::genesis::{init, key_path, load_template};
    use kvasir_ledger::{Amount, TxKind};

    /// A ledger whose blocks hold at most 3 transactions, and its faucet key.
    fn small_blocks(dir: &std::path::Path) -> (Ledger, Keypair) {
        let mut template = load_template(None).unwrap();
        template.params.max_block_txs = 3;
        let chain = dir.join("chain");
        let genesis = init(&chain, &template).unwrap();
        let key = |role| kvasir_keyfile::read(&key_path(&chain, role), None).unwrap();
        let ledger = Ledger::open(&genesis, &dir.join("ledger"), key("validator")).unwrap();
        (ledger, key("faucet"))
    }

    fn transfers(ledger: &Ledger, from: &Keypair, nonces: std::ops::Range<u64>) {
        let chain_id = ledger.state().genesis().params.chain_id.clone();
        let to = Keypair::generate().address();
        let txs = nonces
            .map(|n| {
                let amount = Amount::parse("1").unwrap();
                TxKind::Transfer { to, amount }.signed(&chain_id, from, n)
            })
            .collect();
        assert!(ledger.submit(txs).iter().all(Result::is_ok));
    }

    #[test]
    fn a_full_block_is_made_without_waiting_for_the_interval() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, faucet) = small_blocks(dir.path());
        // Two of three: the producer waits out its deadline.
        transfers(&ledger, &faucet, 0..2);
        let start = Instant::now();
        ledger.wait_for_block(start + Duration::from_millis(200));
        assert!(start.elapsed() >= Duration::from_millis(200));
        // A full block's worth wakes it long before its deadline.
        let ledger = Arc::new(ledger);
        let waiter = {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                ledger.wait_for_block(start + Duration::from_secs(60));
                start.elapsed()
            })
        };
        transfers(&ledger, &faucet, 2..4);
        assert!(waiter.join().unwrap() < Duration::from_secs(30));
        ledger.produce().unwrap();
        assert_eq!(ledger.state().height(), 1);
        assert_eq!(ledger.mempool_len(), 1);
    }
}
