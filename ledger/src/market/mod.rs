//! The market: operators' offers of expert capacity, buyers' orders with escrow, and the
//! placements (leases) that matching makes between them at every block boundary. All three
//! live in the ledger state and change only through signed transactions and the pure
//! block-boundary step (`matching`), so every node computes the same market.
//!
//! Money: an order's escrow is counted in the supply. A credit for a placed session moves
//! pay from the escrow into the worker's pending rewards (tagged with the order); if
//! evidence cancels that pay it returns to the escrow (or, the order being closed, to the
//! buyer). Closing an order refunds what is left in the escrow once, `CLOSE_GRACE_BLOCKS`
//! later, so that credits for work done before the close are still paid.

mod lifecycle;
mod matching;

use borsh::{BorshDeserialize, BorshSerialize};
use imbl::{OrdMap, OrdSet};
use serde::Serialize;

use crate::amount::Amount;
use crate::keys::Address;

pub(crate) use lifecycle::{close_order, end_offer, return_pay};
pub use matching::{end_block, MATCH_WORK_PER_BLOCK, MATCH_WORK_PER_ORDER};
// The grammar is shared with the command line's `*` patterns (`kvasir-primitives`).
pub use kvasir_primitives::selection::{self, ExpertKey, Rect, Selection, SelectionError};

/// Open offers one operator may hold at once.
pub const MAX_OPEN_OFFERS_PER_OPERATOR: usize = 64;
/// Live orders one buyer may hold at once.
pub const MAX_LIVE_ORDERS_PER_BUYER: usize = 64;
/// Replicas an order may ask of each expert.
pub const MAX_REPLICAS: u8 = 8;
/// Longest model id.
pub const MAX_MODEL_ID_LEN: usize = 64;
/// Blocks an order may stay paused (escrow below one block's expected pay) before it closes
/// for insufficient funds.
pub const PAUSED_BLOCKS_BEFORE_CLOSE: u64 = 1_000;
/// Blocks an order may hold no placement at all before it closes as unfillable.
pub const UNPLACED_BLOCKS_BEFORE_CLOSE: u64 = 1_000;
/// Blocks a closed order keeps its escrow before refunding it: the gateway's credits for
/// traffic served before the close land within them and are paid, so closing cannot be
/// used to skip paying for work already done.
pub const CLOSE_GRACE_BLOCKS: u64 = 60;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
#[serde(rename_all = "snake_case")]
pub enum OfferState {
    Open,
    Withdrawn,
    Expired,
}

/// An operator's capacity: these experts of this model, at this price per reward unit
/// (base units per `unit_bytes` of metered traffic), until `expiry_height`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Offer {
    pub id: u64,
    pub operator: Address,
    pub model: String,
    pub experts: Selection,
    pub price: Amount,
    /// The offer expires at the end of this block.
    pub expiry_height: u64,
    pub created_height: u64,
    pub state: OfferState,
    /// The height it was withdrawn or expired at; zero while open.
    pub ended_height: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloseReason {
    /// The buyer closed it.
    Buyer,
    /// It reached its end height.
    Expired,
    /// It stayed paused for `PAUSED_BLOCKS_BEFORE_CLOSE` blocks.
    InsufficientFunds,
    /// It held no placement for `UNPLACED_BLOCKS_BEFORE_CLOSE` blocks.
    Unfillable,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum OrderState {
    /// Not placed anywhere yet.
    Open,
    /// Every wanted expert has its replicas.
    Active,
    /// Placed, but some wanted experts have fewer replicas than asked.
    Degraded,
    /// Placed, but the escrow is below one block's expected pay; resumes on deposit.
    Paused,
    Closed(CloseReason),
}

impl OrderState {
    pub fn is_closed(self) -> bool {
        matches!(self, OrderState::Closed(_))
    }

    /// The name used in filters and text.
    pub fn name(self) -> &'static str {
        match self {
            OrderState::Open => "open",
            OrderState::Active => "active",
            OrderState::Degraded => "degraded",
            OrderState::Paused => "paused",
            OrderState::Closed(_) => "closed",
        }
    }
}

/// A buyer's demand: `replicas` placements of every expert of `experts` of `model`, at most
/// `max_price` per reward unit, paid from `escrow`, until `end_height`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Order {
    pub id: u64,
    pub buyer: Address,
    /// A key that may run the backbone for this order besides the buyer's own.
    pub delegate: Option<Address>,
    pub model: String,
    pub experts: Selection,
    pub replicas: u8,
    pub max_price: Amount,
    /// What is left to pay workers with.
    pub escrow: Amount,
    /// Paid out of the escrow so far (net of pay that evidence returned).
    pub paid: Amount,
    /// Refunded to the buyer after the order closed.
    pub refunded: Amount,
    /// Closed, it refunds what is left of its escrow at the end of this block (zero: not
    /// closed, or refunded already).
    pub refund_height: u64,
    /// The order closes at the end of this block.
    pub end_height: u64,
    pub created_height: u64,
    pub state: OrderState,
    /// The height the current state began.
    pub since_height: u64,
    /// Matching must look at this order again at the next block boundary (new order, a
    /// deposit, a placement lost).
    pub rematch: bool,
    /// The newest offer id matching had seen when it last looked at this order: an order
    /// short of replicas is looked at again once a newer offer of its model exists.
    pub matched_through: u64,
}

