//! The bodies of the ledger's REST API (`kvasir-node ledger`, relayed by the gateway).

use kvasir_ledger::fees::{self, Charge, FeeBid, FeeParams, Lane};
use kvasir_ledger::fraction::Fraction;
use kvasir_ledger::state::Conviction;
use kvasir_ledger::{Address, Amount, Hash, TxError};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::schema::{
    AddressText, BaseUnitsText, FractionText, HashText, KvrText, SignatureText, TxHexText,
};

/// An amount: base units (10^-9 KVR) as a decimal string, exact in every JSON reader, and the
/// same amount in KVR as exact decimal text. Read back, the two must agree: a reply that says
/// two amounts at once is refused, not resolved one way or the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(try_from = "AmountFields")]
pub struct AmountView {
    #[serde(with = "base_units")]
    #[schema(value_type = BaseUnitsText)]
    pub base_units: Amount,
    #[schema(value_type = KvrText)]
    pub kvr: Amount,
}

/// `AmountView` as it arrives, before its two forms are compared.
#[derive(Deserialize)]
struct AmountFields {
    #[serde(with = "base_units")]
    base_units: Amount,
    kvr: Amount,
}

impl TryFrom<AmountFields> for AmountView {
    type Error = String;

    fn try_from(fields: AmountFields) -> Result<AmountView, String> {
        if fields.base_units != fields.kvr {
            return Err(format!(
                "base_units {} and kvr {} are different amounts",
                fields.base_units.base_units(),
                fields.kvr.to_decimal()
            ));
        }
        Ok(AmountView::from(fields.base_units))
    }
}

impl From<Amount> for AmountView {
    fn from(amount: Amount) -> AmountView {
        AmountView {
            base_units: amount,
            kvr: amount,
        }
    }
}

/// `Amount` as its count of base units in a string (its own serde form is the KVR decimal).
mod base_units {
    use kvasir_ledger::Amount;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(amount: &Amount, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&amount.base_units())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Amount, D::Error> {
        let text = <String as Deserialize>::deserialize(deserializer)?;
        text.parse()
            .map(Amount::from_base_units)
            .map_err(serde::de::Error::custom)
    }
}

/// Every error: a machine-readable kind and a sentence for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// `bad_request`, `too_large`, `unsupported_media_type`, `not_found`,
    /// `method_not_allowed`, `invalid_tx`, `conflict`, `sender_limit`, `mempool_full`,
    /// `ledger_unreachable`, `ledger_timeout`, `request_timeout` (the gateway), `internal`.
    pub error: String,
    pub message: String,
}

/// `GET /head`: the head block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Head {
    /// What transactions, receipts and blocks name as their chain, and what every signature
    /// commits to: `NAME:GENESIS_HASH` on a format-2 chain, the name alone on a format-1 one.
    pub chain_id: String,
    pub height: u64,
    #[schema(value_type = HashText)]
    pub hash: Hash,
    #[schema(value_type = HashText)]
    pub state_root: Hash,
    pub timestamp_ms: u64,
    /// The validators whose precommits commit the head block (none for block 0).
    #[serde(default)]
    #[schema(value_type = Vec<AddressText>)]
    pub signers: Vec<Address>,
}

/// `GET /validators`: the chain's validator set, from genesis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ValidatorsView {
    /// In ascending address order (the order proposers rotate in).
    pub validators: Vec<ValidatorView>,
    pub total_voting_power: u64,
    /// The voting power a commit certificate needs: more than 2/3 of the total.
    pub quorum: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ValidatorView {
    #[schema(value_type = AddressText)]
    pub address: Address,
    pub voting_power: u64,
}

/// The commit certificate of a block: precommits of more than 2/3 of the voting power.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CertificateView {
    /// The consensus round the block was committed in.
    pub round: u32,
    pub signatures: Vec<CommitSignatureView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CommitSignatureView {
    #[schema(value_type = AddressText)]
    pub validator: Address,
    /// Its precommit signature, hex.
    #[schema(value_type = SignatureText)]
    pub signature: String,
}

