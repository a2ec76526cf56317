//! Transactions and their three checks, in order: `check_stateless` (format and signatures;
//! needs only genesis, runs in parallel and batch-verifies), `check_stateful` (nonce, funds,
//! authority, receipt freshness) and `execute` (the state change). A transaction that fails
//! any stage changes nothing. `check_action` is the part of `check_stateful` that a
//! transaction waiting behind its sender's earlier ones can be held to already: what the
//! mempool asks of it.
//!
//! This module holds what every transaction shares (chain id, sender, nonce, signature, the
//! encoding) and dispatches each stage to the module of its action: `transfer`, `credit`,
//! `bond` (Bond and Unbond), `evidence`, `offer` (OfferCreate and OfferWithdraw), `order`
//! (OrderCreate, OrderDeposit and OrderClose).
//! Each action module has the same three functions, so a new action is one module, one
//! `TxKind` variant (appended, so existing encodings keep their meaning) and one arm in each
//! dispatch below.

mod bond;
mod credit;
pub(crate) mod evidence;
mod offer;
mod order;
mod transfer;

use borsh::{BorshDeserialize, BorshSerialize};
use rayon::prelude::*;

pub use crate::receipt::{Receipt, SignedReceipt};
pub use evidence::{
    check_standing as check_evidence_standing, deposit as evidence_deposit, Evidence,
    ExpertEvidence, ExpertWeights,
};
pub use offer::NewOffer;
pub use order::NewOrder;

use crate::amount::Amount;
use crate::fees::{self, Charge, FeeBid, Lane};
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::intent::{self, Intent};
use crate::keys::{Address, Keypair, Signature, SignatureBatch, SignatureCheck};
use crate::state::{Account, Staged, State, Writes};

pub use crate::error::TxError;
pub use crate::limits::{MAX_EVIDENCE_TX_BYTES, MAX_EXPERT_EVIDENCE_TX_BYTES, MAX_TX_BYTES};

#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub enum TxKind {
    Transfer {
        to: Address,
        amount: Amount,
    },
    /// Submitted by a genesis gateway; pays the worker for the receipt's new bytes.
    Credit(SignedReceipt),
    /// Moves spendable balance into the sender's bond.
    Bond {
        amount: Amount,
    },
    /// Starts returning bonded money to the balance, after `unbonding_blocks`.
    Unbond {
        amount: Amount,
    },
    /// Proof that a worker answered wrongly; anyone may submit it and is paid a share.
    Evidence(Box<Evidence>),
    /// A bonded operator offers expert capacity.
    OfferCreate(NewOffer),
    /// The operator ends its offer; placements on it close.
    OfferWithdraw {
        offer: u64,
    },
    /// A buyer orders expert capacity and funds its escrow.
    OrderCreate(NewOrder),
    /// Adds to a live order's escrow.
    OrderDeposit {
        order: u64,
        amount: Amount,
    },
    /// The buyer closes its order: placements close, the escrow left is refunded.
    OrderClose {
        order: u64,
    },
    /// Evidence on a format-2 chain, carrying the disputed expert's weights.
    ExpertEvidence(Box<ExpertEvidence>),
}

impl TxKind {
    /// The answer evidence disputes, and the expert weights it carries (format 2).
    pub fn evidence(&self) -> Option<(&Evidence, Option<&ExpertWeights>)> {
        match self {
            TxKind::Evidence(evidence) => Some((evidence, None)),
            TxKind::ExpertEvidence(e) => Some((&e.evidence, Some(&e.weights))),
            _ => None,
        }
    }
}

impl TxKind {
    /// This action as the transaction `nonce` of `sender` on the format-1 chain `chain_id`
    /// (which has no fees), signed by `sender`.
    pub fn signed(self, chain_id: &str, sender: &Keypair, nonce: u64) -> SignedTx {
        self.signed_paying(chain_id, None, sender, nonce)
    }