impl Order {
    /// Whether `key` may act for this order (sign a backbone's hello for it).
    pub fn may_act(&self, key: &Address) -> bool {
        self.buyer == *key || self.delegate == Some(*key)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum PlacementState {
    Live,
    /// Its order closed (with that order's reason).
    OrderClosed(CloseReason),
    OfferWithdrawn,
    OfferExpired,
    /// Its operator was jailed or fell below the chain's `min_bond`.
    OperatorIneligible,
}

/// A lease: `experts` of an order served by an offer's operator at the offer's price.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Placement {
    pub id: u64,
    pub order: u64,
    pub offer: u64,
    pub operator: Address,
    pub model: String,
    pub experts: Selection,
    pub price: Amount,
    pub start_height: u64,
    /// The height it closed at; zero while live.
    pub end_height: u64,
    pub state: PlacementState,
}

impl Placement {
    pub fn is_live(&self) -> bool {
        self.state == PlacementState::Live
    }
}

/// The market's objects and the indexes derived from them. Objects are never removed (they
/// are the market's history); the indexes hold only what is live and are rebuilt on load.
#[derive(Clone, Default)]
pub struct Market {
    offers: OrdMap<u64, Offer>,
    orders: OrdMap<u64, Order>,
    placements: OrdMap<u64, Placement>,
    /// Open offers per model, cheapest first, ties by id.
    open_offers: OrdMap<String, OrdSet<(Amount, u64)>>,
    /// Open offer ids per model, to find the newest.
    open_offer_ids: OrdMap<String, OrdSet<u64>>,
    /// Open offers per expiry height.
    offer_expiry: OrdMap<u64, OrdSet<u64>>,
    open_offers_of: OrdMap<Address, OrdSet<u64>>,
    live_orders: OrdSet<u64>,
    live_orders_of: OrdMap<Address, OrdSet<u64>>,
    /// Closed orders per refund height, while their escrow waits out the grace.
    refunds_due: OrdMap<u64, OrdSet<u64>>,
    /// Every placement an order had, live or not; and the live ones per order and per offer.
    all_order_placements: OrdMap<u64, OrdSet<u64>>,
    order_placements: OrdMap<u64, OrdSet<u64>>,
    offer_placements: OrdMap<u64, OrdSet<u64>>,
}

fn index_remove<K: Ord + Clone, V: Ord + Clone>(
    map: &mut OrdMap<K, OrdSet<V>>,
    key: &K,
    value: &V,
) {
    if let Some(set) = map.get_mut(key) {
        set.remove(value);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

fn index_insert<K: Ord + Clone, V: Ord + Clone>(map: &mut OrdMap<K, OrdSet<V>>, key: K, value: V) {
    map.entry(key).or_default().insert(value);
}

impl Market {
    pub fn offer(&self, id: u64) -> Option<&Offer> {
        self.offers.get(&id)
    }

    pub fn order(&self, id: u64) -> Option<&Order> {
        self.orders.get(&id)
    }

    pub fn placement(&self, id: u64) -> Option<&Placement> {
        self.placements.get(&id)
    }

    pub fn offers(&self) -> impl DoubleEndedIterator<Item = &Offer> {
        self.offers.values()
    }

    pub fn orders(&self) -> impl DoubleEndedIterator<Item = &Order> {
        self.orders.values()
    }

    pub fn placements(&self) -> impl DoubleEndedIterator<Item = &Placement> {
        self.placements.values()
    }

    /// Offers, orders and placements with ids above `after`, in id order: a page's start
    /// found in log time, however long the history.
    pub fn offers_after(&self, after: u64) -> impl Iterator<Item = &Offer> {
        self.offers.range(after.saturating_add(1)..).map(|(_, o)| o)
    }

    pub fn orders_after(&self, after: u64) -> impl Iterator<Item = &Order> {
        self.orders.range(after.saturating_add(1)..).map(|(_, o)| o)
    }

    pub fn placements_after(&self, after: u64) -> impl Iterator<Item = &Placement> {
        self.placements
            .range(after.saturating_add(1)..)
            .map(|(_, p)| p)
    }

    /// The id the next offer, order or placement gets: one past the newest.
    pub fn next_offer_id(&self) -> u64 {
        self.offers.keys().next_back().map_or(1, |id| id + 1)
    }

    pub fn next_order_id(&self) -> u64 {
        self.orders.keys().next_back().map_or(1, |id| id + 1)
    }

    pub fn next_placement_id(&self) -> u64 {
        self.placements.keys().next_back().map_or(1, |id| id + 1)
    }

    pub fn open_offer_count(&self, operator: &Address) -> usize {
        self.open_offers_of.get(operator).map_or(0, OrdSet::len)
    }

    pub fn live_order_count(&self, buyer: &Address) -> usize {
        self.live_orders_of.get(buyer).map_or(0, OrdSet::len)
    }

    /// Open offers of `model`, cheapest first, ties by id.
    pub fn open_offers_of_model(&self, model: &str) -> impl Iterator<Item = &Offer> {
        self.open_offers
            .get(model)
            .into_iter()
            .flat_map(|set| set.iter())
            .filter_map(|(_, id)| self.offers.get(id))
    }

    /// The newest open offer id of `model` (zero when none).
    pub(crate) fn newest_open_offer(&self, model: &str) -> u64 {
        self.open_offer_ids
            .get(model)
            .and_then(|set| set.get_max().copied())
            .unwrap_or(0)
    }

    /// Live placements of an order, oldest first.
    pub fn live_placements_of_order(&self, order: u64) -> impl Iterator<Item = &Placement> {
        self.order_placements
            .get(&order)
            .into_iter()
            .flat_map(|set| set.iter())
            .filter_map(|id| self.placements.get(id))
    }

    /// Every placement an order had, oldest first.
    pub fn placements_of_order(&self, order: u64) -> impl Iterator<Item = &Placement> {
        self.all_order_placements
            .get(&order)
            .into_iter()
            .flat_map(|set| set.iter())
            .filter_map(|id| self.placements.get(id))
    }

    pub(crate) fn refunds_due_by(&self, height: u64) -> Vec<u64> {
        self.refunds_due
            .range(..=height)
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect()
    }

    pub fn live_placements_of_offer(&self, offer: u64) -> impl Iterator<Item = &Placement> {
        self.offer_placements
            .get(&offer)
            .into_iter()
            .flat_map(|set| set.iter())
            .filter_map(|id| self.placements.get(id))
    }

    /// Orders not closed, in id order.
    pub fn live_orders(&self) -> impl Iterator<Item = &Order> {
        self.live_orders.iter().filter_map(|id| self.orders.get(id))
    }

    pub(crate) fn offers_expiring_by(&self, height: u64) -> Vec<u64> {
        self.offer_expiry
            .range(..=height)
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect()
    }

    /// Escrow held by every order: money, counted in the supply.
    pub fn total_escrow(&self) -> u128 {
        self.orders
            .values()
            .map(|o| u128::from(o.escrow.base_units()))
            .sum()
    }

    pub(crate) fn set_offer(&mut self, offer: Offer) {
        if let Some(old) = self.offers.get(&offer.id) {
            if old.state == OfferState::Open {
                let old = old.clone();
                index_remove(&mut self.open_offers, &old.model, &(old.price, old.id));
                index_remove(&mut self.open_offer_ids, &old.model, &old.id);
                index_remove(&mut self.offer_expiry, &old.expiry_height, &old.id);
                index_remove(&mut self.open_offers_of, &old.operator, &old.id);
            }
        }
        if offer.state == OfferState::Open {
            index_insert(
                &mut self.open_offers,
                offer.model.clone(),
                (offer.price, offer.id),
            );
            index_insert(&mut self.open_offer_ids, offer.model.clone(), offer.id);
            index_insert(&mut self.offer_expiry, offer.expiry_height, offer.id);
            index_insert(&mut self.open_offers_of, offer.operator, offer.id);
        }
        self.offers.insert(offer.id, offer);
    }

    pub(crate) fn set_order(&mut self, order: Order) {
        if let Some(old) = self.orders.get(&order.id) {
            let old_due = old.refund_height;
            index_remove(&mut self.refunds_due, &old_due, &order.id);
        }
        if order.refund_height != 0 {
            index_insert(&mut self.refunds_due, order.refund_height, order.id);
        }
        if order.state.is_closed() {
            self.live_orders.remove(&order.id);
            index_remove(&mut self.live_orders_of, &order.buyer, &order.id);
        } else {
            self.live_orders.insert(order.id);
            index_insert(&mut self.live_orders_of, order.buyer, order.id);
        }
        self.orders.insert(order.id, order);
    }

    pub(crate) fn set_placement(&mut self, placement: Placement) {
        index_insert(
            &mut self.all_order_placements,
            placement.order,
            placement.id,
        );
        if placement.is_live() {
            index_insert(&mut self.order_placements, placement.order, placement.id);
            index_insert(&mut self.offer_placements, placement.offer, placement.id);
        } else {
            index_remove(&mut self.order_placements, &placement.order, &placement.id);
            index_remove(&mut self.offer_placements, &placement.offer, &placement.id);
        }
        self.placements.insert(placement.id, placement);
    }
}

#[cfg(test)]
mod tests;
