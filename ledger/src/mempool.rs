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
//! - block candidates are taken round-robin across senders (in address order, each sender's
//!   transactions in nonce order), so a block is shared among everyone waiting however many
//!   transactions one of them has queued; waiting evidence alone goes before that. The order
//!   is deterministic.

use std::collections::{BTreeMap, HashMap};

use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::keys::Address;
use crate::state::State;
use crate::tx::{check_action, check_stateful, TxError, TxKind, VerifiedTx};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MempoolError {
    #[error(transparent)]
    Invalid(#[from] TxError),
    #[error("mempool is full ({0} transactions)")]
    Full(usize),
    #[error("mempool is full ({0} bytes)")]
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

/// The (worker, hub, session) a piece of evidence is against.
type EvidenceKey = (Address, Address, u64);

/// Where a waiting transaction is, and what it holds.
struct Slot {
    sender: Address,
    nonce: u64,
    bytes: usize,
    evidence: Option<EvidenceKey>,
}

pub struct Mempool {
    limits: Limits,
    /// Each sender's waiting transactions by nonce.
    senders: BTreeMap<Address, BTreeMap<u64, VerifiedTx>>,
    slot_of: HashMap<Hash, Slot>,
    /// Bytes of every waiting transaction.
    bytes: usize,
    /// The one waiting piece of evidence against each (worker, hub, session).
    evidence: HashMap<EvidenceKey, Hash>,
}

fn evidence_key(tx: &VerifiedTx) -> Option<EvidenceKey> {
    match &tx.tx().tx.kind {
        TxKind::Evidence(e) => Some((e.worker, e.hub, e.session)),
        _ => None,
    }
}

impl Mempool {
    pub fn new(limits: Limits) -> Self {
        Mempool {
            limits,
            senders: BTreeMap::new(),
            slot_of: HashMap::new(),
            bytes: 0,
            evidence: HashMap::new(),
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
        self.bounds(state, &tx)?;
        let (nonce, next) = (tx.tx().tx.nonce, state.account(&tx.tx().tx.sender).nonce);
        if nonce <= next {
            check_stateful(state, tx.tx())?;
        } else {
            check_action(state, tx.tx())?;
        }
        Ok(self.keep(tx))
    }

    /// As `insert`, for a transaction whose action the caller has just checked against a
    /// state no older than `state` (`check_action`): evidence, whose check recomputes
    /// experts and must not run while the mempool is held. Only its nonce is checked here;
    /// the block producer checks everything again.
    pub fn insert_checked(&mut self, state: &State, tx: VerifiedTx) -> Result<Hash, MempoolError> {
        self.bounds(state, &tx)?;
        let sender = state.account(&tx.tx().tx.sender);
        if tx.tx().tx.nonce < sender.nonce {
            return Err(TxError::NonceMismatch {
                expected: sender.nonce,
                got: tx.tx().tx.nonce,
            }
            .into());
        }
        Ok(self.keep(tx))
    }

    /// Whether `tx` would fit: not waiting already, its nonce free and within its sender's
    /// window (evidence: its sender's next, and none against the same session waiting), room
    /// left. Cheap, so it comes before any costly check.
    pub fn bounds(&self, state: &State, tx: &VerifiedTx) -> Result<(), MempoolError> {
        let hash = tx.tx().hash();
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
        if let Some(key @ (worker, hub, session)) = evidence_key(tx) {
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
        }
        if waiting >= window {
            return Err(MempoolError::SenderFull {
                sender,
                limit: window,
            });
        }
        if self.len() >= self.limits.capacity {
            return Err(MempoolError::Full(self.limits.capacity));
        }
        if self.bytes + tx.tx().to_bytes().len() > self.limits.max_bytes {
            return Err(MempoolError::FullBytes(self.limits.max_bytes));
        }
        Ok(())
    }

    fn keep(&mut self, tx: VerifiedTx) -> Hash {
        let hash = tx.tx().hash();
        let slot = Slot {
            sender: tx.tx().tx.sender,
            nonce: tx.tx().tx.nonce,
            bytes: tx.tx().to_bytes().len(),
            evidence: evidence_key(&tx),
        };
        self.bytes += slot.bytes;
        if let Some(key) = slot.evidence {
            self.evidence.insert(key, hash);
        }
        self.senders
            .entry(slot.sender)
            .or_default()
            .insert(slot.nonce, tx);
        self.slot_of.insert(hash, slot);
        hash
    }

    /// Up to `limit` transactions for the next block: first each sender's waiting evidence
    /// (megabytes where others are bytes: behind enough small senders it would be deferred
    /// block after block, past the challenge window of the pay it should cancel), then
    /// round-robin across senders in address order, each sender's in nonce order. Only the
    /// evidence goes first, not its sender's later transactions.
    pub fn candidates(&self, limit: usize) -> Vec<VerifiedTx> {
        let mut queues: Vec<_> = self
            .senders
            .values()
            .map(|queue| queue.values().peekable())
            .collect();
        let mut candidates = Vec::with_capacity(limit.min(self.len()));
        for queue in &mut queues {
            if candidates.len() >= limit {
                return candidates;
            }
            if let Some(evidence) = queue.next_if(|tx| evidence_key(tx).is_some()) {
                candidates.push(evidence.clone());
            }
        }
        while candidates.len() < limit && !queues.is_empty() {
            queues.retain_mut(|queue| {
                if candidates.len() >= limit {
                    return true;
                }
                queue.next().map(|tx| candidates.push(tx.clone())).is_some()
            });
        }
        candidates
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
                queue.range(..next).map(|(_, tx)| tx.tx().hash())
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
            if let Some(queue) = self.senders.get_mut(&slot.sender) {
                queue.remove(&slot.nonce);
                if queue.is_empty() {
                    self.senders.remove(&slot.sender);
                }
            }
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
            .candidates(10)
            .iter()
            .map(|tx| (tx.tx().tx.sender, tx.tx().tx.nonce))
            .collect();
        let [r, a, b] = [reporter, first, second].map(Keypair::address);
        assert_eq!(order, vec![(r, 0), (a, 0), (b, 0), (r, 1)]);
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
            .candidates(10)
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
            .candidates(10)
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
        let produced = produce_block(&state, &mempool.candidates(10), &keys.validator, 0).unwrap();
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
        });
        let alice = Keypair::from_seed(&[4; 32]);
        for nonce in 0..3 {
            f.pay(&alice, nonce).unwrap();
        }
        assert_eq!(f.pay(&alice, 3), Err(MempoolError::Full(3)));
        let first = f.mempool.candidates(1)[0].tx().hash();
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
        let picked = f.mempool.candidates(4);
        let slots: Vec<(Address, u64)> = picked
            .iter()
            .map(|tx| (tx.tx().tx.sender, tx.tx().tx.nonce))
            .collect();
        let (a, b) = (flooder.address(), other.address());
        assert_eq!(slots, [(a, 0), (b, 0), (a, 1), (b, 1)]);
        // Once the other sender is served, the rest goes to the flooder, in nonce order.
        let all = f.mempool.candidates(10);
        let nonces: Vec<u64> = all
            .iter()
            .filter(|tx| tx.tx().tx.sender == a)
            .map(|tx| tx.tx().tx.nonce)
            .collect();
        assert_eq!(nonces, (0..8).collect::<Vec<_>>());
        assert_eq!(f.mempool.candidates(10), all);
        assert_eq!(
            f.mempool.candidates(1000).len(),
            52,
            "every waiting one when the limit allows"
        );
    }
}