/// `GET /params`: the rules the chain's genesis set, so that a client can read what a bond
/// must be, how long unbonding takes and what evidence costs without the genesis file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ParamsView {
    /// What transactions, receipts and blocks name as their chain, and what every signature
    /// commits to: `NAME:GENESIS_HASH` on a format-2 chain, the name alone on a format-1 one.
    pub chain_id: String,
    /// The chain's format (`genesis.json`'s `format`): 2 for new chains; 1 from a node that
    /// predates formats.
    #[serde(default = "format_1")]
    pub format: u8,
    #[schema(value_type = HashText)]
    pub genesis_hash: Hash,
    /// Bytes of metered dispatch traffic in one reward unit.
    pub unit_bytes: u64,
    /// Paid per unit of metered traffic.
    pub reward_per_unit: AmountView,
    /// Blocks a credit stays pending before it settles.
    pub challenge_window: u64,
    pub block_interval_ms: u64,
    pub max_block_txs: u32,
    pub max_block_bytes: u64,
    /// The smallest transfer that may create an account (zero: none).
    pub min_new_account: AmountView,
    /// What a worker must have bonded to be admitted and dispatched to. Zero: this chain has
    /// no bonds, and refuses Bond and Unbond.
    pub min_bond: AmountView,
    /// Blocks an unbonded amount stays slashable before it returns to the balance: an
    /// unbonding started in block H is released at height H + unbonding_blocks.
    pub unbonding_blocks: u64,
    /// The share of a convicted worker's bond (bonded and unbonding) that accepted evidence
    /// takes.
    #[schema(value_type = FractionText)]
    pub slash_fraction: Fraction,
    /// The share of a slashed amount paid to the reporter; the rest is burned.
    #[schema(value_type = FractionText)]
    pub reporter_share: Fraction,
    /// Blocks a convicted key is barred from serving and from being paid.
    pub jail_blocks: u64,
    /// The models the chain pins: what evidence is judged against, and what offers and
    /// orders may name, by id or name.
    #[serde(default)]
    pub models: Vec<PinnedModelView>,
}

/// `GET /fees`: what a transaction pays in the next block, per byte of its encoding
/// (`kvasir_ledger::fees`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FeesView {
    /// The head the quote is for: the next block is the one after it.
    pub height: u64,
    /// Whether this chain charges fees (format 2). When not, every price below is zero and
    /// transactions bid none.
    pub charged: bool,
    /// The open lane's price per byte in the next block, burned: everything but credits and
    /// evidence pays it.
    pub base_fee: AmountView,
    /// The lowest the base fee goes.
    pub min_base_fee: AmountView,
    /// The reserved lane's fixed price per byte: credits and evidence.
    pub lane_fee: AmountView,
    /// The share of every block kept for the reserved lane.
    #[schema(value_type = FractionText)]
    pub lane_share: Fraction,
    /// A tip per byte that puts a transaction into the next block among those waiting now:
    /// zero unless the open lane has more waiting than one block holds.
    pub suggested_tip: AmountView,
    /// What a reporter of evidence must hold beside its fee, lost if the answer it disputes
    /// was right.
    pub evidence_deposit: AmountView,
}

impl FeesView {
    /// The bid a wallet makes for a transaction in `lane` tipping `tip` per byte
    /// (`FeeBid::suggested`); `None` on a chain without fees.
    pub fn bid(&self, lane: Lane, tip: Amount) -> Option<FeeBid> {
        self.charged
            .then(|| FeeBid::suggested(&self.params(), self.base_fee.base_units, lane, tip))
    }

    /// What a transaction of `bytes` bytes in `lane` bidding `bid` pays at this quote's base
    /// fee (`fees::charge`).
    pub fn charge(&self, lane: Lane, bid: &FeeBid, bytes: usize) -> Result<Charge, TxError> {
        fees::charge(&self.params(), self.base_fee.base_units, lane, bid, bytes)
    }

    fn params(&self) -> FeeParams {
        FeeParams {
            min_base_fee: self.min_base_fee.base_units,
            lane_fee: self.lane_fee.base_units,
            lane_share: self.lane_share,
            evidence_deposit: self.evidence_deposit.base_units,
        }
    }
}

/// What a node that predates chain formats serves: format 1.
fn format_1() -> u8 {
    1
}

/// A model a chain pins, as offers and orders see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PinnedModelView {
    pub id: String,
    /// The blake3 of its config.json, and the Merkle root over its experts' leaves: what
    /// evidence's weights are checked against.
    #[schema(value_type = HashText)]
    pub config_hash: Hash,
    #[schema(value_type = HashText)]
    pub experts_root: Hash,
    /// Its short name; empty on a format-1 chain.
    pub name: String,
    /// Its layers, dense ones included, and experts per layer: a selection must lie within
    /// them. Absent on a format-1 chain.
    pub layers: Option<u16>,
    pub experts: Option<u16>,
    /// The version of the reference arithmetic its answers are judged by (0: not said).
    pub arithmetic: u32,
}

