//! Why a transaction is refused, beneath both the transactions' checks (`tx`) and the state
//! they stage their writes in (`state`).

use crate::amount::Amount;
use crate::keys::Address;
use crate::limits::{MAX_EVIDENCE_TX_BYTES, MAX_EXPERT_EVIDENCE_TX_BYTES, MAX_TX_BYTES};

/// Why a transaction was rejected. Every variant leaves the state untouched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxError {
    #[error("malformed transaction: {0}")]
    Malformed(String),
    #[error("transaction is {0} bytes, over the limit ({MAX_TX_BYTES} bytes, {MAX_EVIDENCE_TX_BYTES} for evidence, {MAX_EXPERT_EVIDENCE_TX_BYTES} for evidence with its expert)")]
    TooLarge(usize),
    #[error("transaction is for chain {got:?}, this is {expected:?}")]
    WrongChain { expected: String, got: String },
    #[error("receipt is for chain {got:?}, this is {expected:?}")]
    ReceiptWrongChain { expected: String, got: String },
    #[error("sender {0} is not a usable ed25519 key")]
    BadSenderKey(Address),
    #[error("transaction signature does not verify")]
    BadSignature,
    #[error("receipt signature does not verify")]
    BadReceiptSignature,
    #[error("transfer amount is zero")]
    ZeroAmount,
    #[error("transfer to self")]
    SelfTransfer,
    #[error("receipt pays the rewards pool itself")]
    ReceiptToPool,
    #[error("nonce is {got}, account expects {expected}")]
    NonceMismatch { expected: u64, got: u64 },
    #[error("insufficient funds: balance {balance}, needed {needed}")]
    InsufficientFunds { balance: Amount, needed: Amount },
    #[error("a transfer of {amount} cannot create account {to}: this chain's minimum for a new account is {minimum}")]
    BelowNewAccountMinimum {
        to: Address,
        amount: Amount,
        minimum: Amount,
    },
    #[error("arithmetic overflow")]
    Overflow,
    #[error("{}", if *expected { "this chain asks every transaction for a fee bid (format 2); the transaction has none" } else { "this chain has no fees (format 1); the transaction bids one" })]
    FeeBidFormat { expected: bool },
    #[error("fee bid too low: the price is {price} a byte, plus the tip of {tip}, and the bid pays at most {max} a byte")]
    FeeBelowPrice {
        price: Amount,
        tip: Amount,
        max: Amount,
    },
    #[error("{}", if *expected { "evidence on this chain (format 2) carries the disputed expert's weights, and this evidence has none" } else { "this chain (format 1) recomputes evidence with its own checkpoints, and this evidence carries weights" })]
    EvidenceFormat { expected: bool },
    #[error("evidence weights refused: {0}")]
    EvidenceWeights(String),
    #[error("credits and evidence (the reserved lane) bid no tip")]
    TipOnReservedLane,
    #[error("{0} is not a gateway named in genesis and may not submit credits")]
    NotAGateway(Address),
    #[error("{0} is not a hub named in genesis and may not sign receipts")]
    NotAHub(Address),
    #[error(
        "receipt is not newer: session already credited up to {stored} bytes, receipt says {got}"
    )]
    ReceiptNotNewer { stored: u64, got: u64 },
    #[error("session belongs to worker {stored}, the transaction names {got}")]
    SessionWorkerMismatch { stored: Address, got: Address },
    #[error("this chain has no bonds (its genesis sets no min_bond)")]
    NoBonds,
    #[error("insufficient bond: bonded {bonded}, needed {needed}")]
    InsufficientBond { bonded: Amount, needed: Amount },
    #[error("model {0:?} is not pinned in genesis: no evidence about it can be checked")]
    UnpinnedModel(String),
    #[error("answer signature does not verify")]
    BadAnswerSignature,
    #[error("this node holds no checkpoint to recompute evidence with (start it with --model)")]
    CannotCheckEvidence,
    #[error("evidence request: {0}")]
    EvidenceRequest(String),
    #[error(
        "the answer is correct: recomputing it gives the same bits, so there is nothing to slash"
    )]
    AnswerWasCorrect,
    #[error("this session was already convicted")]
    AlreadyConvicted,
    #[error(
        "{0} has neither a bond nor pending rewards in this session: there is nothing to slash"
    )]
    NothingAtStake(Address),
    #[error("model id {0:?} must be 1..=64 bytes")]
    BadModelId(String),
    #[error("{0}")]
    BadSelection(kvasir_primitives::selection::SelectionError),
    #[error("replicas must be 1..=8 (MAX_REPLICAS), not {0}")]
    BadReplicas(u8),
    #[error("a deposit of {deposit} cannot pay even one unit at the max price {max_price}")]
    DepositBelowPrice { deposit: Amount, max_price: Amount },
    #[error("delegate {0} is not a usable ed25519 key")]
    BadDelegate(Address),
    #[error("end height {end_height} must be after the block being built ({height})")]
    EndNotInFuture { end_height: u64, height: u64 },
    #[error("{0} is jailed and may not offer capacity")]
    Jailed(Address),
    #[error("an operator may hold at most {0} open offers")]
    TooManyOpenOffers(usize),
    #[error("a buyer may hold at most {0} live orders")]
    TooManyLiveOrders(usize),
    #[error("there is no offer {0}")]
    UnknownOffer(u64),
    #[error("offer {0} is not open")]
    OfferNotOpen(u64),
    #[error("there is no order {0}")]
    UnknownOrder(u64),
    #[error("order {0} is closed")]
    OrderClosed(u64),
    #[error("there is no placement {0}")]
    UnknownPlacement(u64),
    #[error("{0} is not the owner of what it names")]
    NotYours(Address),
    #[error("model {0:?} is neither the id nor the name of a model this chain pins")]
    NotAPinnedModel(String),
    #[error(
        "the selection reaches past model {model}, which has {layers} layers of {experts} experts"
    )]
    SelectionOutsideModel {
        model: String,
        layers: u16,
        experts: u16,
    },
}
