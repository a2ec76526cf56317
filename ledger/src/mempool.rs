//! The mempool: transactions waiting for a block. Anyone can submit, so admission is bounded
//! and checked, and no sender can crowd out the others:
//!
//! - a transaction with its sender's next nonce passes `check_stateful` in full; one further
//!   ahead passes `check_action`, the checks its predecessors cannot make pass (a transfer
//!   covered by today's balance, a credit from a genesis gateway), so a key that cannot pay
//!   anything queues nothing at all;
//! - a sender may use only the next `Limits::per_sender` nonces and have at most that many
//!   waiting; a genesis gateway, which submits one credit per metered session, gets
//!   `per_gateway`; everyone together, `capacity`;
//! - all waiting transactions together hold at most `Limits::max_bytes`;
//! - evidence waits only at its sender's next nonce (so it is always ready for the next block
//!   and no gap in its sender's nonces can park it), and at most one piece per (worker, hub,
//!   session): one conviction is all a session's lie can bring, so copies under other
//!   reporters' keys are refused before anyone recomputes them;
//! - block candidates are taken by price: evidence first, then credits (the reserved lane,
//!   `fees`), then by tip per byte, highest first, each sender's transactions in nonce order.
//!   Among equal tips they are taken round-robin across senders (everyone's first before
//!   anyone's second), so a block is shared among everyone waiting however many transactions
//!   one of them has queued; the order of senders is shuffled afresh for every block (by a
//!   hash of the parent block's hash and the address), so no address can be ground to
//!   always come first. The order is deterministic;
//! - when it is full, a transaction that bids more evicts the cheapest waiting ones, each
//!   taken from the end of its sender's queue (its highest nonce), so no sender is left with
//!   a gap; reserved-lane transactions go after every open one.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use crate::amount::Amount;
use crate::fees::Lane;
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::keys::Address;
use crate::state::State;
use crate::tx::{check_action, check_stateful, evidence_deposit, TxError, TxKind, VerifiedTx};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MempoolError {
    #[error(transparent)]
    Invalid(#[from] TxError),
    #[error("{0} pieces of evidence are waiting, as many as may: submit it again shortly")]
    EvidenceFull(usize),
    #[error("mempool is full ({0} transactions), and none waiting bids less than this one: raise its tip")]
    Full(usize),
    #[error("mempool is full ({0} bytes), and not enough waiting bids less than this one: raise its tip")]
    FullBytes(usize),
    #[error("evidence against {worker} in session {session} of hub {hub} is already waiting")]
    EvidenceWaiting {
        worker: Address,
        hub: Address,
        session: u64,
    },
    #[error("evidence must carry its sender's next nonce ({next}), not {nonce}")]
    EvidenceNotNext { nonce: u64, next: u64 },
    #[error("transaction {0} is already in the mempool")]
    Duplicate(Hash),
    #[error("sender {0} already has a transaction with nonce {1} waiting")]
    NonceTaken(Address, u64),
    #[error("nonce {nonce} is too far ahead: the account's next is {next}, and only the next {window} are accepted")]
    NonceTooFarAhead {
        nonce: u64,
        next: u64,
        window: usize,
    },
    #[error(
        "sender {sender} already has {limit} transactions waiting, its limit; wait for a block"
    )]
    SenderFull { sender: Address, limit: usize },
}

/// How much may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Transactions waiting, all senders together.
    pub capacity: usize,
    /// An ordinary sender's window of nonces from its account's next one, and the most it
    /// may have waiting.
    pub per_sender: usize,
    /// The same for a genesis gateway.
    pub per_gateway: usize,
    /// Bytes of transactions waiting, all senders together.
    pub max_bytes: usize,
    /// Pieces of evidence waiting.
    pub evidence: usize,
}

impl Default for Limits {
    /// A hundred thousand waiting; 16 per sender (a wallet waits for a block after that);
    /// half the mempool for a gateway, so its credits never fill it alone; 256 MiB in all
    /// (forty-odd pieces of evidence at their largest, two hundred thousand credits).
    fn default() -> Self {
        Limits {
            capacity: 100_000,
            per_sender: 16,
            per_gateway: 50_000,
            max_bytes: 256 << 20,
            evidence: 32,
        }
    }
}

impl Limits {
    fn per(&self, genesis: &Genesis, sender: &Address) -> usize {
        if genesis.is_gateway(sender) {
            self.per_gateway
        } else {
            self.per_sender
        }
    }
}

/// The (worker, hub, session) a piece of evidence is against, and on a chain with an
/// evidence deposit its reporter: there a fake costs its deposit, so one reporter's fake
/// cannot hold another's evidence of the same session out (on a chain without one, copies
/// under other keys are refused, as each would cost a recomputation for nothing).
type EvidenceKey = (Address, Address, u64, Option<Address>);

/// Where a waiting transaction is, and what it holds.
struct Slot {
    sender: Address,
    nonce: u64,
    bytes: usize,
    evidence: Option<EvidenceKey>,
}

/// What the mempool's bounds read of a transaction, worked out once as it arrives: its
/// hash, its size, and the most it can take from its sender's balance: the most its bid
/// lets it pay in the open lane (a credit's fee comes from its pay; evidence's deposit is
/// checked on its own) and what its action moves out of the balance.
#[derive(Clone, Copy)]
struct Measure {
    hash: Hash,
    bytes: usize,
    most_cost: u128,
}

