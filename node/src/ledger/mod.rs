//! `kvasir-node ledger`: the ledger service. Admits signed transactions (stateless checks,
//! then the mempool's bounds and stateful checks, `kvasir_ledger::mempool`), produces a block
//! every genesis interval with the validator key, or sooner when a full block's worth is
//! waiting (so a backlog drains at the speed of verification, not one block per interval),
//! commits it atomically, and serves the REST API (`api`). A block is never stamped further
//! ahead of this machine's clock than `MAX_CLOCK_DRIFT_MS`: while the head is (a chain whose
//! genesis time is still to come, a clock set back), no block is made. Ctrl-C or SIGTERM
//! stops between blocks: nothing is ever half-committed.
//!
//! The room: the service itself (admission, the block producer) here, its REST API in `api`.
//! It may touch the ledger crate and its store; nothing of the swarm.

mod api;
mod evidence_gate;
mod forward;
mod market_api;
#[cfg(feature = "consensus")]
mod replica;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::mempool::{Limits, Mempool, MempoolError};
use kvasir_ledger::state::AnswerCheck;
use kvasir_ledger::tx::{check_action, check_evidence_standing};
use kvasir_ledger::{
    apply_block, check_clock, check_stateless, produce_block, Address, Block, Certificate,
    ChangeSet, Genesis, Hash, Keypair, SignedTx, SledStore, State, Storage, TxError, VerifiedTx,
};

use self::evidence_gate::EvidenceGate;
use self::forward::Forwarder;
use crate::answers::evidence_check;
use crate::listen::{Acceptor, Limits as ConnectionLimits};
use crate::metrics::Histogram;
use kvasir_wire::link;

/// Rejections remembered for `GET /txs/{hash}`; beyond, the oldest are forgotten.
const REJECTIONS_KEPT: usize = 100_000;
/// Evidence waiting for its recomputation, at most, and for how long.
const EVIDENCE_LINE: usize = 32;
const EVIDENCE_PATIENCE: Duration = Duration::from_secs(10);
/// Blocks applied on the head and kept until one is decided.
const APPLIED_KEPT: usize = 16;
/// Blocks found invalid, remembered so that no peer makes this node apply one again.
const INVALID_KEPT: usize = 1024;
/// Pieces of evidence judged per submission: each may cost a recomputation.
const EVIDENCE_PER_REQUEST: usize = 4;

#[derive(clap::Args)]
pub struct Args {
    /// The chain's genesis.json.
    #[arg(long)]
    genesis: PathBuf,
    /// Where blocks, certificates, state and the consensus write-ahead log are stored
    /// (created on first start).
    #[arg(long, default_value = "kvasir-ledger")]
    data_dir: PathBuf,
    /// The REST API's address.
    #[arg(long, default_value = "127.0.0.1:7200")]
    listen: SocketAddr,
    /// This node's validator key (a validator named in genesis): it proposes and votes.
    /// Without one the node is a full node: it follows the validators' decided blocks,
    /// checks their certificates and serves the API.
    #[arg(long)]
    key: Option<PathBuf>,
    /// Where this node's consensus network listens for the other nodes (port 0: any free
    /// port, enough for a lone validator).
    #[arg(long, default_value = "127.0.0.1:0")]
    p2p_listen: SocketAddr,
    /// Another node's consensus address (repeatable): the validators, and any full node
    /// to serve.
    #[arg(long = "peer", value_name = "HOST:PORT")]
    peers: Vec<SocketAddr>,
    /// Another node's REST API (repeatable): transactions clients submit here are forwarded
    /// to it, so they reach whichever validator proposes next. One hop (what another node
    /// forwarded is not passed on), so name every validator.
    #[arg(long = "forward", value_name = "URL")]
    forward: Vec<String>,
    /// Connections held at once (clients come through the gateway, so this caps only the
    /// total).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Format-1 chains only: a checkpoint evidence is recomputed with; repeat it for each
    /// model the genesis pins. Every pinned model is required, and nothing else (the node
    /// refuses to start otherwise): validators judging evidence with different models would
    /// disagree. A format-2 chain's evidence carries the disputed expert's weights, checked
    /// against the genesis pin, and its nodes need no checkpoint.
    #[arg(long = "model", value_name = "DIR")]
    models: Vec<PathBuf>,
}

/// Why a submitted transaction was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Invalid(#[from] TxError),
    #[error(transparent)]
    Mempool(#[from] MempoolError),
    #[error("too much evidence is waiting to be recomputed; submit this one again shortly")]
    EvidenceBusy,
}

