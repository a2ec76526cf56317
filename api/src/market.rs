//! The bodies of the market's REST API: offers, orders, placements and a model's coverage,
//! as the ledger node (and the gateway in front of it) serves them. Writes are ordinary
//! signed transactions (`POST /txs`).

use kvasir_ledger::market::{
    CloseReason, Offer, OfferState, Order, OrderState, Placement, PlacementState,
};
use kvasir_ledger::{Address, Amount};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::ledger::AmountView;
use crate::schema::AddressText;

/// `GET /offers/{id}`; an entry of `GET /offers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OfferView {
    pub id: u64,
    #[schema(value_type = AddressText)]
    pub operator: Address,
    pub model: String,
    /// `LAYERS:EXPERTS` items (`0-3:0-7,5:9`).
    pub experts: String,
    /// Per reward unit (`unit_bytes` of metered traffic).
    pub price: AmountView,
    pub expiry_height: u64,
    pub created_height: u64,
    /// `open`, `withdrawn` or `expired`.
    pub state: String,
    /// When it was withdrawn or expired; absent while open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_height: Option<u64>,
    /// Live placements on it.
    pub placements: u64,
}

/// `GET /orders/{id}`; an entry of `GET /orders`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OrderView {
    pub id: u64,
    #[schema(value_type = AddressText)]
    pub buyer: Address,
    /// A key that may run the backbone for it besides the buyer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<AddressText>)]
    pub delegate: Option<Address>,
    pub model: String,
    pub experts: String,
    pub replicas: u8,
    pub max_price: AmountView,
    /// What is left to pay workers with.
    pub escrow: AmountView,
    /// Paid out to workers so far.
    pub paid: AmountView,
    /// Returned to the buyer, `CLOSE_GRACE_BLOCKS` (60) after it closed.
    pub refunded: AmountView,
    /// Closed, the height at whose end the escrow left is refunded; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refund_height: Option<u64>,
    /// One block's expected pay of its live placements (each one reward unit at its price):
    /// the escrow must hold this much or the order pauses.
    pub reserve: AmountView,
    pub end_height: u64,
    pub created_height: u64,
    /// `open`, `active`, `degraded`, `paused` or `closed`.
    pub state: String,
    /// Why it closed: `buyer`, `expired`, `insufficient_funds` or `unfillable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<String>,
    /// The height its state began.
    pub since_height: u64,
    /// Live placements under it.
    pub placements: u64,
}

/// `GET /placements/{id}`; an entry of `GET /placements`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PlacementView {
    pub id: u64,
    pub order: u64,
    pub offer: u64,
    #[schema(value_type = AddressText)]
    pub operator: Address,
    pub model: String,
    pub experts: String,
    pub price: AmountView,
    pub start_height: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_height: Option<u64>,
    /// `live` or `closed`.
    pub state: String,
    /// Why it closed: `order_closed`, `offer_withdrawn`, `offer_expired` or
    /// `operator_ineligible` (jailed or unbonded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<String>,
}

/// Filters of the market lists; every one given must hold. Pages go by id.
#[derive(Clone, Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MarketQuery {
    /// Only this model's.
    pub model: Option<String>,
    /// Only this operator's (offers, placements).
    #[param(value_type = Option<AddressText>)]
    pub operator: Option<String>,
    /// Only this buyer's (orders).
    #[param(value_type = Option<AddressText>)]
    pub buyer: Option<String>,
    /// Only under this order (placements).
    #[param(maximum = 18446744073709551615u64)]
    pub order: Option<u64>,
    /// Only on this offer (placements).
    #[param(maximum = 18446744073709551615u64)]
    pub offer: Option<u64>,
    /// Only in this state (`open`, `withdrawn`, `expired`; `open`, `active`, `degraded`,
    /// `paused`, `closed`; `live`, `closed`).
    pub state: Option<String>,
    /// Only ids above this (the previous page's `next_after`).
    #[param(maximum = 18446744073709551615u64)]
    pub after: Option<u64>,
    /// At most this many (default 1,000; more is read as 10,000).
    #[param(maximum = 18446744073709551615u64)]
    pub limit: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OfferPage {
    pub offers: Vec<OfferView>,
    /// `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OrderPage {
    pub orders: Vec<OrderView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PlacementPage {
    pub placements: Vec<PlacementView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

/// `GET /coverage/{model}`: for each expert that a live order wants or a live placement
/// serves, in (layer, expert) order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CoverageView {
    pub model: String,
    pub experts: Vec<ExpertCoverage>,
    /// The list stopped at its limit (10,000 experts); narrow it with `layer`.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ExpertCoverage {
    pub layer: u16,
    pub expert: u16,
    /// Live placements serving it, over every order.
    pub placements: u32,
    /// Replicas live orders want of it, summed.
    pub replicas_wanted: u32,
    /// The cheapest and dearest price it is served at; absent when unplaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_price: Option<AmountView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_price: Option<AmountView>,
}

#[derive(Clone, Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CoverageQuery {
    /// Only this layer.
    #[param(maximum = 65535)]
    pub layer: Option<u16>,
}

