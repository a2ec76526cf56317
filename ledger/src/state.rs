//! The ledger state: accounts, receipt high-water marks and the authenticated tree that
//! commits to them. Maps are persistent (imbl), so a `State` clones in O(1) and block
//! application can work on a copy that is simply dropped when the block turns out invalid.

use std::collections::BTreeSet;
use std::sync::Arc;

use borsh::{BorshDeserialize, BorshSerialize};
use imbl::{OrdMap, OrdSet};
use serde::Serialize;

use crate::amount::Amount;
use crate::block::genesis_block_with_root;
use crate::error::TxError;
use crate::fees::{FeeBid, Lane};
use crate::genesis::{Genesis, ModelPin};
use crate::hash::Hash;
use crate::keys::Address;
use crate::market::{Market, Offer, Order, Placement};
use crate::receipt::Receipt;
use crate::tree::StateTree;
use crate::tx::{Evidence, ExpertWeights};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Account {
    /// Spendable balance.
    pub balance: Amount,
    pub nonce: u64,
    /// Credited rewards still inside their challenge window, in settle-height order.
    pub pending: Vec<PendingReward>,
    /// Rewards earned while the pool was empty: a claim, not money, paid when the pool refills.
    pub owed: Amount,
    /// Staked as a worker's guarantee: what accepted evidence slashes.
    pub bonded: Amount,
    /// Unbonded amounts on their way back to the balance, still slashable, in release order.
    pub unbonding: Vec<Unbonding>,
    /// The key is barred from serving and from being paid below this height.
    pub jailed_until: u64,
    /// What accepted evidence of its wrong answers did, one per session at most, oldest
    /// first. Kept with the worker, not the session: the hub's receipts alone say whose a
    /// session is, and evidence (which anyone can make name any session) never touches them.
    /// Each conviction needs a full stake and slashes part of it, so the list stays short.
    pub convictions: Vec<Conviction>,
}

/// Credited rewards of one metering session, inside their challenge window: accepted
/// evidence against that session cancels them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct PendingReward {
    pub settle_height: u64,
    pub amount: Amount,
    pub session: SessionKey,
    /// The order whose escrow paid it; zero for the rewards pool. Cancelled pay returns there.
    pub order: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Unbonding {
    pub release_height: u64,
    pub amount: Amount,
}

impl Account {
    /// Whether evidence of a wrong answer by this key in `session` was accepted.
    pub fn is_convicted_in(&self, session: &SessionKey) -> bool {
        self.convictions.iter().any(|c| c.session == *session)
    }

    pub fn pending_total(&self) -> Amount {
        sum(self.pending.iter().map(|p| p.amount))
    }

    pub fn unbonding_total(&self) -> Amount {
        sum(self.unbonding.iter().map(|u| u.amount))
    }

    /// Whether the key is barred at `height` (from serving and from being paid).
    pub fn is_jailed(&self, height: u64) -> bool {
        height < self.jailed_until
    }

    /// Heights at which something of this account matures: pending rewards and unbondings.
    fn maturity_heights(&self) -> impl Iterator<Item = u64> + '_ {
        let settles = self.pending.iter().map(|p| p.settle_height);
        settles.chain(self.unbonding.iter().map(|u| u.release_height))
    }
}

/// The sum of amounts an account holds; saturating, as the supply bounds every real sum.
fn sum(mut amounts: impl Iterator<Item = Amount>) -> Amount {
    amounts
        .try_fold(Amount::ZERO, |total, a| total.checked_add(a))
        .unwrap_or(Amount::MAX)
}