/// What became of a transaction that left the mempool without being committed.
#[derive(Clone, Debug)]
pub struct Rejection(pub String);

/// The newest rejections, at most `cap`, the oldest forgotten first: a flood of transactions
/// that fail in production cannot grow the service's memory.
struct Rejections {
    cap: usize,
    order: VecDeque<Hash>,
    reasons: HashMap<Hash, Rejection>,
}

impl Rejections {
    fn new(cap: usize) -> Rejections {
        Rejections {
            cap,
            order: VecDeque::new(),
            reasons: HashMap::new(),
        }
    }

    fn get(&self, hash: &Hash) -> Option<Rejection> {
        self.reasons.get(hash).cloned()
    }

    fn insert(&mut self, hash: Hash, rejection: Rejection) {
        if self.reasons.insert(hash, rejection).is_none() {
            self.order.push_back(hash);
        }
        while self.order.len() > self.cap {
            if let Some(oldest) = self.order.pop_front() {
                self.reasons.remove(&oldest);
            }
        }
    }
}

pub struct Ledger {
    pub store: SledStore,
    state: RwLock<State>,
    mempool: Mutex<Mempool>,
    /// The genesis' max_block_txs: what makes a block full.
    block_limit: usize,
    /// Signalled when the mempool holds a full block.
    full: Condvar,
    rejected: Mutex<Rejections>,
    /// The line evidence waits in to be recomputed at admission.
    evidence: EvidenceGate,
    /// What this node proposes with; none on a full node.
    validator: Option<Keypair>,
    /// The genesis block interval: a proposal waits this long after the last commit.
    interval: Duration,
    applied: Mutex<HashMap<Hash, Applied>>,
    /// Blocks that failed `apply_block`, the newest `INVALID_KEPT`: a block is invalid
    /// whatever the head it was made for, so it is never applied twice.
    invalid: Mutex<Rejections>,
    /// Where transactions admitted here go on to; none for a node on its own.
    forwarder: Option<Forwarder>,
    pub blocks_produced: std::sync::atomic::AtomicU64,
    /// Time between blocks made here.
    pub block_interval: Histogram,
    last_block: Mutex<Option<Instant>>,
    /// Transactions refused at admission or dropped from a block, by reason (the error's
    /// variant: a fixed set, so the map stays small).
    refusals: Mutex<BTreeMap<String, u64>>,
}