/// `GET /accounts/{address}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AccountView {
    #[schema(value_type = AddressText)]
    pub address: Address,
    /// Spendable.
    pub balance: AmountView,
    /// Credited rewards still inside their challenge window, in settle-height order.
    pub pending: Vec<PendingView>,
    pub pending_total: AmountView,
    /// Earned while the rewards pool was empty: a claim, paid when the pool refills.
    pub owed: AmountView,
    /// The nonce the account's next transaction must carry.
    pub nonce: u64,
    /// Staked as a worker's guarantee: what accepted evidence slashes.
    pub bonded: AmountView,
    /// Unbonded amounts on their way back to the balance, still slashable, in release order.
    pub unbonding: Vec<UnbondingView>,
    pub unbonding_total: AmountView,
    /// The key is barred from serving and from being paid below this height (0: never
    /// convicted).
    pub jailed_until: u64,
    /// Whether the key is barred in the next block (head height + 1 < `jailed_until`): the
    /// height a credit submitted now would be judged at.
    pub jailed: bool,
    /// Accepted evidence of the key's wrong answers, oldest first.
    #[serde(default)]
    pub convictions: Vec<ConvictionView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PendingView {
    pub amount: AmountView,
    pub settle_height: u64,
    /// The metering session it was credited for, which evidence against that session
    /// cancels; absent for an owed claim paid when the pool refilled, which belongs to none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionRef>,
    /// The order whose escrow paid it; absent for pay from the rewards pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<u64>,
}

/// One hub's metering session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionRef {
    #[schema(value_type = AddressText)]
    pub hub: Address,
    pub session_id: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct UnbondingView {
    pub amount: AmountView,
    /// The height from which it is spendable again.
    pub release_height: u64,
}

impl AccountView {
    /// `kvr1...: settled 1 KVR, pending 0.008945664 KVR (0.008945664 KVR settling at height
    /// 12), bonded 10 KVR, unbonding 5 KVR (5 KVR released at height 32), jailed until height
    /// 140`: what `kvasir-wallet balance` prints. The bond part appears only on an account that
    /// has bonded something, and the jail only while it holds, so a plain account (and every
    /// account of a chain without bonds) reads as it always did.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{}: settled {}, pending {}{}",
            self.address,
            self.balance.kvr,
            self.pending_total.kvr,
            details(
                self.pending
                    .iter()
                    .map(|p| format!("{} settling at height {}", p.amount.kvr, p.settle_height))
            )
        );
        if !self.bonded.base_units.is_zero() || !self.unbonding.is_empty() {
            line +=
                &format!(
                    ", bonded {}, unbonding {}{}",
                    self.bonded.kvr,
                    self.unbonding_total.kvr,
                    details(self.unbonding.iter().map(|u| format!(
                        "{} released at height {}",
                        u.amount.kvr, u.release_height
                    )))
                );
        }
        if self.jailed {
            line += &format!(", jailed until height {}", self.jailed_until);
        }
        line
    }
}

/// ` (a, b)`, or nothing when there is nothing to list.
fn details(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    if items.is_empty() {
        String::new()
    } else {
        format!(" ({})", items.join(", "))
    }
}

/// `GET /accounts/{address}/history`: newest first; `next_before` pages on (absent on the
/// last page).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct History {
    #[schema(value_type = AddressText)]
    pub address: Address,
    pub entries: Vec<HistoryEntry>,
    /// `HEIGHT.INDEX` to pass as `before` for the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_before: Option<String>,
}

/// One transaction the account is a party to, where it sits in the chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HistoryEntry {
    pub height: u64,
    pub index: u32,
    #[schema(value_type = HashText)]
    pub hash: Hash,
    #[serde(flatten)]
    pub event: HistoryEvent,
}

impl HistoryEntry {
    /// Its location as `before` takes it: `HEIGHT.INDEX`.
    pub fn location(&self) -> String {
        format!("{}.{}", self.height, self.index)
    }
}

