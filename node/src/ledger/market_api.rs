//! The market's read endpoints: offers, orders and placements (filtered, paged by id) and a
//! model's coverage, from the state at the head. Writes are signed transactions (`POST /txs`).

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::routing::get;
use axum::{Json, Router};
use kvasir_api::ledger::{ErrorBody, PageQuery};
use kvasir_api::market::{
    CoverageQuery, CoverageView, ExpertCoverage, MarketQuery, OfferPage, OfferView, OrderPage,
    OrderView, PlacementPage, PlacementView,
};
use kvasir_ledger::market::{Market, Offer, Order, Placement};
use kvasir_ledger::{Address, Amount, Genesis};

use super::api::{bad_request, decimal, not_found, path_text, Reply, U64_DIGITS};
use super::Ledger;

/// Experts one coverage reply lists at most.
const COVERAGE_MAX: usize = 10_000;

pub(super) fn routes() -> Router<Arc<Ledger>> {
    Router::new()
        .route("/offers", get(offers))
        .route("/offers/{id}", get(offer))
        .route("/orders", get(orders))
        .route("/orders/{id}", get(order))
        .route("/placements", get(placements))
        .route("/placements/{id}", get(placement))
        .route("/coverage/{model}", get(coverage))
}

/// A market query, checked: addresses parsed, the page bounded.
struct Filter {
    query: MarketQuery,
    operator: Option<Address>,
    buyer: Option<Address>,
    after: u64,
    limit: usize,
}

impl Filter {
    fn new(
        query: Result<Query<MarketQuery>, QueryRejection>,
    ) -> Result<Filter, super::api::ApiError> {
        let Query(query) = query.map_err(bad_request)?;
        let address = |text: &Option<String>| {
            text.as_deref()
                .map(Address::from_str)
                .transpose()
                .map_err(bad_request)
        };
        let page = PageQuery {
            after: query.after,
            limit: query.limit,
        };
        Ok(Filter {
            operator: address(&query.operator)?,
            buyer: address(&query.buyer)?,
            after: query.after.unwrap_or(0),
            limit: page.limit(),
            query,
        })
    }

    /// Whether `model` (a pin's id, as the market keeps it on a format-2 chain) is the one
    /// asked for, by id or by the short name the genesis pins it under.
    fn model(&self, genesis: &Genesis, model: &str) -> bool {
        self.query.model.as_deref().is_none_or(|asked| {
            asked == model || genesis.pinned(asked).is_some_and(|pin| pin.id == model)
        })
    }

    fn state(&self, name: &str) -> bool {
        self.query.state.as_deref().is_none_or(|s| s == name)
    }

    /// One page of `items` (in id order, starting past `after`) that pass `keep`, and the
    /// next `after`.
    fn page<'a, T: 'a, V>(
        &self,
        items: impl Iterator<Item = &'a T>,
        id: impl Fn(&T) -> u64,
        keep: impl Fn(&T) -> bool,
        view: impl Fn(&T) -> V,
    ) -> (Vec<V>, Option<u64>) {
        let mut chosen: Vec<&T> = items
            .filter(|item| keep(item))
            .take(self.limit + 1)
            .collect();
        let next_after = (chosen.len() > self.limit).then(|| {
            chosen.truncate(self.limit);
            chosen.last().map_or(self.after, |item| id(item))
        });
        (chosen.into_iter().map(view).collect(), next_after)
    }
}

fn id_of(text: &str) -> Result<u64, super::api::ApiError> {
    decimal(text, U64_DIGITS).ok_or_else(|| bad_request(format!("{text:?} is not an id")))
}

fn offer_view(market: &Market, offer: &Offer) -> OfferView {
    OfferView::new(
        offer,
        market.live_placements_of_offer(offer.id).count() as u64,
    )
}

/// One block's expected pay of an order's live placements, and how many there are.
fn order_view(market: &Market, order: &Order) -> OrderView {
    let mut reserve = Amount::ZERO;
    let mut count = 0;
    for placement in market.live_placements_of_order(order.id) {
        reserve = reserve.checked_add(placement.price).unwrap_or(Amount::MAX);
        count += 1;
    }
    OrderView::new(order, reserve, count)
}