impl Measure {
    fn of(tx: &VerifiedTx) -> Measure {
        let bytes = tx.tx().to_bytes().len();
        let t = &tx.tx().tx;
        let most_fee = match (Lane::of(&t.kind), t.fee) {
            (Lane::Open, Some(bid)) => u128::from(bid.max_per_byte.base_units()) * bytes as u128,
            _ => 0,
        };
        let moved = match &t.kind {
            TxKind::Transfer { amount, .. }
            | TxKind::Bond { amount }
            | TxKind::OrderDeposit { amount, .. } => *amount,
            TxKind::OrderCreate(new) => new.deposit,
            _ => Amount::ZERO,
        };
        Measure {
            hash: tx.tx().hash(),
            bytes,
            most_cost: most_fee + u128::from(moved.base_units()),
        }
    }
}

/// A waiting transaction and its `Measure`.
struct Waiting {
    tx: VerifiedTx,
    measure: Measure,
}

/// How much a waiting transaction is worth keeping, lowest first: open-lane ones before
/// reserved ones, then by tip per byte; equal ones by sender.
type Worth = (bool, Amount, Address);

fn worth(tx: &VerifiedTx) -> Worth {
    let t = &tx.tx().tx;
    (Lane::of(&t.kind) == Lane::Reserved, tip_of(tx), t.sender)
}

/// The tip per byte a transaction bids (none on a chain without fees).
fn tip_of(tx: &VerifiedTx) -> Amount {
    tx.tx().tx.fee.map_or(Amount::ZERO, |fee| fee.tip_per_byte)
}

pub struct Mempool {
    limits: Limits,
    /// Each sender's waiting transactions by nonce.
    senders: BTreeMap<Address, BTreeMap<u64, Waiting>>,
    slot_of: HashMap<Hash, Slot>,
    /// Bytes of every waiting transaction.
    bytes: usize,
    /// The one waiting piece of evidence against each (worker, hub, session).
    evidence: HashMap<EvidenceKey, Hash>,
    /// The worth of each sender's last waiting transaction: what eviction takes from.
    tails: BTreeSet<Worth>,
}

fn evidence_key(genesis: &Genesis, tx: &VerifiedTx) -> Option<EvidenceKey> {
    let t = &tx.tx().tx;
    let reporter = (!evidence_deposit(genesis).is_zero()).then_some(t.sender);
    let (e, _) = t.kind.evidence()?;
    Some((e.worker, e.hub, e.session, reporter))
}