/// What the transaction did, as the account sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HistoryEvent {
    Transfer {
        direction: Direction,
        #[schema(value_type = AddressText)]
        from: Address,
        #[schema(value_type = AddressText)]
        to: Address,
        amount: AmountView,
    },
    Credit {
        #[schema(value_type = AddressText)]
        worker: Address,
        #[schema(value_type = AddressText)]
        gateway: Address,
        #[schema(value_type = AddressText)]
        hub: Address,
        session_id: u64,
        /// The order whose escrow pays it; zero for the rewards pool.
        #[serde(default)]
        order: u64,
        cumulative_bytes: u64,
    },
    /// The account moved `amount` of its balance into its bond.
    Bond {
        amount: AmountView,
    },
    /// The account started unbonding `amount`.
    Unbond {
        amount: AmountView,
    },
    /// Evidence that `worker` answered request `request_id` of a session wrongly.
    Evidence {
        #[schema(value_type = AddressText)]
        reporter: Address,
        #[schema(value_type = AddressText)]
        worker: Address,
        #[schema(value_type = AddressText)]
        hub: Address,
        session_id: u64,
        request_id: u64,
    },
    /// The account offered experts of a model at a price per reward unit.
    OfferCreate {
        model: String,
        /// `LAYERS:EXPERTS` items.
        experts: String,
        price: AmountView,
        expiry_height: u64,
    },
    OfferWithdraw {
        offer: u64,
    },
    /// The account ordered replicas of experts of a model, with an escrow deposit.
    OrderCreate {
        model: String,
        experts: String,
        replicas: u8,
        max_price: AmountView,
        deposit: AmountView,
        end_height: u64,
    },
    OrderDeposit {
        order: u64,
        amount: AmountView,
    },
    OrderClose {
        order: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    In,
    Out,
}

/// `GET /blocks/{height}`, `GET /blocks/by-hash/{hash}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BlockView {
    pub height: u64,
    #[schema(value_type = HashText)]
    pub hash: Hash,
    #[schema(value_type = HashText)]
    pub prev_hash: Hash,
    pub timestamp_ms: u64,
    #[schema(value_type = HashText)]
    pub tx_root: Hash,
    #[schema(value_type = HashText)]
    pub state_root: Hash,
    #[schema(value_type = AddressText)]
    pub proposer: Address,
    /// The hashes of its transactions, in order.
    #[schema(value_type = Vec<HashText>)]
    pub txs: Vec<Hash>,
    /// What committed it (none for block 0).
    #[serde(default)]
    pub certificate: Option<CertificateView>,
}

/// `POST /txs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Submission {
    /// The signed transaction, borsh-encoded, in hex.
    #[schema(value_type = TxHexText)]
    pub tx: String,
}

/// `POST /txs`: admitted to the mempool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Submitted {
    #[schema(value_type = HashText)]
    pub hash: Hash,
}

/// `POST /txs/batch`: up to 10,000 transactions in one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Batch {
    /// Signed transactions, each borsh-encoded, in hex.
    #[schema(value_type = Vec<TxHexText>, max_items = 10_000)]
    pub txs: Vec<String>,
}

/// `POST /txs/batch`: one verdict per transaction, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BatchVerdicts {
    pub results: Vec<Verdict>,
}

/// Admitted (its hash), or refused (why).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Verdict {
    Admitted(Submitted),
    Refused(ErrorBody),
}

/// `GET /txs/{hash}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TxStatus {
    #[schema(value_type = HashText)]
    pub hash: Hash,
    #[serde(flatten)]
    pub state: TxState,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TxState {
    /// In the mempool.
    Pending,
    Committed {
        height: u64,
        index: u32,
    },
    /// Left the mempool without being committed, and why.
    Rejected {
        reason: String,
    },
}

/// `GET /sessions/{hub}/{session}[?order=N]`: the receipt high-water mark of one hub
/// session's traffic for an order (zero, the default: outside any order); zero bytes, and no
/// worker, when it was never credited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionMark {
    #[schema(value_type = AddressText)]
    pub hub: Address,
    pub session_id: u64,
    #[serde(default)]
    pub order: u64,
    #[schema(value_type = Option<AddressText>)]
    pub worker: Option<Address>,
    pub cumulative_bytes: u64,
    /// What accepted evidence of a wrong answer by the session's worker in it did; absent
    /// while it has none (a worker is convicted at most once per session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conviction: Option<ConvictionView>,
}