#[utoipa::path(get, path = "/offers", description = "Offers of expert capacity in id order, filtered by model, operator and state (`open`, `withdrawn`, `expired`); `next_after` continues.", params(MarketQuery), responses((status = 200, body = OfferPage), (status = 400, body = ErrorBody)))]
pub(super) async fn offers(
    State(ledger): State<Arc<Ledger>>,
    query: Result<Query<MarketQuery>, QueryRejection>,
) -> Reply<OfferPage> {
    let filter = Filter::new(query)?;
    let state = ledger.state();
    let market = state.market();
    let (offers, next_after) = filter.page(
        market.offers_after(filter.after),
        |o: &Offer| o.id,
        |o| {
            filter.model(state.genesis(), &o.model)
                && filter.operator.is_none_or(|a| a == o.operator)
                && filter.state(OfferView::state_name(o))
        },
        |o| offer_view(market, o),
    );
    Ok(Json(OfferPage { offers, next_after }))
}

#[utoipa::path(get, path = "/offers/{id}", description = "One offer.", params(("id" = u64, Path, maximum = 18446744073709551615u64, description = "Offer id")), responses((status = 200, body = OfferView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn offer(
    State(ledger): State<Arc<Ledger>>,
    id: Result<Path<String>, PathRejection>,
) -> Reply<OfferView> {
    let id = id_of(&path_text(id)?)?;
    let state = ledger.state();
    let market = state.market();
    let offer = market
        .offer(id)
        .ok_or_else(|| not_found(format!("no offer {id}")))?;
    Ok(Json(offer_view(market, offer)))
}

#[utoipa::path(get, path = "/orders", description = "Orders for expert capacity in id order, filtered by model, buyer and state (`open`, `active`, `degraded`, `paused`, `closed`); `next_after` continues.", params(MarketQuery), responses((status = 200, body = OrderPage), (status = 400, body = ErrorBody)))]
pub(super) async fn orders(
    State(ledger): State<Arc<Ledger>>,
    query: Result<Query<MarketQuery>, QueryRejection>,
) -> Reply<OrderPage> {
    let filter = Filter::new(query)?;
    let state = ledger.state();
    let market = state.market();
    let (orders, next_after) = filter.page(
        market.orders_after(filter.after),
        |o: &Order| o.id,
        |o| {
            filter.model(state.genesis(), &o.model)
                && filter.buyer.is_none_or(|a| a == o.buyer)
                && filter.state(o.state.name())
        },
        |o| order_view(market, o),
    );
    Ok(Json(OrderPage { orders, next_after }))
}

#[utoipa::path(get, path = "/orders/{id}", description = "One order: its escrow, what it paid and refunded, its state and why it closed.", params(("id" = u64, Path, maximum = 18446744073709551615u64, description = "Order id")), responses((status = 200, body = OrderView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn order(
    State(ledger): State<Arc<Ledger>>,
    id: Result<Path<String>, PathRejection>,
) -> Reply<OrderView> {
    let id = id_of(&path_text(id)?)?;
    let state = ledger.state();
    let market = state.market();
    let order = market
        .order(id)
        .ok_or_else(|| not_found(format!("no order {id}")))?;
    Ok(Json(order_view(market, order)))
}

#[utoipa::path(get, path = "/placements", description = "Placements (leases of an offer to an order) in id order, filtered by model, operator, order, offer and state (`live`, `closed`); `next_after` continues.", params(MarketQuery), responses((status = 200, body = PlacementPage), (status = 400, body = ErrorBody)))]
pub(super) async fn placements(
    State(ledger): State<Arc<Ledger>>,
    query: Result<Query<MarketQuery>, QueryRejection>,
) -> Reply<PlacementPage> {
    let filter = Filter::new(query)?;
    let state = ledger.state();
    let market = state.market();
    // An order's own placements are indexed: what a backbone following its order reads.
    let items: Box<dyn Iterator<Item = &Placement>> = match filter.query.order {
        Some(order) => Box::new(
            market
                .placements_of_order(order)
                .filter(|p| p.id > filter.after),
        ),
        None => Box::new(market.placements_after(filter.after)),
    };
    let (placements, next_after) = filter.page(
        items,
        |p: &Placement| p.id,
        |p| {
            filter.model(state.genesis(), &p.model)
                && filter.operator.is_none_or(|a| a == p.operator)
                && filter.query.order.is_none_or(|o| o == p.order)
                && filter.query.offer.is_none_or(|o| o == p.offer)
                && filter.state(if p.is_live() { "live" } else { "closed" })
        },
        PlacementView::new,
    );
    Ok(Json(PlacementPage {
        placements,
        next_after,
    }))
}