impl Mempool {
    pub fn new(limits: Limits) -> Self {
        Mempool {
            limits,
            senders: BTreeMap::new(),
            slot_of: HashMap::new(),
            bytes: 0,
            evidence: HashMap::new(),
            tails: BTreeSet::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    pub fn contains(&self, hash: &Hash) -> bool {
        self.slot_of.contains_key(hash)
    }

    /// Admits a transaction that passed the stateless check, judged against `state`, the
    /// state at the head: the cheap bounds first, then the stateful checks.
    pub fn insert(&mut self, state: &State, tx: VerifiedTx) -> Result<Hash, MempoolError> {
        let measure = Measure::of(&tx);
        self.measured_bounds(state, &tx, &measure)?;
        let (nonce, next) = (tx.tx().tx.nonce, state.account(&tx.tx().tx.sender).nonce);
        if nonce <= next {
            check_stateful(state, tx.tx())?;
        } else {
            check_action(state, tx.tx())?;
            self.check_queue_affordable(state, &tx, &measure)?;
        }
        self.keep(state.genesis(), tx, measure)
    }

    /// A sender's waiting transactions must be payable together from today's balance, each
    /// at its bid's most and with what it moves: else one key could queue a window of high
    /// tips (or of transfers of its whole balance) that only its first can pay, and evict the
    /// cheapest honest transactions for nothing.
    fn check_queue_affordable(
        &self,
        state: &State,
        tx: &VerifiedTx,
        measure: &Measure,
    ) -> Result<(), TxError> {
        let sender = tx.tx().tx.sender;
        let queued: u128 = self
            .senders
            .get(&sender)
            .map_or(0, |queue| queue.values().map(|w| w.measure.most_cost).sum());
        let needed = queued + measure.most_cost;
        let balance = state.account(&sender).balance;
        if needed > u128::from(balance.base_units()) {
            return Err(TxError::InsufficientFunds {
                balance,
                needed: Amount::from_base_units(u64::try_from(needed).unwrap_or(u64::MAX)),
            });
        }
        Ok(())
    }

    /// As `insert`, for a transaction whose action the caller has just checked against a
    /// state no older than `state` (`check_action`): evidence, whose check recomputes
    /// experts and must not run while the mempool is held. Only its nonce is checked here;
    /// the block producer checks everything again.
    pub fn insert_checked(&mut self, state: &State, tx: VerifiedTx) -> Result<Hash, MempoolError> {
        let measure = Measure::of(&tx);
        self.measured_bounds(state, &tx, &measure)?;
        let sender = state.account(&tx.tx().tx.sender);
        if tx.tx().tx.nonce < sender.nonce {
            return Err(TxError::NonceMismatch {
                expected: sender.nonce,
                got: tx.tx().tx.nonce,
            }
            .into());
        }
        self.keep(state.genesis(), tx, measure)
    }

    /// Whether `tx` would fit: not waiting already, its nonce free and within its sender's
    /// window (evidence: its sender's next, and none against the same session waiting), room
    /// left. Cheap, so it comes before any costly check.
    pub fn bounds(&self, state: &State, tx: &VerifiedTx) -> Result<(), MempoolError> {
        self.measured_bounds(state, tx, &Measure::of(tx))
    }

    fn measured_bounds(
        &self,
        state: &State,
        tx: &VerifiedTx,
        measure: &Measure,
    ) -> Result<(), MempoolError> {
        let hash = measure.hash;
        if self.slot_of.contains_key(&hash) {
            return Err(MempoolError::Duplicate(hash));
        }
        let (sender, nonce) = (tx.tx().tx.sender, tx.tx().tx.nonce);
        let queue = self.senders.get(&sender);
        if queue.is_some_and(|queue| queue.contains_key(&nonce)) {
            return Err(MempoolError::NonceTaken(sender, nonce));
        }
        let waiting = queue.map_or(0, BTreeMap::len);
        let window = self.limits.per(state.genesis(), &sender);
        let next = state.account(&sender).nonce;
        if nonce.saturating_sub(next) >= window as u64 {
            return Err(MempoolError::NonceTooFarAhead {
                nonce,
                next,
                window,
            });
        }
        if let Some(key @ (worker, hub, session, _)) = evidence_key(state.genesis(), tx) {
            if nonce != next {
                return Err(MempoolError::EvidenceNotNext { nonce, next });
            }
            if self.evidence.contains_key(&key) {
                return Err(MempoolError::EvidenceWaiting {
                    worker,
                    hub,
                    session,
                });
            }
            // Megabytes each, ranked above every transfer: a bounded line, so that evidence
            // cannot fill the mempool and turn every payment away.
            if self.evidence.len() >= self.limits.evidence {
                return Err(MempoolError::EvidenceFull(self.limits.evidence));
            }
        }
        if waiting >= window {
            return Err(MempoolError::SenderFull {
                sender,
                limit: window,
            });
        }
        self.evictions(tx, measure).map(drop)
    }

    /// The waiting transactions `tx` must evict to fit: none while there is room; else the
    /// cheapest senders' last ones, each worth less than `tx`, never its own sender's (that
    /// would leave `tx` after a gap). Refused when those cannot make room.
    fn evictions(&self, tx: &VerifiedTx, measure: &Measure) -> Result<Vec<Hash>, MempoolError> {
        let bytes = measure.bytes;
        let over_count = (self.len() + 1).saturating_sub(self.limits.capacity);
        let over_bytes = (self.bytes + bytes).saturating_sub(self.limits.max_bytes);
        let (mut freed_count, mut freed_bytes) = (0, 0);
        let mut evicted = Vec::new();
        let own = worth(tx);
        for &(reserved, tip, sender) in &self.tails {
            if freed_count >= over_count && freed_bytes >= over_bytes {
                break;
            }
            if (reserved, tip) >= (own.0, own.1) {
                break;
            }
            if sender == own.2 {
                continue;
            }
            let Some((_, last)) = self.senders.get(&sender).and_then(|q| q.last_key_value()) else {
                continue;
            };
            freed_count += 1;
            freed_bytes += last.measure.bytes;
            evicted.push(last.measure.hash);
        }
        if freed_count < over_count {
            return Err(MempoolError::Full(self.limits.capacity));
        }
        if freed_bytes < over_bytes {
            return Err(MempoolError::FullBytes(self.limits.max_bytes));
        }
        Ok(evicted)
    }

    /// Keeps `tx`, evicting what it must (`evictions`).
    fn keep(
        &mut self,
        genesis: &Genesis,
        tx: VerifiedTx,
        measure: Measure,
    ) -> Result<Hash, MempoolError> {
        let evicted = self.evictions(&tx, &measure)?;
        self.remove(evicted);
        let hash = measure.hash;
        let slot = Slot {
            sender: tx.tx().tx.sender,
            nonce: tx.tx().tx.nonce,
            bytes: measure.bytes,
            evidence: evidence_key(genesis, &tx),
        };
        self.bytes += slot.bytes;
        if let Some(key) = slot.evidence {
            self.evidence.insert(key, hash);
        }
        let sender = slot.sender;
        self.untail(&sender);
        self.senders
            .entry(sender)
            .or_default()
            .insert(slot.nonce, Waiting { tx, measure });
        self.retail(&sender);
        self.slot_of.insert(hash, slot);
        Ok(hash)
    }

    /// Forgets `sender`'s tail before its queue changes (`retail` records the new one).
    fn untail(&mut self, sender: &Address) {
        if let Some((_, last)) = self.senders.get(sender).and_then(|q| q.last_key_value()) {
            self.tails.remove(&worth(&last.tx));
        }
    }

    fn retail(&mut self, sender: &Address) {
        if let Some((_, last)) = self.senders.get(sender).and_then(|q| q.last_key_value()) {
            self.tails.insert(worth(&last.tx));
        }
    }

    /// Up to `limit` transactions for the block after the one whose hash is `parent`, in the
    /// order the module's doc gives: each sender's waiting evidence first (megabytes where
    /// others are bytes: behind enough small senders it would be deferred block after block,
    /// past the challenge window of the pay it should cancel), then credits, then by tip per
    /// byte; equals round-robin, from a sender that `parent` picks.
    pub fn candidates(&self, limit: usize, parent: &Hash) -> Vec<VerifiedTx> {
        // The sender order among equals: a hash of the parent's and the sender's, a fresh
        // shuffle every block.
        let mix = |sender: &Address| Hash::of_parts(&[parent.as_bytes(), sender.as_bytes()]);
        let rank = |tx: &VerifiedTx| match &tx.tx().tx.kind {
            kind if kind.evidence().is_some() => 0u8,
            TxKind::Credit(_) => 1,
            _ => 2,
        };
        // Highest first: lowest rank, highest tip, lowest depth in its queue, lowest mix.
        let key = |tx: &VerifiedTx, depth: usize, mixed: Hash| {
            (
                Reverse(rank(tx)),
                tip_of(tx),
                Reverse(depth),
                Reverse(mixed),
            )
        };
        let mut heads = BinaryHeap::with_capacity(self.senders.len());
        for (sender, queue) in &self.senders {
            if let Some((&nonce, first)) = queue.first_key_value() {
                heads.push((key(&first.tx, 0, mix(sender)), *sender, 0usize, nonce));
            }
        }
        let mut candidates = Vec::with_capacity(limit.min(self.len()));
        while candidates.len() < limit {
            let Some((_, sender, depth, nonce)) = heads.pop() else {
                break;
            };
            let mut queue = self.senders[&sender].range(nonce..);
            if let Some((_, waiting)) = queue.next() {
                candidates.push(waiting.tx.clone());
            }
            if let Some((&nonce, Waiting { tx: next, .. })) = queue.next() {
                let depth = depth + 1;
                heads.push((key(next, depth, mix(&sender)), sender, depth, nonce));
            }
        }
        candidates
    }

    /// A tip per byte that would put a transaction into the next block, whose open lane holds
    /// `room` transactions, ahead of what waits now: zero while fewer than that wait, else one
    /// base unit above the tip of the last that would fit.
    pub fn suggested_tip(&self, room: usize) -> Amount {
        let mut tips: Vec<Amount> = self
            .senders
            .values()
            .flat_map(BTreeMap::values)
            .filter(|w| Lane::of(&w.tx.tx().tx.kind) == Lane::Open)
            .map(|w| tip_of(&w.tx))
            .collect();
        if room == 0 || tips.len() < room {
            return Amount::ZERO;
        }
        let (_, last, _) = tips.select_nth_unstable_by(room - 1, |a, b| b.cmp(a));
        last.checked_add(Amount::from_base_units(1))
            .unwrap_or(Amount::MAX)
    }

    /// Drops every transaction `state` has made stale: one whose nonce its sender has used
    /// already (another node's block took that nonce with another transaction). Such a
    /// copy could never be included, yet would go on counting against its sender's window,
    /// the mempool's room and, for evidence, its session's one place.
    pub fn prune_stale(&mut self, state: &State) {
        let stale: Vec<Hash> = self
            .senders
            .iter()
            .flat_map(|(sender, queue)| {
                let next = state.account(sender).nonce;
                queue.range(..next).map(|(_, w)| w.measure.hash)
            })
            .collect();
        self.remove(stale);
    }

    /// Drops transactions that were included or rejected.
    pub fn remove(&mut self, hashes: impl IntoIterator<Item = Hash>) {
        for hash in hashes {
            let Some(slot) = self.slot_of.remove(&hash) else {
                continue;
            };
            self.bytes -= slot.bytes;
            if let Some(key) = slot.evidence {
                self.evidence.remove(&key);
            }
            self.untail(&slot.sender);
            if let Some(queue) = self.senders.get_mut(&slot.sender) {
                queue.remove(&slot.nonce);
                if queue.is_empty() {
                    self.senders.remove(&slot.sender);
                }
            }
            self.retail(&slot.sender);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::produce_block;
    use crate::genesis::tests::{test_genesis, TestKeys};
    use crate::keys::Keypair;
    use crate::tx::tests::transfer;
    use crate::tx::{check_stateless, Receipt, SignedTx, TxKind};

    fn verified(genesis: &Genesis, tx: SignedTx) -> VerifiedTx {
        check_stateless(genesis, vec![tx]).remove(0).unwrap()
    }

    struct Fixture {
        state: State,
        keys: TestKeys,
        mempool: Mempool,
    }

    impl Fixture {
        fn new(limits: Limits) -> Fixture {
            let (genesis, keys) = test_genesis();
            Fixture {
                state: State::from_genesis(genesis),
                keys,
                mempool: Mempool::new(limits),
            }
        }

        fn insert(&mut self, tx: SignedTx) -> Result<Hash, MempoolError> {
            let tx = verified(self.state.genesis(), tx);
            self.mempool.insert(&self.state, tx)
        }

        /// A one-base-unit transfer from `from` at `nonce` to a fixed payee.
        fn pay(&mut self, from: &Keypair, nonce: u64) -> Result<Hash, MempoolError> {
            let payee = Keypair::from_seed(&[77; 32]).address();
            self.insert(transfer(from, nonce, payee, "0.000000001"))
        }

        /// Moves the state on by a block, made elsewhere, in which `sender` used `nonces`
        /// for other transfers than those waiting here.
        fn commit_elsewhere(&mut self, sender: &Keypair, nonces: std::ops::Range<u64>) {
            let payee = Keypair::from_seed(&[78; 32]).address();
            let elsewhere: Vec<VerifiedTx> = nonces
                .map(|n| verified(self.state.genesis(), transfer(sender, n, payee, "1")))
                .collect();
            let validator = Keypair::from_seed(&[1; 32]);
            self.state = produce_block(&self.state, &elsewhere, &validator, 0)
                .unwrap()
                .state;
        }

        fn credit(&mut self, nonce: u64) -> Result<Hash, MempoolError> {
            let receipt = Receipt {
                chain_id: "kvasir-test".into(),
                hub: self.keys.hub.address(),
                session_id: nonce,
                worker: self.keys.worker.address(),
                order: 0,
                cumulative_bytes: 1000,
            };
            let tx = TxKind::Credit(receipt.sign(&self.keys.hub)).signed(
                "kvasir-test",
                &self.keys.gateway,
                nonce,
            );
            self.insert(tx)
        }
    }

    fn limits(per_sender: usize, per_gateway: usize) -> Limits {
        Limits {
            capacity: 1000,
            per_sender,
            per_gateway,
            max_bytes: 1 << 30,
            evidence: 32,
        }
    }

    /// Evidence against the bonded test worker in `session`, reported by `reporter`.
    fn evidence_tx(keys: &TestKeys, reporter: &Keypair, nonce: u64, session: u64) -> SignedTx {
        let wrong = crate::tx::evidence::tests::evidence(
            keys,
            &keys.worker,
            session,
            7,
            vec![0; 32],
            "kvasir-test",
        );
        TxKind::Evidence(Box::new(wrong)).signed("kvasir-test", reporter, nonce)
    }

    /// On a chain with an evidence deposit, reporters do not share a session's place (a fake
    /// under one key cannot hold another's evidence out), and the evidence line is bounded.
    #[test]
    fn with_a_deposit_each_reporter_has_its_place_and_the_line_is_bounded() {
        let (genesis, keys) = crate::genesis::tests::bonded_genesis_v2();
        let state = State::from_genesis(genesis);
        let bond = TxKind::Bond {
            amount: Amount::parse("20").unwrap(),
        }
        .signed_next(&state, &keys.worker);
        let state = produce_block(
            &state,
            &[verified(state.genesis(), bond)],
            &keys.validator,
            0,
        )
        .unwrap()
        .state;
        let chain = state.chain_id().to_string();
        let report = |reporter: &Keypair, session| {
            let wrong = crate::tx::evidence::tests::evidence(
                &keys,
                &keys.worker,
                session,
                7,
                vec![0; 32],
                &chain,
            );
            let kind = crate::tx::evidence::tests::evidence_kind(state.genesis(), wrong);
            let tx = kind.signed_next(&state, reporter);
            verified(state.genesis(), tx)
        };
        let mut mempool = Mempool::new(Limits {
            evidence: 2,
            ..limits(16, 16)
        });
        mempool.insert(&state, report(&keys.alice, 1)).unwrap();
        mempool.insert(&state, report(&keys.bob, 1)).unwrap();
        let third = Keypair::from_seed(&[63; 32]);
        assert_eq!(
            mempool.bounds(&state, &report(&third, 2)),
            Err(MempoolError::EvidenceFull(2))
        );
    }

    #[test]
    fn evidence_alone_is_offered_first_whatever_its_senders_address() {
        let (genesis, keys) = crate::genesis::tests::bonded_genesis();
        let state = State::from_genesis(genesis);
        let mut mempool = Mempool::new(limits(16, 16));
        let mut senders = [&keys.alice, &keys.bob, &keys.worker];
        senders.sort_by_key(|k| k.address());
        // The reporter sorts last: in address order its evidence would come last.
        let [first, second, reporter] = senders;
        let payee = Keypair::from_seed(&[77; 32]).address();
        for key in [first, second] {
            let tx = verified(state.genesis(), transfer(key, 0, payee, "0.000000001"));
            mempool.insert(&state, tx).unwrap();
        }
        let tx = evidence_tx(&keys, reporter, 0, 1);
        mempool
            .insert_checked(&state, verified(state.genesis(), tx))
            .unwrap();
        // The reporter's later transfer takes its turn like anyone's.
        let later = verified(state.genesis(), transfer(reporter, 1, payee, "0.000000001"));
        mempool.insert(&state, later).unwrap();
        let order: Vec<(Address, u64)> = mempool
            .candidates(10, &Hash::ZERO)
            .iter()
            .map(|tx| (tx.tx().tx.sender, tx.tx().tx.nonce))
            .collect();
        let [r, a, b] = [reporter, first, second].map(Keypair::address);
        assert_eq!(order[0], (r, 0));
        assert!(order[1..3].contains(&(a, 0)) && order[1..3].contains(&(b, 0)));
        assert_eq!(order[3], (r, 1));
    }

    #[test]
    fn one_piece_of_evidence_per_session_waits_and_only_at_its_senders_next_nonce() {
        let (genesis, keys) = crate::genesis::tests::bonded_genesis();
        let state = State::from_genesis(genesis);
        let mut mempool = Mempool::new(limits(16, 16));
        let admit = |mempool: &mut Mempool, tx| {
            mempool.insert_checked(&state, verified(state.genesis(), tx))
        };
        let first = admit(&mut mempool, evidence_tx(&keys, &keys.alice, 0, 1)).unwrap();
        // The same proof under another reporter's key is a copy: refused, however many keys.
        let copy = admit(&mut mempool, evidence_tx(&keys, &keys.bob, 0, 1));
        assert_eq!(
            copy,
            Err(MempoolError::EvidenceWaiting {
                worker: keys.worker.address(),
                hub: keys.hub.address(),
                session: 1
            })
        );
        // Another session's is not a copy.
        admit(&mut mempool, evidence_tx(&keys, &keys.bob, 0, 2)).unwrap();
        // Parked behind a gap in its sender's nonces it could block the session forever.
        let stranger = Keypair::from_seed(&[90; 32]);
        assert_eq!(
            admit(&mut mempool, evidence_tx(&keys, &stranger, 3, 3)),
            Err(MempoolError::EvidenceNotNext { nonce: 3, next: 0 })
        );
        // Once the first leaves the mempool, the session's slot is free again.
        mempool.remove([first]);
        admit(&mut mempool, evidence_tx(&keys, &stranger, 0, 1)).unwrap();
        assert_eq!(mempool.len(), 2);
    }

    #[test]
    fn copies_whose_nonce_another_block_used_are_pruned() {
        let mut f = Fixture::new(limits(16, 16));
        let alice = Keypair::from_seed(&[4; 32]);
        for nonce in 0..4 {
            f.pay(&alice, nonce).unwrap();
        }
        // Another proposer's block used Alice's nonces 0 and 1 for other transfers.
        f.commit_elsewhere(&alice, 0..2);
        f.mempool.prune_stale(&f.state);
        let left: Vec<u64> = f
            .mempool
            .candidates(10, &Hash::ZERO)
            .iter()
            .map(|tx| tx.tx().tx.nonce)
            .collect();
        assert_eq!(left, vec![2, 3]);
        assert_eq!(f.mempool.len(), 2);
    }

    #[test]
    fn the_mempool_holds_at_most_its_bytes() {
        let (genesis, keys) = crate::genesis::tests::bonded_genesis();
        let state = State::from_genesis(genesis);
        let evidence = verified(state.genesis(), evidence_tx(&keys, &keys.alice, 0, 1));
        let size = evidence.tx().to_bytes().len();
        let mut mempool = Mempool::new(Limits {
            max_bytes: size + 100,
            ..limits(16, 16)
        });
        mempool.insert_checked(&state, evidence).unwrap();
        let second = verified(state.genesis(), evidence_tx(&keys, &keys.bob, 0, 2));
        assert_eq!(
            mempool.insert_checked(&state, second.clone()),
            Err(MempoolError::FullBytes(size + 100))
        );
        let hashes: Vec<Hash> = mempool
            .candidates(10, &Hash::ZERO)
            .iter()
            .map(|t| t.tx().hash())
            .collect();
        mempool.remove(hashes);
        mempool.insert_checked(&state, second).unwrap();
    }

    #[test]
    fn a_sender_gets_a_window_of_nonces_and_a_gateway_a_wider_one() {
        let mut f = Fixture::new(limits(4, 6));
        let alice = Keypair::from_seed(&[4; 32]);
        for nonce in [0, 3, 1, 2] {
            f.pay(&alice, nonce).unwrap();
        }
        assert_eq!(
            f.pay(&alice, 4),
            Err(MempoolError::NonceTooFarAhead {
                nonce: 4,
                next: 0,
                window: 4
            })
        );
        assert!(matches!(
            f.pay(&alice, u64::MAX),
            Err(MempoolError::NonceTooFarAhead { .. })
        ));
        for nonce in 0..6 {
            f.credit(nonce).unwrap();
        }
        assert!(matches!(
            f.credit(6),
            Err(MempoolError::NonceTooFarAhead { window: 6, .. })
        ));
        assert!(matches!(f.pay(&alice, 1), Err(MempoolError::Duplicate(_))));
        let payee = Keypair::from_seed(&[77; 32]).address();
        assert!(matches!(
            f.insert(transfer(&alice, 1, payee, "0.000000002")),
            Err(MempoolError::NonceTaken(_, 1))
        ));
        assert_eq!(f.mempool.len(), 10);
    }

    #[test]
    fn a_key_that_cannot_pay_queues_nothing() {
        let mut f = Fixture::new(limits(16, 16));
        // The worker's account is empty and it is no gateway: every nonce is refused.
        let broke = Keypair::from_seed(&[6; 32]);
        for nonce in [0, 1, 5, 15] {
            assert!(
                matches!(
                    f.pay(&broke, nonce),
                    Err(MempoolError::Invalid(TxError::InsufficientFunds { .. }))
                ),
                "nonce {nonce}"
            );
        }
        // A later transfer must be covered by today's balance (Bob holds 5 KVR).
        let bob = Keypair::from_seed(&[5; 32]);
        let payee = Keypair::from_seed(&[77; 32]).address();
        assert!(matches!(
            f.insert(transfer(&bob, 3, payee, "5.000000001")),
            Err(MempoolError::Invalid(TxError::InsufficientFunds { .. }))
        ));
        f.insert(transfer(&bob, 3, payee, "5")).unwrap();
        // Credits queued ahead: only from a gateway.
        let receipt = Receipt {
            chain_id: "kvasir-test".into(),
            hub: f.keys.hub.address(),
            session_id: 1,
            worker: f.keys.worker.address(),
            order: 0,
            cumulative_bytes: 10,
        }
        .sign(&f.keys.hub);
        let by_bob = TxKind::Credit(receipt).signed("kvasir-test", &bob, 4);
        assert_eq!(
            f.insert(by_bob),
            Err(MempoolError::Invalid(TxError::NotAGateway(bob.address())))
        );
        assert_eq!(f.mempool.len(), 1);
    }

    #[test]
    fn a_later_transfer_may_pay_the_account_an_earlier_one_creates() {
        let (mut genesis, keys) = test_genesis();
        genesis.params.min_new_account = crate::amount::Amount::parse("0.5").unwrap();
        let state = State::from_genesis(genesis);
        let mut mempool = Mempool::new(limits(16, 16));
        let fresh = Keypair::from_seed(&[79; 32]).address();
        for (nonce, amount) in [(0, "0.5"), (1, "0.000000001")] {
            let tx = verified(state.genesis(), transfer(&keys.alice, nonce, fresh, amount));
            mempool.insert(&state, tx).unwrap();
        }
        let produced = produce_block(
            &state,
            &mempool.candidates(10, &Hash::ZERO),
            &keys.validator,
            0,
        )
        .unwrap();
        assert_eq!(produced.block.txs.len(), 2, "{:?}", produced.rejected);
        // At the sender's next nonce the full check applies: dust cannot create the account.
        let dust = verified(state.genesis(), transfer(&keys.bob, 0, fresh, "0.1"));
        assert!(matches!(
            mempool.insert(&state, dust),
            Err(MempoolError::Invalid(
                TxError::BelowNewAccountMinimum { .. }
            ))
        ));
    }

    #[test]
    fn a_sender_holds_at_most_its_limit_even_when_its_nonce_moves_on() {
        let mut f = Fixture::new(limits(3, 3));
        let alice = Keypair::from_seed(&[4; 32]);
        for nonce in 0..3 {
            f.pay(&alice, nonce).unwrap();
        }
        // Another producer's block took Alice's first three nonces; the copies still wait
        // here until they are pruned (`prune_stale`, at the node's next commit), and count
        // against her meanwhile.
        f.commit_elsewhere(&alice, 0..3);
        assert_eq!(
            f.pay(&alice, 3),
            Err(MempoolError::SenderFull {
                sender: alice.address(),
                limit: 3
            })
        );
    }

    #[test]
    fn the_mempool_holds_at_most_its_capacity() {
        let mut f = Fixture::new(Limits {
            capacity: 3,
            per_sender: 16,
            per_gateway: 16,
            max_bytes: 1 << 30,
            evidence: 32,
        });
        let alice = Keypair::from_seed(&[4; 32]);
        for nonce in 0..3 {
            f.pay(&alice, nonce).unwrap();
        }
        assert_eq!(f.pay(&alice, 3), Err(MempoolError::Full(3)));
        let first = f.mempool.candidates(1, &Hash::ZERO)[0].tx().hash();
        f.mempool.remove([first]);
        assert!(!f.mempool.contains(&first));
        f.pay(&alice, 3).unwrap();
    }

    #[test]
    fn a_sender_with_many_waiting_does_not_starve_the_others() {
        let mut f = Fixture::new(limits(100, 100));
        let (alice, bob) = (Keypair::from_seed(&[4; 32]), Keypair::from_seed(&[5; 32]));
        // The flood comes from whichever address sorts first, which address order favoured.
        let (flooder, other) = if alice.address() < bob.address() {
            (alice, bob)
        } else {
            (bob, alice)
        };
        for nonce in 0..50 {
            f.pay(&flooder, nonce).unwrap();
        }
        f.pay(&other, 0).unwrap();
        f.pay(&other, 1).unwrap();
        let picked = f.mempool.candidates(4, &Hash::ZERO);
        let slots: Vec<(Address, u64)> = picked
            .iter()
            .map(|tx| (tx.tx().tx.sender, tx.tx().tx.nonce))
            .collect();
        let (a, b) = (flooder.address(), other.address());
        let (x, y) = (slots[0].0, slots[1].0);
        assert!((x, y) == (a, b) || (x, y) == (b, a));
        assert_eq!(slots, [(x, 0), (y, 0), (x, 1), (y, 1)]);
        // Once the other sender is served, the rest goes to the flooder, in nonce order.
        let all = f.mempool.candidates(10, &Hash::ZERO);
        let nonces: Vec<u64> = all
            .iter()
            .filter(|tx| tx.tx().tx.sender == a)
            .map(|tx| tx.tx().tx.nonce)
            .collect();
        assert_eq!(nonces, (0..8).collect::<Vec<_>>());
        assert_eq!(f.mempool.candidates(10, &Hash::ZERO), all);
        assert_eq!(
            f.mempool.candidates(1000, &Hash::ZERO).len(),
            52,
            "every waiting one when the limit allows"
        );
    }
}

/// The mempool on a chain with fees: priced order and eviction.
#[cfg(test)]
mod priced {
    use super::*;
    use crate::genesis::tests::test_genesis_v2;
    use crate::keys::Keypair;
    use crate::tx::check_stateless;

    struct Priced {
        state: State,
        mempool: Mempool,
        crowd: Vec<Keypair>,
    }

    impl Priced {
        /// `senders` funded keys, a mempool of `capacity` transactions.
        fn new(senders: u8, capacity: usize) -> Priced {
            let (mut genesis, _) = test_genesis_v2();
            let crowd: Vec<Keypair> = (0..senders)
                .map(|i| Keypair::from_seed(&[i + 40; 32]))
                .collect();
            for key in &crowd {
                genesis.allocations.push(crate::genesis::Allocation {
                    address: key.address(),
                    amount: Amount::parse("10").unwrap(),
                });
            }
            let limits = Limits {
                capacity,
                per_sender: 16,
                per_gateway: 16,
                max_bytes: 1 << 30,
                evidence: 32,
            };
            Priced {
                state: State::from_genesis(genesis),
                mempool: Mempool::new(limits),
                crowd,
            }
        }

        /// A transfer from sender `who` at `nonce`, tipping `tip` base units a byte.
        fn pay(&mut self, who: usize, nonce: u64, tip: u64) -> Result<Hash, MempoolError> {
            let kind = TxKind::Transfer {
                to: Keypair::from_seed(&[99; 32]).address(),
                amount: Amount::from_base_units(1),
            };
            let bid = self
                .state
                .suggested_bid(Lane::Open, Amount::from_base_units(tip));
            let tx = kind.signed_paying(self.state.chain_id(), bid, &self.crowd[who], nonce);
            let tx = check_stateless(self.state.genesis(), vec![tx])
                .remove(0)
                .unwrap();
            self.mempool.insert(&self.state, tx)
        }

        fn order(&self, parent: &Hash) -> Vec<(usize, u64)> {
            let who = |sender: &Address| self.crowd.iter().position(|k| k.address() == *sender);
            self.mempool
                .candidates(100, parent)
                .iter()
                .map(|tx| (who(&tx.tx().tx.sender).unwrap(), tx.tx().tx.nonce))
                .collect()
        }
    }

    /// The highest tip goes first; equal tips go round-robin, starting from a sender the
    /// parent block picks, so over blocks every sender comes first.
    #[test]
    fn candidates_go_by_tip_and_equals_take_turns_from_a_start_that_moves() {
        let mut p = Priced::new(3, 100);
        p.pay(0, 0, 0).unwrap();
        p.pay(0, 1, 0).unwrap();
        p.pay(1, 0, 0).unwrap();
        p.pay(1, 1, 0).unwrap();
        p.pay(2, 0, 5).unwrap();
        p.pay(2, 1, 0).unwrap();
        let mut first = BTreeSet::new();
        for i in 0..16u8 {
            let order = p.order(&Hash([i; 32]));
            assert_eq!(order[0], (2, 0), "the tip goes first");
            // Then everyone's nonce 0 before anyone's nonce 1, each sender in nonce order.
            let depths: Vec<u64> = order.iter().map(|(_, nonce)| *nonce).collect();
            assert_eq!(depths, [0, 0, 0, 1, 1, 1]);
            first.insert(order[1].0);
        }
        assert_eq!(first.len(), 2, "both untipped senders start a round");
    }

    /// A full mempool takes a better-paying transaction by evicting the cheapest sender's
    /// last one (never leaving a gap, never its own sender's); one that pays no more than
    /// the cheapest is refused.
    #[test]
    fn a_full_mempool_evicts_the_cheapest_from_the_end_of_its_queue() {
        let mut p = Priced::new(4, 4);
        let cheap = [p.pay(0, 0, 0).unwrap(), p.pay(0, 1, 0).unwrap()];
        p.pay(1, 0, 1).unwrap();
        p.pay(1, 1, 1).unwrap();
        assert_eq!(p.pay(2, 0, 0), Err(MempoolError::Full(4)));
        p.pay(2, 0, 2).unwrap();
        assert!(!p.mempool.contains(&cheap[1]) && p.mempool.contains(&cheap[0]));
        // Its own sender's is never evicted for it: sender 2's next one takes sender 0's.
        p.pay(2, 1, 2).unwrap();
        assert!(!p.mempool.contains(&cheap[0]));
        assert_eq!(p.mempool.len(), 4);
        assert_eq!(p.pay(3, 0, 1), Err(MempoolError::Full(4)));
        assert_eq!(p.order(&Hash::ZERO), [(2, 0), (2, 1), (1, 0), (1, 1)]);
        // The mempool's bookkeeping follows: removing what a block took frees the room.
        let all: Vec<Hash> = p
            .mempool
            .candidates(10, &Hash::ZERO)
            .iter()
            .map(|tx| tx.tx().hash())
            .collect();
        p.mempool.remove(all);
        assert!(p.mempool.is_empty() && p.mempool.tails.is_empty());
    }

    /// A key can queue only what it can pay for: the fees of its waiting transactions, each
    /// at its bid's most, must come out of today's balance together.
    #[test]
    fn a_sender_queues_only_what_it_can_pay_for_together() {
        let mut p = Priced::new(1, 100);
        let payee = Keypair::from_seed(&[98; 32]).address();
        let key = p.crowd[0].clone();
        // Ten KVR, bids of 0.01 KVR a byte and more: a transfer of a few hundred bytes may
        // pay over 2 KVR, so only the first few fit together; the rest are refused.
        let tip = Amount::parse("0.01").unwrap();
        let mut results = Vec::new();
        for nonce in 0..7 {
            let kind = TxKind::Transfer {
                to: payee,
                amount: Amount::from_base_units(1),
            };
            let bid = p.state.suggested_bid(Lane::Open, tip);
            let tx = kind.signed_paying(p.state.chain_id(), bid, &key, nonce);
            let tx = check_stateless(p.state.genesis(), vec![tx])
                .remove(0)
                .unwrap();
            results.push(p.mempool.insert(&p.state, tx));
        }
        let admitted = results.iter().take_while(|r| r.is_ok()).count();
        assert!((2..7).contains(&admitted), "{results:?}");
        assert!(
            results[admitted..].iter().all(|r| matches!(
                r,
                Err(MempoolError::Invalid(TxError::InsufficientFunds { .. }))
            )),
            "{results:?}"
        );
    }

    /// The suggested tip beats the last transaction that would fit in the next block, and is
    /// zero while everything waiting fits.
    #[test]
    fn the_suggested_tip_outbids_the_last_that_fits() {
        let mut p = Priced::new(4, 100);
        for (who, tip) in [(0, 9), (1, 3), (2, 5), (3, 0)] {
            p.pay(who, 0, tip).unwrap();
        }
        assert_eq!(p.mempool.suggested_tip(5), Amount::ZERO);
        assert_eq!(p.mempool.suggested_tip(4), Amount::from_base_units(1));
        assert_eq!(p.mempool.suggested_tip(2), Amount::from_base_units(6));
        assert_eq!(p.mempool.suggested_tip(1), Amount::from_base_units(10));
        assert_eq!(p.mempool.suggested_tip(0), Amount::ZERO);
    }
}