/// The outcome of accepted evidence of a worker's wrong answer, as the ledger keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ConvictionView {
    /// The session the wrong answer was given in: it pays the worker nothing more.
    pub session: SessionRef,
    /// The height of the block that accepted the evidence.
    pub height: u64,
    /// The request the wrong answer was given to.
    pub request_id: u64,
    /// Who submitted the evidence (and was paid `reporter_paid`).
    #[schema(value_type = AddressText)]
    pub reporter: Address,
    /// The session's pending rewards, returned to the rewards pool.
    pub cancelled: AmountView,
    /// The worker's owed claims (credits the pool could not cover yet), dropped.
    pub owed_forfeited: AmountView,
    /// Taken from the worker's bond and unbonding amounts.
    pub slashed: AmountView,
    /// The part of `slashed` paid to the reporter; the rest was burned.
    pub reporter_paid: AmountView,
    /// The worker's key is barred from serving and from being paid below this height.
    pub jailed_until: u64,
}

impl From<&Conviction> for ConvictionView {
    fn from(conviction: &Conviction) -> ConvictionView {
        ConvictionView {
            session: SessionRef {
                hub: conviction.session.hub,
                session_id: conviction.session.session_id,
            },
            height: conviction.height,
            request_id: conviction.request_id,
            reporter: conviction.reporter,
            cancelled: conviction.cancelled.into(),
            owed_forfeited: conviction.owed_forfeited.into(),
            slashed: conviction.slashed.into(),
            reporter_paid: conviction.reporter_paid.into(),
            jailed_until: conviction.jailed_until,
        }
    }
}

/// `?after=ID&limit=N`: a page of a listing in session-id order, of the ids above `after`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Only sessions with a greater id (the previous page's `next_after`).
    #[param(maximum = 18446744073709551615u64)]
    pub after: Option<u64>,
    /// At most this many (default 1,000; more is read as 10,000).
    #[param(maximum = 18446744073709551615u64)]
    pub limit: Option<u64>,
}

/// `?order=N` of `GET /sessions/{hub}/{session}`.
#[derive(Clone, Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OrderQuery {
    /// The market order (zero, the default: traffic outside any order).
    #[param(maximum = 18446744073709551615u64)]
    pub order: Option<u64>,
}

/// Entries a page holds unless `limit` says fewer.
pub const PAGE_DEFAULT: usize = 1_000;
/// Entries a page holds at most.
pub const PAGE_MAX: usize = 10_000;

impl PageQuery {
    /// The page size asked for, within bounds.
    pub fn limit(&self) -> usize {
        self.limit.map_or(PAGE_DEFAULT, |limit| {
            limit.clamp(1, PAGE_MAX as u64) as usize
        })
    }
}