#[utoipa::path(get, path = "/placements/{id}", description = "One placement.", params(("id" = u64, Path, maximum = 18446744073709551615u64, description = "Placement id")), responses((status = 200, body = PlacementView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn placement(
    State(ledger): State<Arc<Ledger>>,
    id: Result<Path<String>, PathRejection>,
) -> Reply<PlacementView> {
    let id = id_of(&path_text(id)?)?;
    let state = ledger.state();
    let placement = state
        .market()
        .placement(id)
        .ok_or_else(|| not_found(format!("no placement {id}")))?;
    Ok(Json(PlacementView::new(placement)))
}

#[utoipa::path(get, path = "/coverage/{model}", description = "How a model is served: for each expert that a live order wants or a live placement serves (optionally of one layer), the live placements, the replicas wanted and the price range, in (layer, expert) order, at most 10,000.", params(("model" = String, Path, description = "Model id"), CoverageQuery), responses((status = 200, body = CoverageView), (status = 400, body = ErrorBody)))]
pub(super) async fn coverage(
    State(ledger): State<Arc<Ledger>>,
    model: Result<Path<String>, PathRejection>,
    query: Result<Query<CoverageQuery>, QueryRejection>,
) -> Reply<CoverageView> {
    let model = path_text(model)?;
    let Query(query) = query.map_err(bad_request)?;
    let state = ledger.state();
    // A short name stands for its pin's id, which the market keeps.
    let model = state
        .genesis()
        .pinned(&model)
        .map_or(model.clone(), |pin| pin.id.clone());
    // Off the runtime the consensus engine shares: a large market takes a while to walk.
    let view = tokio::task::spawn_blocking(move || coverage_of(state.market(), model, query.layer))
        .await
        .map_err(|e| super::api::internal(e.to_string()))?;
    Ok(Json(view))
}

/// Every expert of `model` (of `layer`, if given) that a live order wants or a live
/// placement serves; the walk stops once the reply is full.
fn coverage_of(market: &Market, model: String, layer: Option<u16>) -> CoverageView {
    let in_layer = |key: &(u16, u16)| layer.is_none_or(|l| l == key.0);
    let mut experts = BTreeMap::new();
    let mut truncated = false;
    'orders: for order in market.live_orders().filter(|o| o.model == model) {
        for key in order.experts.expand().into_iter().filter(in_layer) {
            let Some(slot) = coverage_slot(&mut experts, key, &mut truncated) else {
                break 'orders;
            };
            slot.replicas_wanted += u32::from(order.replicas);
        }
        for placement in market.live_placements_of_order(order.id) {
            for key in placement.experts.expand().into_iter().filter(in_layer) {
                let Some(slot) = coverage_slot(&mut experts, key, &mut truncated) else {
                    break 'orders;
                };
                slot.placements += 1;
                let price = placement.price;
                slot.min_price = Some(
                    slot.min_price
                        .map_or(price, |p| p.base_units.min(price))
                        .into(),
                );
                slot.max_price = Some(
                    slot.max_price
                        .map_or(price, |p| p.base_units.max(price))
                        .into(),
                );
            }
        }
    }
    CoverageView {
        model,
        experts: experts.into_values().collect(),
        truncated,
    }
}

/// The coverage entry of `key`, made if there is room for it (`truncated` is set if not).
fn coverage_slot<'a>(
    experts: &'a mut BTreeMap<(u16, u16), ExpertCoverage>,
    key: (u16, u16),
    truncated: &mut bool,
) -> Option<&'a mut ExpertCoverage> {
    if !experts.contains_key(&key) && experts.len() >= COVERAGE_MAX {
        *truncated = true;
        return None;
    }
    Some(experts.entry(key).or_insert(ExpertCoverage {
        layer: key.0,
        expert: key.1,
        placements: 0,
        replicas_wanted: 0,
        min_price: None,
        max_price: None,
    }))
}