/// Recomputes a disputed answer: what a validator needs beyond the chain to check evidence.
/// The node implements it: over the checkpoints a format-1 genesis pins, or, on a format-2
/// chain, over the expert weights the evidence carries, checked against the pin. It must be
/// a pure function of its inputs, as every validator must reach the same verdict.
pub trait AnswerCheck: Send + Sync {
    /// Whether the worker's signed answer in `evidence` differs from what a correct worker
    /// sends under `model`: the whole response, recomputed from the checkpoint (format 1), or
    /// the partial of the expert `weights` carries, recomputed from those bytes (format 2).
    /// Or why there is no verdict: the request is malformed, not request `request_id` of
    /// `session`, or the weights are not the pinned expert's (found before anything is
    /// computed, as a recomputation is costly).
    fn is_wrong(
        &self,
        model: &ModelPin,
        evidence: &Evidence,
        weights: Option<&ExpertWeights>,
    ) -> Result<bool, String>;
}

/// A metering session: receipts of one hub about one session id.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    BorshSerialize,
    BorshDeserialize,
)]
pub struct SessionKey {
    pub hub: Address,
    pub session_id: u64,
}

impl SessionKey {
    pub fn of(receipt: &Receipt) -> Self {
        SessionKey {
            hub: receipt.hub,
            session_id: receipt.session_id,
        }
    }
}

/// What one hub meters: a worker session's traffic for one order (zero: outside any order,
/// paid by the rewards pool). Each has its own cumulative count.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    BorshSerialize,
    BorshDeserialize,
)]
pub struct MeterKey {
    pub session: SessionKey,
    pub order: u64,
}

impl MeterKey {
    pub fn of(receipt: &Receipt) -> Self {
        MeterKey {
            session: SessionKey::of(receipt),
            order: receipt.order,
        }
    }
}

/// The highest cumulative count credited for a metering key, and whose session it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct ReceiptMark {
    pub worker: Address,
    pub cumulative_bytes: u64,
}

/// What accepted evidence of a worker's wrong answer in a session did: that session pays the
/// worker nothing more, and no further evidence of its answers in it is taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Conviction {
    pub session: SessionKey,
    pub height: u64,
    pub request_id: u64,
    pub reporter: Address,
    /// The session's pending rewards, returned to the rewards pool.
    pub cancelled: Amount,
    /// The worker's owed claims (credits the pool could not cover yet), dropped: they carry
    /// no session, so any of them may be for the answers proven wrong.
    pub owed_forfeited: Amount,
    /// Taken from the worker's bond and unbonding amounts.
    pub slashed: Amount,
    /// The part of `slashed` paid to the reporter; the rest was burned.
    pub reporter_paid: Amount,
    pub jailed_until: u64,
}

/// The state entries a block changed, for storage to persist with the block; also every
/// entry of a state, to rebuild it (`State::from_parts`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChangeSet {
    pub accounts: Vec<(Address, Account)>,
    pub receipts: Vec<(MeterKey, ReceiptMark)>,
    pub offers: Vec<Offer>,
    pub orders: Vec<Order>,
    pub placements: Vec<Placement>,
    /// The base fee per byte, on a chain with fees (`fees`) when it changed.
    pub base_fee: Option<Amount>,
}

#[derive(Clone)]
pub struct State {
    genesis: Arc<Genesis>,
    /// `genesis.chain_id()`, kept: on a format-2 chain it hashes the genesis.
    chain_id: Arc<str>,
    pool: Address,
    height: u64,
    block_hash: Hash,
    timestamp_ms: u64,
    accounts: OrdMap<Address, Account>,
    receipts: OrdMap<MeterKey, ReceiptMark>,
    market: Market,
    /// The open lane's price per byte for the next block (`fees::next_base_fee`); zero on a
    /// chain without fees.
    base_fee: Amount,
    /// The proposer of the block being applied, paid its transactions' tips; set by
    /// `begin_block`, not committed.
    proposer: Option<Address>,
    tree: StateTree,
    /// How evidence is recomputed; a state without one refuses evidence (`TxError::CannotCheckEvidence`).
    answer_check: Option<Arc<dyn AnswerCheck>>,
    // Indexes derivable from the accounts; not committed, rebuilt on load.
    maturing: OrdMap<u64, OrdSet<Address>>,
    owed: OrdSet<Address>,
    // Entries changed since the last `commit_dirty`; empty between blocks.
    dirty_accounts: BTreeSet<Address>,
    dirty_receipts: BTreeSet<MeterKey>,
    dirty_offers: BTreeSet<u64>,
    dirty_orders: BTreeSet<u64>,
    dirty_placements: BTreeSet<u64>,
    dirty_base_fee: bool,
}