/// `GET /sessions/{hub}`: a page of a hub's credited sessions, in id order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HubSessions {
    #[schema(value_type = AddressText)]
    pub hub: Address,
    pub sessions: Vec<CreditedSession>,
    /// `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CreditedSession {
    pub session_id: u64,
    /// The order this count is for; zero (the default) for traffic outside any order.
    #[serde(default)]
    pub order: u64,
    #[schema(value_type = AddressText)]
    pub worker: Address,
    pub cumulative_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_travel_as_base_units_and_exact_decimal() {
        let view = AmountView::from(Amount::from_base_units(8_945_664));
        let text = serde_json::to_string(&view).unwrap();
        assert_eq!(text, r#"{"base_units":"8945664","kvr":"0.008945664"}"#);
        assert_eq!(serde_json::from_str::<AmountView>(&text).unwrap(), view);
        for bad in [
            r#"{"base_units":8945664,"kvr":"0.008945664"}"#,
            r#"{"base_units":"-1","kvr":"0"}"#,
            r#"{"base_units":"18446744073709551616","kvr":"0"}"#,
            r#"{"base_units":"8945664","kvr":"8.945664"}"#,
        ] {
            assert!(serde_json::from_str::<AmountView>(bad).is_err(), "{bad}");
        }
    }

    fn account(
        bonded: &str,
        unbonding: &[(&str, u64)],
        jailed_until: u64,
        jailed: bool,
    ) -> AccountView {
        let kvr = |text: &str| AmountView::from(Amount::parse(text).unwrap());
        let address = kvasir_ledger::Keypair::from_seed(&[7; 32]).address();
        let unbonding: Vec<UnbondingView> = unbonding
            .iter()
            .map(|(amount, release_height)| UnbondingView {
                amount: kvr(amount),
                release_height: *release_height,
            })
            .collect();
        let total = unbonding
            .iter()
            .map(|u| u.amount.base_units.base_units())
            .sum();
        AccountView {
            address,
            balance: kvr("1"),
            pending: vec![PendingView {
                amount: kvr("0.5"),
                settle_height: 12,
                session: Some(SessionRef {
                    hub: address,
                    session_id: 3,
                }),
                order: None,
            }],
            pending_total: kvr("0.5"),
            owed: kvr("0"),
            nonce: 2,
            bonded: kvr(bonded),
            unbonding,
            unbonding_total: Amount::from_base_units(total).into(),
            jailed_until,
            jailed,
            convictions: Vec::new(),
        }
    }

    #[test]
    fn the_summary_names_the_bond_only_where_there_is_one_and_the_jail_while_it_holds() {
        let plain = account("0", &[], 0, false);
        let head = format!(
            "{}: settled 1 KVR, pending 0.5 KVR (0.5 KVR settling at height 12)",
            plain.address
        );
        assert_eq!(plain.summary(), head);
        // A jail that has ended is history, not state: not shown.
        let bonded = account("10", &[("2", 30), ("1.5", 31)], 5, false);
        assert_eq!(
            bonded.summary(),
            format!("{head}, bonded 10 KVR, unbonding 3.5 KVR (2 KVR released at height 30, 1.5 KVR released at height 31)")
        );
        let jailed = account("0", &[("5", 40)], 140, true);
        assert_eq!(
            jailed.summary(),
            format!("{head}, bonded 0 KVR, unbonding 5 KVR (5 KVR released at height 40), jailed until height 140")
        );
    }

    #[test]
    fn a_pending_entry_names_its_session_only_when_it_has_one() {
        let mut view = account("10", &[("1", 9)], 0, false);
        let value = serde_json::to_value(&view).unwrap();
        assert_eq!(value["pending"][0]["session"]["session_id"], 3);
        assert_eq!(value["unbonding"][0]["release_height"], 9);
        assert_eq!(value["bonded"]["kvr"], "10");
        assert_eq!(value["jailed"], false);
        assert_eq!(serde_json::from_value::<AccountView>(value).unwrap(), view);
        view.pending[0].session = None;
        let value = serde_json::to_value(&view).unwrap();
        assert!(value["pending"][0].get("session").is_none(), "{value}");
        assert_eq!(serde_json::from_value::<AccountView>(value).unwrap(), view);
    }

    /// What `FRACTION_PATTERN` says, spelled out: `0`, `1`, `0.` or `1.` and up to nine
    /// digits (zeros after a one).
    fn fits_fraction_pattern(text: &str) -> bool {
        assert_eq!(
            crate::schema::FRACTION_PATTERN,
            "^(0(\\.[0-9]{1,9})?|1(\\.0{1,9})?)$"
        );
        let (whole, decimals) = text.split_once('.').unwrap_or((text, ""));
        let digits = !text.contains('.') || (1..=9).contains(&decimals.len());
        match whole {
            "0" => digits && decimals.bytes().all(|b| b.is_ascii_digit()),
            "1" => digits && decimals.bytes().all(|b| b == b'0'),
            _ => false,
        }
    }

    #[test]
    fn every_fraction_the_params_carry_fits_the_documented_pattern() {
        for text in ["0", "1", "0.5", "0.1", "0.000000001", "0.999999999"] {
            let fraction = Fraction::parse(text).unwrap();
            let written = serde_json::to_value(fraction).unwrap();
            let written = written.as_str().unwrap();
            assert!(
                fits_fraction_pattern(written),
                "{text} is written {written}"
            );
        }
        assert!(!fits_fraction_pattern("1.5") && !fits_fraction_pattern("0."));
    }

    #[test]
    fn tagged_bodies_keep_their_wire_form() {
        let status = TxStatus {
            hash: Hash::ZERO,
            state: TxState::Committed {
                height: 3,
                index: 1,
            },
        };
        let value = serde_json::to_value(&status).unwrap();
        assert_eq!(value["status"], "committed");
        assert_eq!(value["height"], 3);
        assert_eq!(serde_json::from_value::<TxStatus>(value).unwrap(), status);
        let refused: Verdict =
            serde_json::from_str(r#"{"error":"conflict","message":"duplicate"}"#).unwrap();
        assert!(matches!(refused, Verdict::Refused(_)));
        let admitted: Verdict =
            serde_json::from_str(&format!(r#"{{"hash":"{}"}}"#, Hash::ZERO)).unwrap();
        assert!(matches!(admitted, Verdict::Admitted(_)));
    }
}