    /// This action as the transaction `nonce` of `sender` on `chain_id`, bidding `fee` (a
    /// format-2 chain asks every transaction for one, a format-1 chain for none), signed by
    /// `sender`.
    pub fn signed_paying(
        self,
        chain_id: &str,
        fee: Option<FeeBid>,
        sender: &Keypair,
        nonce: u64,
    ) -> SignedTx {
        Tx {
            chain_id: chain_id.to_string(),
            sender: sender.address(),
            nonce,
            fee,
            kind: self,
        }
        .sign(sender)
    }
}

impl TxKind {
    /// This action as `sender`'s next transaction on `state`'s chain, bidding the suggested
    /// fee with no tip (`State::suggested_bid`).
    pub fn signed_next(self, state: &State, sender: &Keypair) -> SignedTx {
        let fee = state.suggested_bid(Lane::of(&self), Amount::ZERO);
        let nonce = state.account(&sender.address()).nonce;
        self.signed_paying(state.chain_id(), fee, sender, nonce)
    }
}

/// A transaction. Encoded as it was before fees (format 1) when it bids none; with a bid, its
/// encoding starts with `FORMAT_2_MARK` and the format byte, which no format-1 encoding can
/// (those start with the chain id's length, far below it), so one decoder reads both and
/// a format-1 chain's blocks keep their bytes and hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tx {
    pub chain_id: String,
    pub sender: Address,
    pub nonce: u64,
    /// What it pays (format 2); `None` on a format-1 chain.
    pub fee: Option<FeeBid>,
    pub kind: TxKind,
}

/// What a format-2 transaction's encoding starts with, where a format-1 one has its chain
/// id's length.
const FORMAT_2_MARK: u32 = u32::MAX;
/// The longest chain id a transaction may name as it is decoded (a format-2 id is a name of
/// at most 64 characters, a colon and a 64-digit hash): a longer one is refused before it is
/// read.
const MAX_TX_CHAIN_ID: u32 = 256;

impl BorshSerialize for Tx {
    fn serialize<W: std::io::Write>(&self, writer: &mut W) -> std::io::Result<()> {
        if let Some(fee) = &self.fee {
            FORMAT_2_MARK.serialize(writer)?;
            2u8.serialize(writer)?;
            self.chain_id.serialize(writer)?;
            self.sender.serialize(writer)?;
            self.nonce.serialize(writer)?;
            fee.serialize(writer)?;
        } else {
            self.chain_id.serialize(writer)?;
            self.sender.serialize(writer)?;
            self.nonce.serialize(writer)?;
        }
        self.kind.serialize(writer)
    }
}

impl BorshDeserialize for Tx {
    fn deserialize_reader<R: std::io::Read>(reader: &mut R) -> std::io::Result<Self> {
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        let first = u32::deserialize_reader(reader)?;
        let versioned = first == FORMAT_2_MARK;
        if versioned && u8::deserialize_reader(reader)? != 2 {
            return Err(invalid("unknown transaction format"));
        }
        let length = if versioned {
            u32::deserialize_reader(reader)?
        } else {
            first
        };
        if length > MAX_TX_CHAIN_ID {
            return Err(invalid("chain id too long"));
        }
        let mut id = vec![0; length as usize];
        reader.read_exact(&mut id)?;
        let chain_id = String::from_utf8(id).map_err(|_| invalid("chain id is not UTF-8"))?;
        let sender = Address::deserialize_reader(reader)?;
        let nonce = u64::deserialize_reader(reader)?;
        let fee = if versioned {
            Some(FeeBid::deserialize_reader(reader)?)
        } else {
            None
        };
        Ok(Tx {
            chain_id,
            sender,
            nonce,
            fee,
            kind: TxKind::deserialize_reader(reader)?,
        })
    }
}