/// The base fee's place in the state tree.
fn base_fee_key() -> Hash {
    Hash::of_parts(&[b"F"])
}

fn account_key(address: &Address) -> Hash {
    Hash::of_parts(&[b"A", address.as_bytes()])
}

fn receipt_key(key: &MeterKey) -> Hash {
    let session = &key.session;
    let parts: [&[u8]; 3] = [
        b"R",
        session.hub.as_bytes(),
        &session.session_id.to_le_bytes(),
    ];
    // Traffic outside any order keeps the key it had before orders existed.
    if key.order == 0 {
        return Hash::of_parts(&parts);
    }
    Hash::of_parts(&[&parts[..], &[&key.order.to_le_bytes()[..]]].concat())
}

fn market_key(kind: &[u8], id: u64) -> Hash {
    Hash::of_parts(&[b"M", kind, &id.to_le_bytes()])
}

impl State {
    /// The state before block 1: genesis allocations and the rewards pool.
    pub fn from_genesis(genesis: Genesis) -> State {
        let pool = genesis.rewards_pool_address();
        let mut accounts = vec![(
            pool,
            Account {
                balance: genesis.params.rewards_pool,
                ..Account::default()
            },
        )];
        accounts.extend(genesis.allocations.iter().map(|a| {
            (
                a.address,
                Account {
                    balance: a.amount,
                    ..Account::default()
                },
            )
        }));
        let timestamp_ms = genesis.genesis_time_ms;
        let entries = ChangeSet {
            accounts,
            base_fee: genesis.params.fees.map(|fees| fees.min_base_fee),
            ..ChangeSet::default()
        };
        let mut state = State::from_parts(Arc::new(genesis), 0, Hash::ZERO, timestamp_ms, entries);
        state.block_hash = genesis_block_with_root(&state.genesis, state.root()).hash();
        state
    }

    /// Rebuilds a state from all its stored entries at a given head.
    pub fn from_parts(
        genesis: Arc<Genesis>,
        height: u64,
        block_hash: Hash,
        timestamp_ms: u64,
        entries: ChangeSet,
    ) -> State {
        let pool = genesis.rewards_pool_address();
        let mut state = State {
            chain_id: genesis.chain_id().into(),
            genesis,
            pool,
            height,
            block_hash,
            timestamp_ms,
            accounts: OrdMap::new(),
            receipts: OrdMap::new(),
            market: Market::default(),
            base_fee: Amount::ZERO,
            proposer: None,
            tree: StateTree::default(),
            answer_check: None,
            maturing: OrdMap::new(),
            owed: OrdSet::new(),
            dirty_accounts: BTreeSet::new(),
            dirty_receipts: BTreeSet::new(),
            dirty_offers: BTreeSet::new(),
            dirty_orders: BTreeSet::new(),
            dirty_placements: BTreeSet::new(),
            dirty_base_fee: false,
        };
        if let Some(base_fee) = entries.base_fee {
            state.set_base_fee(base_fee);
        }
        for (address, account) in entries.accounts {
            state.set_account(address, account);
        }
        for receipt in entries.receipts {
            state.write(Writes {
                receipt: Some(receipt),
                ..Writes::default()
            });
        }
        state.write(Writes {
            offers: entries.offers,
            orders: entries.orders,
            placements: entries.placements,
            ..Writes::default()
        });
        state.commit_dirty();
        state
    }

    pub fn genesis(&self) -> &Genesis {
        &self.genesis
    }

    /// The chain's `Genesis::chain_id`: what its signatures commit to.
    pub fn chain_id(&self) -> &str {
        &self.chain_id
    }

    /// This state, able to check evidence with `check`. Not part of the state (it commits to
    /// nothing): a capability of the node holding it, kept by every state derived from it.
    pub fn with_answer_check(mut self, check: Arc<dyn AnswerCheck>) -> State {
        self.answer_check = Some(check);
        self
    }