impl MarketQuery {
    /// This query as a URL query string (`?model=m&after=3`), or empty.
    pub fn to_query(&self) -> String {
        let text = |name: &str, value: &Option<String>| {
            value.as_ref().map(|v| format!("{name}={}", percent(v)))
        };
        let number = |name: &str, value: Option<u64>| value.map(|v| format!("{name}={v}"));
        let parts: Vec<String> = [
            text("model", &self.model),
            text("operator", &self.operator),
            text("buyer", &self.buyer),
            number("order", self.order),
            number("offer", self.offer),
            text("state", &self.state),
            number("after", self.after),
            number("limit", self.limit),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!("?{}", parts.join("&"))
        }
    }
}

/// `text` as one URL component: unreserved characters as they are, every other byte `%XX`.
pub fn percent(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn offer_state(state: OfferState) -> &'static str {
    match state {
        OfferState::Open => "open",
        OfferState::Withdrawn => "withdrawn",
        OfferState::Expired => "expired",
    }
}

fn close_reason(reason: CloseReason) -> &'static str {
    match reason {
        CloseReason::Buyer => "buyer",
        CloseReason::Expired => "expired",
        CloseReason::InsufficientFunds => "insufficient_funds",
        CloseReason::Unfillable => "unfillable",
    }
}

impl OfferView {
    pub fn new(offer: &Offer, placements: u64) -> OfferView {
        OfferView {
            id: offer.id,
            operator: offer.operator,
            model: offer.model.clone(),
            experts: offer.experts.to_string(),
            price: offer.price.into(),
            expiry_height: offer.expiry_height,
            created_height: offer.created_height,
            state: offer_state(offer.state).into(),
            ended_height: (offer.state != OfferState::Open).then_some(offer.ended_height),
            placements,
        }
    }

    /// The name of an offer's state, as filters take it.
    pub fn state_name(offer: &Offer) -> &'static str {
        offer_state(offer.state)
    }
}

impl OrderView {
    pub fn new(order: &Order, reserve: Amount, placements: u64) -> OrderView {
        let close_reason = match order.state {
            OrderState::Closed(reason) => Some(close_reason(reason).to_string()),
            _ => None,
        };
        OrderView {
            id: order.id,
            buyer: order.buyer,
            delegate: order.delegate,
            model: order.model.clone(),
            experts: order.experts.to_string(),
            replicas: order.replicas,
            max_price: order.max_price.into(),
            escrow: order.escrow.into(),
            paid: order.paid.into(),
            refunded: order.refunded.into(),
            refund_height: (order.refund_height != 0).then_some(order.refund_height),
            reserve: reserve.into(),
            end_height: order.end_height,
            created_height: order.created_height,
            state: order.state.name().into(),
            close_reason,
            since_height: order.since_height,
            placements,
        }
    }
}

impl PlacementView {
    pub fn new(placement: &Placement) -> PlacementView {
        let close_reason = match placement.state {
            PlacementState::Live => None,
            PlacementState::OrderClosed(_) => Some("order_closed"),
            PlacementState::OfferWithdrawn => Some("offer_withdrawn"),
            PlacementState::OfferExpired => Some("offer_expired"),
            PlacementState::OperatorIneligible => Some("operator_ineligible"),
        };
        PlacementView {
            id: placement.id,
            order: placement.order,
            offer: placement.offer,
            operator: placement.operator,
            model: placement.model.clone(),
            experts: placement.experts.to_string(),
            price: placement.price.into(),
            start_height: placement.start_height,
            end_height: (!placement.is_live()).then_some(placement.end_height),
            state: if placement.is_live() {
                "live"
            } else {
                "closed"
            }
            .into(),
            close_reason: close_reason.map(String::from),
        }
    }
}