impl Tx {
    /// The accounts whose history lists this transaction: the two sides of a transfer, the
    /// worker a credit pays (not the gateway that submits credits by the thousand), the
    /// reporter and the worker of evidence.
    pub fn parties(&self) -> impl Iterator<Item = Address> {
        let (first, second) = match &self.kind {
            TxKind::Transfer { to, .. } => (self.sender, Some(*to)),
            TxKind::Credit(signed) => (signed.receipt.worker, None),
            TxKind::Evidence(evidence) => (self.sender, Some(evidence.worker)),
            TxKind::ExpertEvidence(e) => (self.sender, Some(e.evidence.worker)),
            TxKind::Bond { .. }
            | TxKind::Unbond { .. }
            | TxKind::OfferCreate(_)
            | TxKind::OfferWithdraw { .. }
            | TxKind::OrderCreate(_)
            | TxKind::OrderDeposit { .. }
            | TxKind::OrderClose { .. } => (self.sender, None),
        };
        std::iter::once(first).chain(second)
    }

    pub fn sign(self, sender: &Keypair) -> SignedTx {
        let signature = intent::sign(sender, Intent::Transaction, &self.chain_id, &self);
        SignedTx {
            tx: self,
            signature,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct SignedTx {
    pub tx: Tx,
    pub signature: Signature,
}

impl SignedTx {
    pub fn hash(&self) -> Hash {
        Hash::of_borsh(b"kvasir-tx", self)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        borsh::to_vec(self).unwrap_or_default()
    }

    /// Decodes canonical bytes from outside: size-limited (evidence to its own, larger
    /// limit), no trailing bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<SignedTx, TxError> {
        if bytes.len() > MAX_EXPERT_EVIDENCE_TX_BYTES {
            return Err(TxError::TooLarge(bytes.len()));
        }
        let tx: SignedTx =
            borsh::from_slice(bytes).map_err(|e| TxError::Malformed(e.to_string()))?;
        if bytes.len() > tx.size_limit() {
            return Err(TxError::TooLarge(bytes.len()));
        }
        // Only the canonical encoding is accepted, so one transaction has one hash.
        if tx.to_bytes() != bytes {
            return Err(TxError::Malformed("non-canonical encoding".into()));
        }
        Ok(tx)
    }

    /// The largest encoding this kind of transaction may have.
    pub fn size_limit(&self) -> usize {
        match self.tx.kind {
            TxKind::Evidence(_) => MAX_EVIDENCE_TX_BYTES,
            TxKind::ExpertEvidence(_) => MAX_EXPERT_EVIDENCE_TX_BYTES,
            _ => MAX_TX_BYTES,
        }
    }
}

/// A transaction that passed `check_stateless` on this chain: well formed, correctly signed.
/// Only `check_stateless` makes one, so holding one proves the check ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedTx(SignedTx);

impl VerifiedTx {
    pub fn tx(&self) -> &SignedTx {
        &self.0
    }

    pub fn into_inner(self) -> SignedTx {
        self.0
    }
}

/// One signature a transaction carries, with the error to report if it does not verify.
struct TxSignature {
    check: SignatureCheck,
    error: TxError,
}

/// Format checks; on success, the signatures still to verify: the sender's, then any its
/// action carries.
fn check_format(
    genesis: &Genesis,
    chain_id: &str,
    tx: &SignedTx,
) -> Result<Vec<TxSignature>, TxError> {
    let t = &tx.tx;
    if t.chain_id != chain_id {
        return Err(TxError::WrongChain {
            expected: chain_id.to_string(),
            got: t.chain_id.clone(),
        });
    }
    if t.fee.is_some() != genesis.params.fees.is_some() {
        return Err(TxError::FeeBidFormat {
            expected: genesis.params.fees.is_some(),
        });
    }
    // The reserved lane's order does not depend on tips, and a credit's would come out of
    // the worker's pay: there, none.
    if Lane::of(&t.kind) == Lane::Reserved && t.fee.is_some_and(|f| !f.tip_per_byte.is_zero()) {
        return Err(TxError::TipOnReservedLane);
    }
    let message = intent::signing_message(Intent::Transaction, chain_id, t);
    let sender = SignatureCheck::new(&t.sender, &message, &tx.signature)
        .map_err(|_| TxError::BadSenderKey(t.sender))?;
    let mut signatures = vec![TxSignature {
        check: sender,
        error: TxError::BadSignature,
    }];
    let carried = match &t.kind {
        TxKind::Transfer { to, amount } => transfer::check_stateless(t, to, *amount)?,
        TxKind::Credit(signed) => credit::check_stateless(genesis, chain_id, signed)?,
        TxKind::Bond { amount } | TxKind::Unbond { amount } => bond::check_stateless(*amount)?,
        TxKind::Evidence(evidence) => evidence::check_stateless(genesis, chain_id, evidence, None)?,
        TxKind::ExpertEvidence(e) => {
            evidence::check_stateless(genesis, chain_id, &e.evidence, Some(&e.weights))?
        }
        TxKind::OfferCreate(new) => offer::check_stateless_create(new)?,
        TxKind::OrderCreate(new) => order::check_stateless_create(new)?,
        TxKind::OrderDeposit { amount, .. } => bond::check_stateless(*amount)?,
        TxKind::OfferWithdraw { .. } | TxKind::OrderClose { .. } => Vec::new(),
    };
    signatures.extend(carried);
    Ok(signatures)
}

/// Stage one: everything that needs no state. Chunks of transactions are checked in parallel
/// and each chunk's signatures are batch-verified; only a failing batch is re-checked one by
/// one to find the culprit. Signatures follow the ledger's one rule (`keys`), under which a
/// batch and single checks accept exactly the same signatures, so how transactions happen to
/// be batched can never change which are valid.
pub fn check_stateless(genesis: &Genesis, txs: Vec<SignedTx>) -> Vec<Result<VerifiedTx, TxError>> {
    let results = stateless_results(genesis, &txs);
    txs.into_iter()
        .zip(results)
        .map(|(tx, result)| result.map(|()| VerifiedTx(tx)))
        .collect()
}

/// `check_stateless` without taking ownership: one result per transaction, in order.
pub(crate) fn stateless_results(genesis: &Genesis, txs: &[SignedTx]) -> Vec<Result<(), TxError>> {
    // Bigger batches verify faster per signature (one multiscalar multiplication, and a
    // signer's repeated key folded into one term); a few chunks per thread keep every core
    // busy, and a capped chunk bounds the one-by-one retry a bad signature forces.
    let threads = rayon::current_num_threads().max(1);
    let chunk = (txs.len() / (4 * threads)).clamp(64, 1024);
    let chain_id = genesis.chain_id();
    txs.par_chunks(chunk)
        .flat_map_iter(|chunk| check_chunk(genesis, &chain_id, chunk))
        .collect()
}

fn check_chunk(genesis: &Genesis, chain_id: &str, chunk: &[SignedTx]) -> Vec<Result<(), TxError>> {
    let checks: Vec<Result<Vec<TxSignature>, TxError>> = chunk
        .iter()
        .map(|tx| check_format(genesis, chain_id, tx))
        .collect();
    let mut batch = SignatureBatch::default();
    for signature in checks.iter().flatten().flatten() {
        batch.queue(&signature.check);
    }
    let batch_ok = batch.verify().is_ok();
    checks
        .into_iter()
        .map(|signatures| {
            let signatures = signatures?;
            if batch_ok {
                return Ok(());
            }
            match signatures
                .into_iter()
                .find(|s| s.check.clone().verify().is_err())
            {
                Some(failed) => Err(failed.error),
                None => Ok(()),
            }
        })
        .collect()
}

/// What `tx` pays on `state`'s chain in the next block (`fees::charge`): nothing on a chain
/// without fees.
pub fn fee_charge(state: &State, tx: &SignedTx) -> Result<Charge, TxError> {
    let (Some(params), Some(bid)) = (&state.genesis().params.fees, &tx.tx.fee) else {
        return Ok(Charge::default());
    };
    let lane = Lane::of(&tx.tx.kind);
    fees::charge(params, state.base_fee(), lane, bid, tx.to_bytes().len())
}

/// The sender's account as its action sees it: after paying `charge`, which it must cover.
/// A credit's fee comes out of the pay it brings, not the gateway's balance.
fn after_fee(state: &State, tx: &SignedTx, charge: Charge) -> Result<Account, TxError> {
    let mut sender = state.account(&tx.tx.sender);
    if matches!(tx.tx.kind, TxKind::Credit(_)) {
        return Ok(sender);
    }
    let fee = charge.total().ok_or(TxError::Overflow)?;
    sender.balance = sender
        .balance
        .checked_sub(fee)
        .ok_or(TxError::InsufficientFunds {
            balance: sender.balance,
            needed: fee,
        })?;
    Ok(sender)
}

/// Stage two: may this transaction run against `state` now?
pub fn check_stateful(state: &State, tx: &SignedTx) -> Result<(), TxError> {
    let t = &tx.tx;
    let next = state.account(&t.sender).nonce;
    if t.nonce != next {
        return Err(TxError::NonceMismatch {
            expected: next,
            got: t.nonce,
        });
    }
    match &t.kind {
        TxKind::Transfer { to, amount } => {
            let sender = after_fee(state, tx, fee_charge(state, tx)?)?;
            transfer::check_stateful(state, &sender, to, *amount)
        }
        _ => check_action(state, tx),
    }
}

/// What a transaction that waits for its sender's earlier transactions must already pass
/// against `state` (the mempool admits such a one only if it does): the rules its
/// predecessors cannot turn in its favour. A transfer must be covered by today's balance
/// (its predecessors can only spend it); a credit must come from a genesis gateway with a
/// receipt of a genesis hub, newer than the session's mark (marks only rise). So a key
/// that cannot pay anything queues nothing. What a predecessor may change (it may create a
/// transfer's receiver) waits for `check_stateful` in production. A bond must be covered
/// by today's balance, an unbond by today's bond (a predecessor could raise it, so this is
/// stricter than production, never looser); evidence must already prove a wrong answer.
/// Every transaction must cover its fee out of today's balance too (a credit, out of its pay).
pub fn check_action(state: &State, tx: &SignedTx) -> Result<(), TxError> {
    let t = &tx.tx;
    let charge = fee_charge(state, tx)?;
    let sender = after_fee(state, tx, charge)?;
    match &t.kind {
        TxKind::Transfer { amount, .. } => transfer::check_funds(&sender, *amount),
        TxKind::Credit(signed) => credit::check_stateful(state, &t.sender, signed),
        TxKind::Bond { amount } => bond::check_bond(state, &sender, *amount),
        TxKind::Unbond { amount } => bond::check_unbond(state, &sender, *amount),
        TxKind::Evidence(evidence) => evidence::check_stateful(state, &sender, evidence, None),
        TxKind::ExpertEvidence(e) => {
            evidence::check_stateful(state, &sender, &e.evidence, Some(&e.weights))
        }
        TxKind::OfferCreate(new) => offer::check_create(state, &t.sender, new),
        TxKind::OfferWithdraw { offer } => offer::check_withdraw(state, &t.sender, *offer),
        TxKind::OrderCreate(new) => order::check_create(state, &t.sender, &sender, new),
        TxKind::OrderDeposit { order, amount } => {
            order::check_deposit(state, &sender, *order, *amount)
        }
        TxKind::OrderClose { order } => order::check_close(state, &t.sender, *order),
    }
}

/// Stage three: what a transaction that passed both checks changes. Pure: it reads `state`
/// and returns the writes; overflow is still checked, and a failure leaves nothing behind.
/// The sender's nonce moves on and its fee is paid (a credit's, from its pay, by the
/// action), then the action runs.
pub(crate) fn execute(state: &State, tx: &SignedTx) -> Result<Writes, TxError> {
    let t = &tx.tx;
    let charge = fee_charge(state, tx)?;
    let mut staged = Staged::new(state);
    let mut sender = staged.account(&t.sender);
    sender.nonce = sender.nonce.checked_add(1).ok_or(TxError::Overflow)?;
    staged.set_account(t.sender, sender);
    if !matches!(t.kind, TxKind::Credit(_)) {
        let fee = charge.total().ok_or(TxError::Overflow)?;
        staged.sub_balance(t.sender, fee)?;
        staged.pay_fee(charge)?;
    }
    match &t.kind {
        TxKind::Transfer { to, amount } => transfer::execute(&mut staged, &t.sender, to, *amount),
        TxKind::Credit(signed) => credit::execute(&mut staged, &signed.receipt, charge),
        TxKind::Bond { amount } => bond::execute_bond(&mut staged, &t.sender, *amount),
        TxKind::Unbond { amount } => bond::execute_unbond(&mut staged, &t.sender, *amount),
        TxKind::Evidence(evidence) => evidence::execute(&mut staged, &t.sender, evidence, None),
        TxKind::ExpertEvidence(e) => {
            evidence::execute(&mut staged, &t.sender, &e.evidence, Some(&e.weights))
        }
        TxKind::OfferCreate(new) => offer::execute_create(&mut staged, &t.sender, new),
        TxKind::OfferWithdraw { offer } => offer::execute_withdraw(&mut staged, *offer),
        TxKind::OrderCreate(new) => order::execute_create(&mut staged, &t.sender, new),
        TxKind::OrderDeposit { order, amount } => {
            order::execute_deposit(&mut staged, &t.sender, *order, *amount)
        }
        TxKind::OrderClose { order } => order::execute_close(&mut staged, *order),
    }?;
    Ok(staged.into_writes())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::genesis::tests::test_genesis;
    use proptest::prelude::*;

    pub fn transfer(from: &Keypair, nonce: u64, to: Address, amount: &str) -> SignedTx {
        let amount = Amount::parse(amount).unwrap();
        TxKind::Transfer { to, amount }.signed("kvasir-test", from, nonce)
    }

    #[test]
    fn stateless_names_each_bad_transaction_and_batching_never_matters() {
        let (genesis, keys) = test_genesis();
        let good = transfer(&keys.alice, 0, keys.bob.address(), "1");
        let mut forged = good.clone();
        forged.tx.nonce = 9;
        let mut wrong_chain = good.tx.clone();
        wrong_chain.chain_id = "other".into();
        let wrong_chain = wrong_chain.sign(&keys.alice);
        let mut small_order_sender = good.clone();
        small_order_sender.tx.sender = Address::from_bytes([0; 32]);
        let txs = vec![good.clone(), forged, wrong_chain, small_order_sender];
        let results = stateless_results(&genesis, &txs);
        assert_eq!(results[0], Ok(()));
        assert_eq!(results[1], Err(TxError::BadSignature));
        assert!(matches!(results[2], Err(TxError::WrongChain { .. })));
        assert!(matches!(results[3], Err(TxError::BadSenderKey(_))));
        // A large all-good batch passes the batch path; one bad one among many is found.
        let mut many: Vec<SignedTx> = (0..200).map(|_| good.clone()).collect();
        assert!(stateless_results(&genesis, &many).iter().all(Result::is_ok));
        many[137].signature.0[5] ^= 1;
        let results = stateless_results(&genesis, &many);
        assert_eq!(results.iter().filter(|r| r.is_err()).count(), 1);
        assert_eq!(results[137], Err(TxError::BadSignature));
    }

    /// On format 2, a transaction signed for one chain is refused by another of the same
    /// name: as naming another chain, or, renamed, as a bad signature.
    #[test]
    fn a_transaction_for_one_chain_is_refused_by_its_twin() {
        let (chain, keys) = crate::genesis::tests::test_genesis_v2();
        let mut twin = chain.clone();
        twin.genesis_time_ms += 1;
        let to = keys.bob.address();
        let amount = Amount::parse("1").unwrap();
        let state = State::from_genesis(chain.clone());
        let signed = TxKind::Transfer { to, amount }.signed_next(&state, &keys.alice);
        assert_eq!(
            stateless_results(&chain, std::slice::from_ref(&signed)),
            vec![Ok(())]
        );
        assert!(matches!(
            stateless_results(&twin, std::slice::from_ref(&signed))[0],
            Err(TxError::WrongChain { .. })
        ));
        let mut renamed = signed;
        renamed.tx.chain_id = twin.chain_id();
        assert_eq!(
            stateless_results(&twin, &[renamed])[0],
            Err(TxError::BadSignature)
        );
    }

    #[test]
    fn decoding_rejects_garbage_oversize_and_trailing_bytes() {
        let (_, keys) = test_genesis();
        let tx = transfer(&keys.alice, 3, keys.bob.address(), "2.5");
        let bytes = tx.to_bytes();
        assert_eq!(SignedTx::from_bytes(&bytes), Ok(tx.clone()));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            SignedTx::from_bytes(&trailing),
            Err(TxError::Malformed(_))
        ));
        for cut in 0..bytes.len() {
            assert!(matches!(
                SignedTx::from_bytes(&bytes[..cut]),
                Err(TxError::Malformed(_))
            ));
        }
        assert!(matches!(
            SignedTx::from_bytes(&vec![0u8; MAX_EXPERT_EVIDENCE_TX_BYTES + 1]),
            Err(TxError::TooLarge(_))
        ));
        // Only evidence may be larger than a plain transaction.
        let receipt = Receipt {
            chain_id: "x".repeat(MAX_TX_BYTES),
            hub: keys.hub.address(),
            session_id: 1,
            worker: keys.worker.address(),
            order: 0,
            cumulative_bytes: 1,
        };
        let long = TxKind::Credit(receipt.sign(&keys.hub))
            .signed("kvasir-test", &keys.gateway, 0)
            .to_bytes();
        assert!(matches!(
            SignedTx::from_bytes(&long),
            Err(TxError::TooLarge(_))
        ));
    }