    pub fn answer_check(&self) -> Option<&dyn AnswerCheck> {
        self.answer_check.as_deref()
    }

    pub(crate) fn genesis_arc(&self) -> &Arc<Genesis> {
        &self.genesis
    }

    pub fn height(&self) -> u64 {
        self.height
    }

    pub fn block_hash(&self) -> Hash {
        self.block_hash
    }

    pub fn timestamp_ms(&self) -> u64 {
        self.timestamp_ms
    }

    /// The authenticated root over every account and receipt mark, as of the last commit.
    pub fn root(&self) -> Hash {
        self.tree.root()
    }

    pub fn rewards_pool(&self) -> Address {
        self.pool
    }

    /// An account; one never seen is empty.
    pub fn account(&self, address: &Address) -> Account {
        self.accounts.get(address).cloned().unwrap_or_default()
    }

    /// An account without copying it; `None` for one never seen.
    pub fn account_ref(&self, address: &Address) -> Option<&Account> {
        self.accounts.get(address)
    }

    /// Whether `address` has an account: it was allocated in genesis or a transaction wrote
    /// to it. Accounts are never removed.
    pub fn has_account(&self, address: &Address) -> bool {
        self.accounts.contains_key(address)
    }

    pub fn accounts(&self) -> impl Iterator<Item = (&Address, &Account)> {
        self.accounts.iter()
    }

    pub fn receipt_mark(&self, key: &MeterKey) -> Option<&ReceiptMark> {
        self.receipts.get(key)
    }

    /// Whose session this is, from any receipt credited for it (they all name one worker).
    pub fn session_worker(&self, session: &SessionKey) -> Option<Address> {
        let first = MeterKey {
            session: *session,
            order: 0,
        };
        let last = MeterKey {
            session: *session,
            order: u64::MAX,
        };
        self.receipts
            .range(first..=last)
            .next()
            .map(|(_, mark)| mark.worker)
    }

    pub fn receipts(&self) -> impl Iterator<Item = (&MeterKey, &ReceiptMark)> {
        self.receipts.iter()
    }

    pub fn market(&self) -> &Market {
        &self.market
    }

    /// The open lane's price per byte in the next block; zero on a chain without fees.
    pub fn base_fee(&self) -> Amount {
        self.base_fee
    }

    /// `FeeBid::suggested` for `lane` on this chain now; `None` on a chain without fees.
    pub fn suggested_bid(&self, lane: Lane, tip: Amount) -> Option<FeeBid> {
        let fees = self.genesis.params.fees.as_ref()?;
        Some(FeeBid::suggested(fees, self.base_fee, lane, tip))
    }

    fn set_base_fee(&mut self, base_fee: Amount) {
        self.base_fee = base_fee;
        self.dirty_base_fee = true;
    }

    /// Starts applying a block proposed by `proposer`, who is paid its transactions' tips.
    pub(crate) fn begin_block(&mut self, proposer: Address) {
        self.proposer = Some(proposer);
    }

    /// Whom the tips of the block being applied go to: its proposer; outside a block (a
    /// mempool's checks), nobody is paid, and the burn address stands in.
    pub(crate) fn tip_receiver(&self) -> Address {
        self.proposer.unwrap_or_else(|| self.genesis.burn_address())
    }

    /// Every base unit held: balances, pending rewards, bonds, unbondings and orders'
    /// escrows (the pool and the burned amount are accounts). Owed claims are not money and
    /// are not counted. Constant from genesis on.
    pub fn total_money(&self) -> u128 {
        self.market.total_escrow()
            + self
                .accounts
                .values()
                .map(|a| {
                    [a.balance, a.pending_total(), a.bonded, a.unbonding_total()]
                        .iter()
                        .map(|x| u128::from(x.base_units()))
                        .sum::<u128>()
                })
                .sum::<u128>()
    }

    pub fn total_owed(&self) -> u128 {
        self.owed
            .iter()
            .map(|a| u128::from(self.account(a).owed.base_units()))
            .sum()
    }

