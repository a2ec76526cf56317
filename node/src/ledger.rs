//! `kvasir-node ledger`: the ledger service. Admits signed transactions (stateless checks,
//! and the stateful ones when the nonce is the account's next), produces a block every
//! genesis interval with the validator key, commits it atomically, and serves the REST API
//! (`api`). Ctrl-C stops between blocks: nothing is ever half-committed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::mempool::{Mempool, MempoolError};
use kvasir_ledger::tx::check_stateful;
use kvasir_ledger::{
    check_stateless, produce_block, Genesis, Hash, Keypair, SignedTx, State, Store, TxError,
};

use crate::{api, link};

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
    pub store: Store,
    state: RwLock<State>,
    mempool: Mutex<Mempool>,
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
        let store = Store::open_or_create(dir, genesis)?;
        if store.genesis()?.hash() != genesis.hash() {
            bail!("{} holds another chain than this genesis", dir.display());
        }
        let state = store.load_state()?;
        Ok(Ledger {
            store,
            state: RwLock::new(state),
            mempool: Mutex::new(Mempool::new(MEMPOOL_CAPACITY)),
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
        checked
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
            .collect()
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
        let limit = state.genesis().params.max_block_txs as usize;
        let candidates = lock(&self.mempool).candidates(limit);
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
    let validator = kvasir_wallet::keyfile::open(&args.key)?;
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
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                next += interval;
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