/// A refusal's reason as a metric label: its variant's name.
fn reason(error: &dyn std::fmt::Debug) -> String {
    let text = format!("{error:?}");
    text.split(|c: char| !c.is_ascii_alphanumeric())
        .next()
        .unwrap_or("unknown")
        .to_string()
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
    /// The ledger of `genesis` stored in `dir`, proposing with `validator` (none: a full
    /// node) and checking evidence with `answers` (without, evidence is refused).
    pub fn open(
        genesis: &Genesis,
        dir: &std::path::Path,
        validator: Option<Keypair>,
        answers: Option<Arc<dyn AnswerCheck>>,
    ) -> Result<Ledger> {
        if let Some(validator) = &validator {
            if !genesis.is_validator(&validator.address()) {
                bail!("{} is not a validator of this chain", validator.address());
            }
        }
        let store = SledStore::open_or_create(dir, genesis)?;
        if store.genesis()?.hash() != genesis.hash() {
            bail!("{} holds another chain than this genesis", dir.display());
        }
        let mut state = store.load_state()?;
        if let Some(answers) = answers {
            state = state.with_answer_check(answers);
        }
        Ok(Ledger {
            store,
            state: RwLock::new(state),
            mempool: Mutex::new(Mempool::new(Limits::default())),
            block_limit: genesis.params.max_block_txs as usize,
            full: Condvar::new(),
            rejected: Mutex::new(Rejections::new(REJECTIONS_KEPT)),
            evidence: EvidenceGate::new(EVIDENCE_LINE, EVIDENCE_PATIENCE),
            validator,
            interval: Duration::from_millis(genesis.params.block_interval_ms),
            applied: Mutex::default(),
            invalid: Mutex::new(Rejections::new(INVALID_KEPT)),
            forwarder: None,
            blocks_produced: Default::default(),
            block_interval: Histogram::default(),
            last_block: Mutex::new(None),
            refusals: Mutex::default(),
        })
    }

    /// The state at the head (cheap: states share structure).
    pub fn state(&self) -> State {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `Mempool::suggested_tip` for a next block whose open lane holds `room` transactions.
    pub fn suggested_tip(&self, room: usize) -> kvasir_ledger::Amount {
        lock(&self.mempool).suggested_tip(room)
    }

    /// Admits each of `txs` to the mempool (signatures batch-verified in parallel); per
    /// transaction its hash or why it was refused. What a client submitted is forwarded to
    /// the `--forward` nodes; what another node `forwarded` is not.
    pub fn submit(&self, txs: Vec<SignedTx>, forwarded: bool) -> Vec<Result<Hash, Refusal>> {
        let forwarder = self.forwarder.as_ref().filter(|_| !forwarded);
        // Evidence may cost a recomputation each: a few per request, one per session (the
        // mempool's one place per session is not taken until the batch is judged).
        let mut sessions = HashSet::new();
        let checked = check_stateless(self.state().genesis(), txs)
            .into_iter()
            .map(|verified| {
                let verified = verified?;
                if let Some((e, _)) = verified.tx().tx.kind.evidence() {
                    if sessions.len() >= EVIDENCE_PER_REQUEST {
                        return Err(Refusal::EvidenceBusy);
                    }
                    if !sessions.insert((e.worker, e.hub, e.session)) {
                        return Err(MempoolError::EvidenceWaiting {
                            worker: e.worker,
                            hub: e.hub,
                            session: e.session,
                        }
                        .into());
                    }
                }
                self.judge_evidence(verified)
            })
            .collect::<Vec<_>>();
        // The state is read under the mempool lock, which `produce` holds from the store's
        // commit until both agree with it: a client that saw its last transaction committed
        // has its next nonces checked against that block, not the one before.
        let mut mempool = lock(&self.mempool);
        let state = self.state();
        let mut admitted = Vec::new();
        let verdicts: Vec<Result<Hash, Refusal>> = checked
            .into_iter()
            .map(|judged| {
                let (verified, checked) = judged?;
                let tx = forwarder.is_some().then(|| verified.tx().clone());
                let hash = if checked {
                    mempool.insert_checked(&state, verified)?
                } else {
                    mempool.insert(&state, verified)?
                };
                admitted.extend(tx);
                Ok(hash)
            })
            .collect();
        let mut refusals = lock(&self.refusals);
        for refusal in verdicts.iter().filter_map(|v| v.as_ref().err()) {
            let why = match refusal {
                Refusal::Invalid(e) => reason(e),
                Refusal::Mempool(e) => reason(e),
                Refusal::EvidenceBusy => reason(refusal),
            };
            *refusals.entry(why).or_default() += 1;
        }
        drop(refusals);
        if mempool.len() >= self.block_limit {
            self.full.notify_one();
        }
        drop(mempool);
        if let Some(forwarder) = forwarder {
            admitted.iter().for_each(|tx| forwarder.send(tx));
        }
        verdicts
    }

    /// Evidence is judged by recomputing its experts, which can take a second: after the
    /// mempool's cheap bounds (a duplicate, a copy or a full sender costs nothing) and the
    /// cheap stateful checks (a worker with nothing at stake), outside the mempool lock
    /// (admission of everything else goes on meanwhile, and the insertion then takes the
    /// verdict as given), and one piece at a time, in turn (`EvidenceGate`): evidence that
    /// cannot take its turn soon is refused (`EvidenceBusy`, resubmitted by its reporter).
    /// With it, whether the transaction's action was checked.
    fn judge_evidence(&self, verified: VerifiedTx) -> Result<(VerifiedTx, bool), Refusal> {
        let Some((evidence, _)) = verified.tx().tx.kind.evidence() else {
            return Ok((verified, false));
        };
        // On a chain with a deposit, admission asks only the cheap checks (standing, fee
        // and deposit); the block recomputes, and a fake pays for that with its deposit.
        if !kvasir_ledger::tx::evidence_deposit(self.state().genesis()).is_zero() {
            return Ok((verified, false));
        }
        lock(&self.mempool).bounds(&self.state(), &verified)?;
        check_evidence_standing(&self.state(), evidence)?;
        let Ok(_turn) = self.evidence.enter(verified.tx().tx.sender) else {
            return Err(Refusal::EvidenceBusy);
        };
        check_action(&self.state(), verified.tx())?;
        Ok((verified, true))
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
        lock(&self.rejected).get(hash)
    }

    pub fn mempool_len(&self) -> usize {
        lock(&self.mempool).len()
    }

    /// Refusals so far, by reason.
    pub fn refusals(&self) -> Vec<(String, u64)> {
        lock(&self.refusals)
            .iter()
            .map(|(why, n)| (why.clone(), *n))
            .collect()
    }

    /// The next block from the mempool (possibly empty), proposed at `height` with this
    /// node's validator key: its id and bytes. It waits first until the genesis interval
    /// since the last commit has passed, or a full block's worth is waiting (so a backlog
    /// drains at the speed of verification, not one block per interval). Transactions that
    /// fail in it leave the mempool now: they fail on the head whoever proposes. Fails,
    /// proposing nothing, while the head is too far ahead of this machine's clock for a new
    /// block to be stamped honestly (`BlockError::AheadOfClock`).
    pub fn propose(&self, height: u64) -> Result<(Hash, Vec<u8>)> {
        let validator = self
            .validator
            .as_ref()
            .context("a full node has no validator key to propose with")?;
        let last = *lock(&self.last_block);
        if let Some(last) = last {
            self.wait_for_block(last + self.interval);
        }
        let state = self.state();
        if state.height() + 1 != height {
            bail!(
                "asked to propose at {height} on a head at {}",
                state.height()
            );
        }
        // Twice a block's worth: candidates that fail in the block leave room for others.
        let candidates =
            lock(&self.mempool).candidates(self.block_limit.saturating_mul(2), &state.block_hash());
        let now = now_ms();
        let produced = produce_block(&state, &candidates, validator, now)?;
        check_clock(&produced.block.header, now)?;
        let dropped: Vec<Hash> = produced.rejected.iter().map(|(h, _)| *h).collect();
        lock(&self.mempool).remove(dropped);
        self.record_rejections(produced.rejected);
        let hash = produced.block.hash();
        let bytes = produced.block.to_bytes();
        self.keep_applied(Applied {
            block: produced.block,
            state: produced.state,
            changes: produced.changes,
        });
        Ok((hash, bytes))
    }

    /// Whether `bytes` is a block that may be decided at `height`: canonical, signed by
    /// `author` when one is named (a fresh proposal is its round's proposer's own block; one
    /// re-proposed under a lock, or synced with its certificate, may be any validator's),
    /// stamped no further ahead of this machine's clock than `MAX_CLOCK_DRIFT_MS` (and never
    /// before its parent), and valid on the head (`apply_block`). Its id when it is.
    pub fn validate(&self, height: u64, author: Option<&Address>, bytes: &[u8]) -> Result<Hash> {
        let state = self.state();
        let block = Block::from_bytes(bytes, state.genesis().params.max_block_bytes)?;
        if block.header.height != height {
            bail!(
                "the block is for height {}, proposed at {height}",
                block.header.height
            );
        }
        if let Some(author) = author.filter(|a| **a != block.header.proposer) {
            bail!(
                "the block is signed by {}, proposed by {author}",
                block.header.proposer
            );
        }
        let hash = block.hash();
        // Any peer can stream the same block again and again: it is applied once per head.
        if let Some(kept) = lock(&self.applied).get(&hash) {
            if kept.block.header.prev_hash == state.block_hash() {
                return Ok(hash);
            }
        }
        if let Some(why) = lock(&self.invalid).get(&hash) {
            bail!("{}", why.0);
        }
        check_clock(&block.header, now_ms())?;
        let (next, changes) = match apply_block(&state, &block) {
            Ok(applied) => applied,
            Err(e) => {
                lock(&self.invalid).insert(hash, Rejection(e.to_string()));
                return Err(e.into());
            }
        };
        self.keep_applied(Applied {
            block,
            state: next,
            changes,
        });
        Ok(hash)
    }

    /// Commits the decided block `bytes` with its certificate: block, state changes and
    /// certificate in one atomic, durable write, then the mempool and the head follow.
    pub fn commit(&self, bytes: &[u8], certificate: &Certificate) -> Result<()> {
        let state = self.state();
        let genesis = state.genesis();
        let block = Block::from_bytes(bytes, genesis.params.max_block_bytes)?;
        let hash = block.hash();
        certificate.verify(genesis, block.header.height, &hash)?;
        let applied = lock(&self.applied).remove(&hash);
        let applied = match applied {
            Some(applied) if applied.block.header.prev_hash == state.block_hash() => applied,
            _ => {
                let (state, changes) = apply_block(&state, &block)?;
                Applied {
                    block,
                    state,
                    changes,
                }
            }
        };
        let mut mempool = lock(&self.mempool);
        self.store
            .commit(&applied.block, &applied.changes, certificate)?;
        mempool.remove(applied.block.txs.iter().map(SignedTx::hash));
        mempool.prune_stale(&applied.state);
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = applied.state;
        drop(mempool);
        // What was applied on the old head is of no use on the new one.
        lock(&self.applied).clear();
        let made = Instant::now();
        if let Some(last) = lock(&self.last_block).replace(made) {
            self.block_interval.observe(made - last);
        }
        self.blocks_produced.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A committed block's bytes and certificate, for peers that sync.
    pub fn decided(&self, height: u64) -> Result<Option<(Vec<u8>, Certificate)>> {
        if height == 0 {
            return Ok(None);
        }
        let block = self.store.block_bytes(height)?;
        let certificate = self.store.certificate(height)?;
        Ok(block.zip(certificate))
    }

    /// Keeps a block applied on the head until it is decided (or the head moves): a
    /// decided block is then committed without applying it again. A proposer can be sent
    /// many blocks per height; only the newest few are kept.
    fn keep_applied(&self, applied: Applied) {
        let mut kept = lock(&self.applied);
        if kept.len() >= APPLIED_KEPT {
            kept.clear();
        }
        kept.insert(applied.block.hash(), applied);
    }

    fn record_rejections(&self, rejected: Vec<(Hash, TxError)>) {
        let mut rejections = lock(&self.rejected);
        let mut refusals = lock(&self.refusals);
        for (hash, error) in rejected {
            *refusals.entry(reason(&error)).or_default() += 1;
            rejections.insert(hash, Rejection(error.to_string()));
        }
    }
}

/// A block applied on top of the head, waiting to be decided.
struct Applied {
    block: Block,
    state: State,
    changes: ChangeSet,
}

#[cfg(feature = "consensus")]
pub fn run(args: Args) -> Result<()> {
    let genesis = Genesis::load(&args.genesis)?;
    let validator = args.key.as_deref().map(kvasir_keyfile::open).transpose()?;
    let answers = evidence_check(&genesis, &args.models)?;
    let mut ledger = Ledger::open(&genesis, &args.data_dir, validator.clone(), answers)
        .with_context(|| format!("opening the ledger in {}", args.data_dir.display()))?;
    if !args.forward.is_empty() {
        ledger.forwarder = Some(Forwarder::start(&args.forward));
    }
    let ledger = Arc::new(ledger);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = link::bind("ledger", args.listen).await?;
        let listener = Acceptor::new(
            "ledger",
            listener,
            ConnectionLimits::total(args.max_connections),
        );
        let mut engine = replica::start(&genesis, validator, &args, ledger.clone()).await?;
        let app = api::router(ledger.clone());
        let served =
            axum::serve(listener, app).with_graceful_shutdown(crate::shutdown::requested());
        // The engine stops by itself only when something is wrong (storage failing, or it
        // halted rather than risk signing twice): stop serving a head that cannot move.
        tokio::select! {
            served = served => served?,
            stopped = engine.wait() => {
                stopped?;
                bail!("the consensus engine stopped");
            }
        }
        engine.stop().await
    })
}