    fn set_account(&mut self, address: Address, account: Account) {
        for height in account.maturity_heights() {
            self.maturing.entry(height).or_default().insert(address);
        }
        if account.owed.is_zero() {
            self.owed.remove(&address);
        } else {
            self.owed.insert(address);
        }
        self.accounts.insert(address, account);
        self.dirty_accounts.insert(address);
    }

    /// Applies writes computed by `Staged`; cannot fail, so a state is never half-changed.
    pub(crate) fn write(&mut self, writes: Writes) {
        for (address, account) in writes.accounts {
            self.set_account(address, account);
        }
        if let Some((key, mark)) = writes.receipt {
            self.receipts.insert(key, mark);
            self.dirty_receipts.insert(key);
        }
        for offer in writes.offers {
            self.dirty_offers.insert(offer.id);
            self.market.set_offer(offer);
        }
        for order in writes.orders {
            self.dirty_orders.insert(order.id);
            self.market.set_order(order);
        }
        for placement in writes.placements {
            self.dirty_placements.insert(placement.id);
            self.market.set_placement(placement);
        }
    }

    /// The block-boundary step after a block's transactions at `height`: the market's
    /// (expiries, matching, pauses; `market::end_block`), then owed claims are paid from
    /// whatever the pool now holds (address order), then pending rewards whose settle
    /// height has come, and unbondings whose release height has, move into balances.
    /// First, on a chain with fees, the base fee moves by how full the block's open lane was
    /// (`open_fullness`, in parts per `fees::FULL`).
    pub(crate) fn end_block(&mut self, height: u64, open_fullness: u64) -> Result<(), TxError> {
        if let Some(fees) = self.genesis.params.fees {
            let next = crate::fees::next_base_fee(&fees, self.base_fee, open_fullness);
            if next != self.base_fee {
                self.set_base_fee(next);
            }
        }
        self.proposer = None;
        crate::market::end_block(self, height)?;
        for address in self.owed.clone() {
            if self.account(&self.pool).balance.is_zero() {
                break;
            }
            let mut staged = Staged::new(self);
            let owed = staged.account(&address).owed;
            let paid = staged.pay_from_pool(address, owed, None)?;
            let mut worker = staged.account(&address);
            worker.owed = worker.owed.checked_sub(paid).ok_or(TxError::Overflow)?;
            staged.set_account(address, worker);
            let writes = staged.into_writes();
            self.write(writes);
        }
        let due: Vec<u64> = self.maturing.range(..=height).map(|(h, _)| *h).collect();
        for settle_height in due {
            let Some(addresses) = self.maturing.remove(&settle_height) else {
                continue;
            };
            for address in addresses {
                let mut account = self.account(&address);
                let (ripe, later): (Vec<_>, Vec<_>) = account
                    .pending
                    .into_iter()
                    .partition(|p| p.settle_height <= height);
                account.pending = later;
                let (released, held): (Vec<_>, Vec<_>) = account
                    .unbonding
                    .into_iter()
                    .partition(|u| u.release_height <= height);
                account.unbonding = held;
                let matured = ripe.iter().map(|r| r.amount);
                for amount in matured.chain(released.iter().map(|u| u.amount)) {
                    account.balance = account
                        .balance
                        .checked_add(amount)
                        .ok_or(TxError::Overflow)?;
                }
                self.set_account(address, account);
            }
        }
        Ok(())
    }