    proptest! {
        #[test]
        fn encoding_round_trips(
            nonce in any::<u64>(),
            units in any::<u64>(),
            seed in any::<[u8; 32]>(),
            bid in proptest::option::of(any::<(u64, u64)>()),
        ) {
            let from = Keypair::from_seed(&seed);
            let fee = bid.map(|(max, tip)| FeeBid {
                max_per_byte: Amount::from_base_units(max),
                tip_per_byte: Amount::from_base_units(tip),
            });
            let tx = Tx {
                chain_id: "kvasir-test".into(),
                sender: from.address(),
                nonce,
                fee,
                kind: TxKind::Transfer { to: Address::from_bytes([9; 32]), amount: Amount::from_base_units(units) },
            }.sign(&from);
            prop_assert_eq!(SignedTx::from_bytes(&tx.to_bytes()), Ok(tx.clone()));
            let credit = Tx {
                chain_id: "kvasir-test".into(),
                sender: from.address(),
                nonce,
                fee,
                kind: TxKind::Credit(Receipt {
                    chain_id: "kvasir-test".into(),
                    hub: from.address(),
                    session_id: nonce ^ units,
                    worker: Address::from_bytes(seed),
                    order: 0,
                    cumulative_bytes: units,
                }.sign(&from)),
            }.sign(&from);
            prop_assert_eq!(SignedTx::from_bytes(&credit.to_bytes()), Ok(credit));
        }

        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = SignedTx::from_bytes(&bytes);
        }
    }
}