/// A build without the engine (the fuzz targets') cannot run a ledger node.
#[cfg(not(feature = "consensus"))]
pub fn run(_: Args) -> Result<()> {
    bail!("this kvasir-node was built without its consensus engine (feature `consensus`)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_devnet::chain::{init, key_path, load_template};
    use kvasir_ledger::fees::Lane;
    use kvasir_ledger::{Amount, TxKind};

    /// A ledger on a fresh chain from the template, as `change` edits its genesis, and its
    /// faucet key.
    fn ledger_with(dir: &std::path::Path, change: impl FnOnce(&mut Genesis)) -> (Ledger, Keypair) {
        let chain = dir.join("chain");
        let mut genesis = init(&chain, &load_template(None).unwrap()).unwrap();
        // A proposal waits out the interval since the last commit; tests make blocks at once.
        genesis.params.block_interval_ms = 1;
        change(&mut genesis);
        let key = |role| kvasir_keyfile::read(&key_path(&chain, role), None).unwrap();
        let validator = Some(key("validator"));
        let ledger = Ledger::open(&genesis, &dir.join("ledger"), validator, None).unwrap();
        (ledger, key("faucet"))
    }

    impl Ledger {
        /// The next block as a lone validator makes it: proposed, certified by its own
        /// precommit, committed.
        fn produce(&self) -> Result<()> {
            let (_, bytes) = self.propose(self.state().height() + 1)?;
            let block = Block::from_bytes(&bytes, u64::MAX)?;
            let key = self.validator.as_ref().unwrap();
            self.commit(&bytes, &Certificate::for_block(&block, 0, &[key]))
        }
    }

    /// `kind` as transaction `nonce` of `key` on `ledger`'s chain, bidding the fee the chain
    /// suggests now.
    fn sign(ledger: &Ledger, kind: TxKind, key: &Keypair, nonce: u64) -> SignedTx {
        let state = ledger.state();
        let fee = state.suggested_bid(Lane::of(&kind), Amount::ZERO);
        kind.signed_paying(state.chain_id(), fee, key, nonce)
    }

    /// A ledger whose blocks hold at most 3 transactions, and its faucet key.
    fn small_blocks(dir: &std::path::Path) -> (Ledger, Keypair) {
        ledger_with(dir, |genesis| genesis.params.max_block_txs = 3)
    }

    fn transfers(ledger: &Ledger, from: &Keypair, nonces: std::ops::Range<u64>) {
        let to = Keypair::generate().address();
        let txs = nonces
            .map(|n| {
                let amount = Amount::parse("1").unwrap();
                sign(ledger, TxKind::Transfer { to, amount }, from, n)
            })
            .collect();
        assert!(ledger.submit(txs, false).iter().all(Result::is_ok));
    }

    /// Each batch a peer received: the request's query and its transaction count.
    type Batches = Arc<Mutex<Vec<(String, usize)>>>;

    /// A node that only records the batches forwarded to it.
    fn recording_peer() -> (String, Batches) {
        use axum::extract::RawQuery;
        let seen = Batches::default();
        let record = seen.clone();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async move {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let route = axum::routing::post(
                    move |RawQuery(query): RawQuery,
                          axum::Json(batch): axum::Json<serde_json::Value>| async move {
                        let txs = batch["txs"].as_array().map_or(0, Vec::len);
                        lock(&record).push((query.unwrap_or_default(), txs));
                        let results = vec![serde_json::json!({"error": "x", "message": "y"}); txs];
                        axum::Json(serde_json::json!({ "results": results }))
                    },
                );
                let app = axum::Router::new().route("/txs/batch", route);
                axum::serve(listener, app).await.unwrap();
            });
        });
        (url, seen)
    }

    #[test]
    fn what_clients_submit_is_forwarded_once_marked_and_what_was_forwarded_goes_no_further() {
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, faucet) = ledger_with(dir.path(), |_| {});
        let (peer, seen) = recording_peer();
        ledger.forwarder = Some(Forwarder::start(&[peer]));
        let pay = |nonce| {
            let (to, amount) = (Keypair::generate().address(), Amount::parse("1").unwrap());
            sign(&ledger, TxKind::Transfer { to, amount }, &faucet, nonce)
        };
        assert!(ledger.submit(vec![pay(0)], true)[0].is_ok());
        assert!(ledger
            .submit(vec![pay(1), pay(2)], false)
            .iter()
            .all(Result::is_ok));
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&seen).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Time for a stray batch with the forwarded transaction to arrive too, if one would.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(*lock(&seen), vec![("forwarded=true".to_string(), 2)]);
    }

    #[test]
    fn evidence_waits_its_turn_only_when_worth_a_recomputation_and_never_from_a_full_sender() {
        use kvasir_ledger::genesis::ModelPin;
        use kvasir_ledger::keys::Signature;
        use kvasir_ledger::tx::{Evidence, ExpertEvidence, ExpertWeights};
        let dir = tempfile::tempdir().unwrap();
        let config = b"{}".to_vec();
        let pin = ModelPin {
            id: "m".into(),
            config_hash: Hash(*blake3::hash(&config).as_bytes()),
            experts_root: Hash([2; 32]),
            name: "m".into(),
            shape: Some(kvasir_ledger::genesis::ModelShape {
                layers: 1,
                experts: 1,
                expert_bytes: 1 << 10,
            }),
            arithmetic: 1,
        };
        // A chain without an evidence deposit: evidence is recomputed before it is admitted.
        let (ledger, faucet) = ledger_with(dir.path(), |genesis| {
            genesis.models.push(pin);
            if let Some(fees) = genesis.params.fees.as_mut() {
                fees.evidence_deposit = Amount::ZERO;
            }
        });
        let genesis = ledger.state().genesis().clone();
        let chain_id = genesis.chain_id();
        let worker = Keypair::generate();
        let mut evidence = Evidence {
            worker: worker.address(),
            hub: genesis.authorities.hubs[0],
            session: 1,
            request_id: 2,
            model_id: "m".into(),
            request_body: vec![7; 64],
            response_body: vec![0; 64],
            signature: Signature([0; 64]),
        };
        evidence.signature = evidence.claim().sign(&chain_id, &worker);
        let weights = ExpertWeights {
            expert: 0,
            dtypes: [0; 3],
            config,
            gate: vec![0; 64],
            up: vec![0; 64],
            down: vec![0; 64],
            path: Vec::new(),
        };
        let report = |from: &Keypair, nonce| {
            let evidence = ExpertEvidence {
                evidence: evidence.clone(),
                weights: weights.clone(),
            };
            sign(
                &ledger,
                TxKind::ExpertEvidence(Box::new(evidence)),
                from,
                nonce,
            )
        };
        // Evidence against a worker with nothing at stake is refused before it waits for
        // anything, even while the gate is taken.
        let other = ledger
            .evidence
            .enter(Keypair::generate().address())
            .unwrap();
        let judged = ledger.submit(vec![report(&Keypair::generate(), 0)], false);
        assert!(
            matches!(
                judged[..],
                [Err(Refusal::Invalid(TxError::NothingAtStake(_)))]
            ),
            "{judged:?}"
        );
        drop(other);
        // Bonded, it is worth a recomputation: while a reporter's evidence is being
        // recomputed, its next piece is refused without waiting.
        let to = worker.address();
        let amount = Amount::parse("20").unwrap();
        let fund = sign(&ledger, TxKind::Transfer { to, amount }, &faucet, 0);
        assert!(ledger.submit(vec![fund], false)[0].is_ok());
        ledger.produce().unwrap();
        let amount = genesis.params.min_bond;
        let bond = sign(&ledger, TxKind::Bond { amount }, &worker, 0);
        assert!(ledger.submit(vec![bond], false)[0].is_ok(), "bond");
        ledger.produce().unwrap();
        let reporter = Keypair::generate();
        let gate = ledger.evidence.enter(reporter.address()).unwrap();
        let busy = ledger.submit(vec![report(&reporter, 0)], false);
        assert!(matches!(busy[..], [Err(Refusal::EvidenceBusy)]), "{busy:?}");
        // A sender's full window refuses it before any recomputation is tried.
        transfers(&ledger, &faucet, 1..17);
        let full = ledger.submit(vec![report(&faucet, 17)], false);
        assert!(
            matches!(
                full[..],
                [Err(Refusal::Mempool(MempoolError::NonceTooFarAhead { .. }))]
            ),
            "{full:?}"
        );
        drop(gate);
        // A reporter that cannot pay the fee is refused before anything is recomputed.
        let judged = ledger.submit(vec![report(&Keypair::generate(), 0)], false);
        assert!(
            matches!(
                judged[..],
                [Err(Refusal::Invalid(TxError::InsufficientFunds { .. }))]
            ),
            "{judged:?}"
        );
        // One that can has its evidence recomputed, in its turn: this ledger has no model to
        // do it with.
        let funded = Keypair::generate();
        let (to, amount) = (funded.address(), Amount::parse("1").unwrap());
        let fund = sign(&ledger, TxKind::Transfer { to, amount }, &worker, 1);
        assert!(ledger.submit(vec![fund], false)[0].is_ok());
        ledger.produce().unwrap();
        let judged = ledger.submit(vec![report(&funded, 0)], false);
        assert!(
            matches!(
                judged[..],
                [Err(Refusal::Invalid(TxError::CannotCheckEvidence))]
            ),
            "{judged:?}"
        );
    }

    #[test]
    fn a_proposal_that_fails_any_check_is_not_valid() {
        use kvasir_ledger::intent::{self, Intent};
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _) = ledger_with(dir.path(), |_| {});
        let key = ledger.validator.clone().unwrap();
        let me = key.address();
        let state = ledger.state();
        let chain_id = state.chain_id().to_string();
        let made = |at| produce_block(&state, &[], &key, at).unwrap().block;
        let resealed = |mut block: Block, change: &dyn Fn(&mut Block)| {
            change(&mut block);
            block.header.tx_root = Block::tx_root(&block.txs);
            block.signature = intent::sign(&key, Intent::Block, &chain_id, &block.header);
            block.to_bytes()
        };
        let good = made(now_ms());
        assert_eq!(
            ledger.validate(1, Some(&me), &good.to_bytes()).unwrap(),
            good.hash()
        );
        // Re-proposed or synced, any validator may be its author.
        assert!(ledger.validate(1, None, &good.to_bytes()).is_ok());
        let refused = |height, author: Option<&Address>, bytes: &[u8]| {
            let error = ledger.validate(height, author, bytes).unwrap_err();
            format!("{error:#}")
        };
        let stranger = Keypair::generate().address();
        assert!(refused(1, Some(&stranger), &good.to_bytes()).contains("signed by"));
        assert!(refused(2, Some(&me), &good.to_bytes()).contains("height"));
        let bad_root = resealed(good.clone(), &|b| b.header.state_root = Hash([7; 32]));
        assert!(refused(1, Some(&me), &bad_root).contains("state root"));
        let future = made(now_ms() + 60_000).to_bytes();
        assert!(refused(1, Some(&me), &future).contains("ahead"));
        let broke = Keypair::generate();
        let amount = kvasir_ledger::Amount::parse("1").unwrap();
        let theft = sign(&ledger, TxKind::Transfer { to: me, amount }, &broke, 0);
        let failing = resealed(good.clone(), &|b| b.txs.push(theft.clone()));
        assert!(refused(1, Some(&me), &failing).contains("transaction"));
        assert!(refused(1, Some(&me), &good.to_bytes()[1..]).contains("malformed"));
        // Nothing refused was kept to be committed.
        assert_eq!(ledger.state().height(), 0);
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

    #[test]
    fn a_flood_from_one_key_is_refused_and_keeps_no_one_out() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, faucet) = small_blocks(dir.path());
        let pay = |from: &Keypair, nonce, to, amount| {
            let amount = Amount::parse(amount).unwrap();
            sign(&ledger, TxKind::Transfer { to, amount }, from, nonce)
        };
        // Someone else: among equal tips, a block takes every sender's first before anyone's
        // second, whatever their addresses.
        let friend = Keypair::generate();
        assert!(ledger.submit(vec![pay(&faucet, 0, friend.address(), "5")], false)[0].is_ok());
        ledger.produce().unwrap();

        // A key with nothing: not one of a thousand is admitted, however far its nonces.
        let broke = Keypair::generate();
        let flood = (0..1000).map(|n| pay(&broke, n, friend.address(), "1"));
        let verdicts = ledger.submit(flood.collect(), false);
        assert!(verdicts.iter().all(Result::is_err));
        assert!(matches!(
            &verdicts[999],
            Err(Refusal::Mempool(MempoolError::NonceTooFarAhead { .. }))
        ));
        assert_eq!(ledger.mempool_len(), 0);

        // A funded key flooding gets only its window in.
        let flood = (1..1001).map(|n| pay(&faucet, n, broke.address(), "0.001"));
        let admitted = ledger.submit(flood.collect(), false);
        let admitted = admitted.iter().filter(|v| v.is_ok()).count();
        assert_eq!(admitted, Limits::default().per_sender);

        // The friend is admitted behind it and makes the very next block.
        let hash = ledger
            .submit(vec![pay(&friend, 0, faucet.address(), "1")], false)
            .remove(0)
            .unwrap();
        ledger.produce().unwrap();
        let block = ledger.store.block(2).unwrap().unwrap();
        assert_eq!(block.txs.len(), 3);
        assert!(block.txs.iter().any(|tx| tx.hash() == hash));
    }

    #[test]
    fn only_the_newest_rejections_are_kept() {
        let hash = |i: u8| Hash::of_parts(&[&[i]]);
        let mut rejections = Rejections::new(2);
        for i in 0..5 {
            rejections.insert(hash(i), Rejection(format!("reason {i}")));
        }
        assert_eq!(rejections.reasons.len(), 2);
        assert!(rejections.get(&hash(2)).is_none());
        assert_eq!(rejections.get(&hash(4)).unwrap().0, "reason 4");
        rejections.insert(hash(4), Rejection("again".into()));
        assert_eq!(rejections.get(&hash(3)).unwrap().0, "reason 3");
        assert_eq!(rejections.get(&hash(4)).unwrap().0, "again");
    }

    #[test]
    fn no_block_is_made_while_the_head_is_ahead_of_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        // A chain that starts in a minute: no block until then.
        let (ledger, _) = ledger_with(&dir.path().join("later"), |genesis| {
            genesis.genesis_time_ms = now_ms() + 60_000;
        });
        let error = ledger.produce().unwrap_err();
        assert!(
            matches!(
                error.downcast_ref(),
                Some(kvasir_ledger::BlockError::AheadOfClock { .. })
            ),
            "{error:#}"
        );
        assert_eq!(ledger.store.head().unwrap(), 0);
        assert_eq!(ledger.state().height(), 0);
        // Within the allowed drift a block is made, stamped with the parent's time.
        let (ledger, _) = ledger_with(&dir.path().join("soon"), |genesis| {
            genesis.genesis_time_ms = now_ms() + 1_000;
        });
        ledger.produce().unwrap();
        assert_eq!(ledger.state().height(), 1);
    }
}