    /// Folds every changed entry into the tree and returns what changed.
    pub(crate) fn commit_dirty(&mut self) -> ChangeSet {
        let mut changes = ChangeSet::default();
        let mut entries = Vec::new();
        for address in std::mem::take(&mut self.dirty_accounts) {
            let account = self.account(&address);
            entries.push((account_key(&address), Hash::of_borsh(b"account", &account)));
            changes.accounts.push((address, account));
        }
        for key in std::mem::take(&mut self.dirty_receipts) {
            if let Some(mark) = self.receipts.get(&key) {
                entries.push((receipt_key(&key), Hash::of_borsh(b"receipt", mark)));
                changes.receipts.push((key, mark.clone()));
            }
        }
        for id in std::mem::take(&mut self.dirty_offers) {
            if let Some(offer) = self.market.offer(id) {
                entries.push((market_key(b"offer", id), Hash::of_borsh(b"offer", offer)));
                changes.offers.push(offer.clone());
            }
        }
        for id in std::mem::take(&mut self.dirty_orders) {
            if let Some(order) = self.market.order(id) {
                entries.push((market_key(b"order", id), Hash::of_borsh(b"order", order)));
                changes.orders.push(order.clone());
            }
        }
        for id in std::mem::take(&mut self.dirty_placements) {
            if let Some(placement) = self.market.placement(id) {
                let value = Hash::of_borsh(b"placement", placement);
                entries.push((market_key(b"placement", id), value));
                changes.placements.push(placement.clone());
            }
        }
        if std::mem::take(&mut self.dirty_base_fee) {
            entries.push((base_fee_key(), Hash::of_borsh(b"base-fee", &self.base_fee)));
            changes.base_fee = Some(self.base_fee);
        }
        self.tree.update(entries);
        changes
    }

    pub(crate) fn set_head(&mut self, height: u64, block_hash: Hash, timestamp_ms: u64) {
        self.height = height;
        self.block_hash = block_hash;
        self.timestamp_ms = timestamp_ms;
    }
}

/// What one transaction changes, computed in full before anything is written.
#[derive(Default)]
pub(crate) struct Writes {
    accounts: Vec<(Address, Account)>,
    receipt: Option<(MeterKey, ReceiptMark)>,
    offers: Vec<Offer>,
    orders: Vec<Order>,
    placements: Vec<Placement>,
}

/// Reads through to a state and collects writes, so a transaction's effects are computed
/// (and every overflow found) before the state is touched: a failing transaction needs no
/// rollback. Later writes to the same account replace earlier ones.
pub(crate) struct Staged<'a> {
    state: &'a State,
    writes: Writes,
}

impl<'a> Staged<'a> {
    pub(crate) fn new(state: &'a State) -> Self {
        Staged {
            state,
            writes: Writes::default(),
        }
    }

    pub(crate) fn account(&self, address: &Address) -> Account {
        match self
            .writes
            .accounts
            .iter()
            .rev()
            .find(|(a, _)| a == address)
        {
            Some((_, account)) => account.clone(),
            None => self.state.account(address),
        }
    }

    pub(crate) fn set_account(&mut self, address: Address, account: Account) {
        self.writes.accounts.push((address, account));
    }

    pub(crate) fn into_writes(self) -> Writes {
        self.writes
    }

    /// The state being read through, as it was before anything was staged.
    pub(crate) fn state(&self) -> &'a State {
        self.state
    }

    /// Raises a metering session's mark (a transaction sets at most one).
    pub(crate) fn set_receipt_mark(&mut self, key: MeterKey, mark: ReceiptMark) {
        self.writes.receipt = Some((key, mark));
    }

    pub(crate) fn offer(&self, id: u64) -> Option<Offer> {
        let staged = self.writes.offers.iter().rev().find(|o| o.id == id);
        staged.or_else(|| self.state.market.offer(id)).cloned()
    }

    pub(crate) fn order(&self, id: u64) -> Option<Order> {
        let staged = self.writes.orders.iter().rev().find(|o| o.id == id);
        staged.or_else(|| self.state.market.order(id)).cloned()
    }

    pub(crate) fn placement(&self, id: u64) -> Option<Placement> {
        let staged = self.writes.placements.iter().rev().find(|p| p.id == id);
        staged.or_else(|| self.state.market.placement(id)).cloned()
    }

    pub(crate) fn set_offer(&mut self, offer: Offer) {
        self.writes.offers.push(offer);
    }

    pub(crate) fn set_order(&mut self, order: Order) {
        self.writes.orders.push(order);
    }

    pub(crate) fn set_placement(&mut self, placement: Placement) {
        self.writes.placements.push(placement);
    }

    /// The id the next placement staged here gets.
    pub(crate) fn next_placement_id(&self) -> u64 {
        let staged = self.writes.placements.iter().map(|p| p.id + 1).max();
        staged
            .unwrap_or(0)
            .max(self.state.market.next_placement_id())
    }

    /// Takes `amount` from `address`'s spendable balance (checked by the caller's stage two).
    pub(crate) fn sub_balance(&mut self, address: Address, amount: Amount) -> Result<(), TxError> {
        let mut account = self.account(&address);
        account.balance = account
            .balance
            .checked_sub(amount)
            .ok_or(TxError::Overflow)?;
        self.set_account(address, account);
        Ok(())
    }

    /// Credits `amount` to `address`'s spendable balance.
    pub(crate) fn add_balance(&mut self, address: Address, amount: Amount) -> Result<(), TxError> {
        let mut account = self.account(&address);
        account.balance = account
            .balance
            .checked_add(amount)
            .ok_or(TxError::Overflow)?;
        self.set_account(address, account);
        Ok(())
    }

    /// Pays a transaction's fee, taken from its payer already: its price to the burn
    /// address, its tip to the block's proposer.
    pub(crate) fn pay_fee(&mut self, charge: crate::fees::Charge) -> Result<(), TxError> {
        if !charge.burned.is_zero() {
            self.add_balance(self.state.genesis.burn_address(), charge.burned)?;
        }
        if !charge.tip.is_zero() {
            self.add_balance(self.state.tip_receiver(), charge.tip)?;
        }
        Ok(())
    }

    /// The height `blocks` after the block being built (the one after the state's head).
    pub(crate) fn height_after(&self, blocks: u64) -> Result<u64, TxError> {
        self.state
            .height
            .checked_add(1)
            .and_then(|h| h.checked_add(blocks))
            .ok_or(TxError::Overflow)
    }

    /// Adds `amount` to `address`'s pending rewards of `session` (none: an owed claim),
    /// paid by `order` (zero: the pool).
    pub(crate) fn add_pending(
        &mut self,
        address: Address,
        amount: Amount,
        session: Option<SessionKey>,
        order: u64,
    ) -> Result<(), TxError> {
        if amount.is_zero() {
            return Ok(());
        }
        let settle_height = self.height_after(self.state.genesis.params.challenge_window)?;
        let mut account = self.account(&address);
        // Owed claims paid at a block boundary belong to no session any more: they are
        // kept under the pool's own key, which no evidence names.
        let session = session.unwrap_or(SessionKey {
            hub: self.state.pool,
            session_id: 0,
        });
        match account
            .pending
            .iter_mut()
            .rev()
            .take_while(|p| p.settle_height == settle_height)
            .find(|p| p.session == session && p.order == order)
        {
            Some(same) => {
                same.amount = same.amount.checked_add(amount).ok_or(TxError::Overflow)?;
            }
            None => account.pending.push(PendingReward {
                settle_height,
                amount,
                session,
                order,
            }),
        }
        self.set_account(address, account);
        Ok(())
    }

    /// Pays `delta` from the pool into pending rewards of `session` (none for an owed claim
    /// paid at a block boundary); returns what the pool could cover.
    pub(crate) fn pay_from_pool(
        &mut self,
        worker: Address,
        delta: Amount,
        session: Option<SessionKey>,
    ) -> Result<Amount, TxError> {
        let pool_address = self.state.pool;
        let mut pool = self.account(&pool_address);
        let paid = delta.min(pool.balance);
        pool.balance = pool.balance.checked_sub(paid).ok_or(TxError::Overflow)?;
        self.set_account(pool_address, pool);
        self.add_pending(worker, paid, session, 0)?;
        Ok(paid)
    }
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("chain_id", &self.chain_id)
            .field("height", &self.height)
            .field("block_hash", &self.block_hash)
            .field("root", &self.root())
            .field("accounts", &self.accounts.len())
            .finish()
    }
}
