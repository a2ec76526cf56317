//! The market's block-boundary step, pure and deterministic like the rest of `apply_block`:
//! offers past their expiry end, orders past their end height close, orders that need it
//! are matched, and every live order's state follows its placements and escrow.
//!
//! Matching one order: its wanted experts each need `replicas` placements from distinct
//! operators. Open offers of its model are taken cheapest first (ties by id) up to its max
//! price, each for the wanted experts it covers that still lack replicas from other
//! operators, while the escrow covers one block's expected pay of every placement (the
//! reserve: each placement's price for one reward unit). Placements already made stay: a
//! cheaper offer appearing later does not displace a running lease.
//!
//! An order is matched when it is new, got money, or lost a placement (`Order::rematch`),
//! and when it is short of replicas and a newer offer of its model exists. The work of one
//! boundary is bounded (`MATCH_WORK_PER_BLOCK` expert-by-rectangle tests): an order not
//! reached keeps its flag and is matched at the next boundary, in id order.

use std::collections::{BTreeMap, BTreeSet};

use crate::amount::Amount;
use crate::keys::Address;
use crate::state::{Staged, State};
use crate::tx::TxError;

use super::lifecycle::{close_order, end_offer};
use super::{
    CloseReason, OfferState, Order, OrderState, Placement, PlacementState, Selection,
    PAUSED_BLOCKS_BEFORE_CLOSE, UNPLACED_BLOCKS_BEFORE_CLOSE,
};

/// Expert-by-rectangle containment tests one block boundary may spend on matching.
pub const MATCH_WORK_PER_BLOCK: u64 = 4_000_000;

/// The market's part of the block boundary at `height`.
pub fn end_block(state: &mut State, height: u64) -> Result<(), TxError> {
    for id in state.market().offers_expiring_by(height) {
        run(state, |staged| {
            end_offer(staged, id, OfferState::Expired, height)
        })?;
    }
    let live: Vec<u64> = state.market().live_order_ids().collect();
    for &id in &live {
        let expired = state
            .market()
            .order(id)
            .is_some_and(|o| height >= o.end_height);
        if expired {
            run(state, |staged| {
                close_order(staged, id, CloseReason::Expired, height)
            })?;
        }
    }
    let mut work = MATCH_WORK_PER_BLOCK;
    for &id in &live {
        let Some(order) = state.market().order(id) else {
            continue;
        };
        if !needs_matching(state, order) {
            continue;
        }
        let order = order.clone();
        let mut finished = true;
        run(state, |staged| {
            finished = match_order(staged, order, height, &mut work)?;
            Ok(())
        })?;
        if !finished {
            break;
        }
    }
    for id in live {
        run(state, |staged| follow_funds(staged, id, height))?;
    }
    Ok(())
}

/// Runs one staged step on `state`: all of its writes, or none when it fails.
fn run(
    state: &mut State,
    step: impl FnOnce(&mut Staged) -> Result<(), TxError>,
) -> Result<(), TxError> {
    let mut staged = Staged::new(state);
    step(&mut staged)?;
    let writes = staged.into_writes();
    state.write(writes);
    Ok(())
}

fn needs_matching(state: &State, order: &Order) -> bool {
    match order.state {
        OrderState::Closed(_) | OrderState::Paused => false,
        OrderState::Active => order.rematch,
        OrderState::Open | OrderState::Degraded => {
            order.rematch || state.market().newest_open_offer(&order.model) > order.matched_through
        }
    }
}

/// Whether `operator` may be placed now: bonded as the chain asks and not jailed.
fn eligible(state: &State, operator: &Address, height: u64) -> bool {
    let account = state.account(operator);
    account.bonded >= state.genesis().params.min_bond && !account.is_jailed(height)
}

/// What matching knows of one order's coverage: for each wanted expert (sorted), how many
/// replicas it has and from which operators.
struct Coverage {
    wanted: Vec<(u16, u16)>,
    replicas: Vec<u8>,
    by_operator: BTreeMap<Address, Vec<bool>>,
    target: u8,
}

impl Coverage {
    fn new(order: &Order) -> Coverage {
        let wanted = order.experts.expand();
        Coverage {
            replicas: vec![0; wanted.len()],
            wanted,
            by_operator: BTreeMap::new(),
            target: order.replicas,
        }
    }

    /// Experts of `experts` that `operator` could still add a replica to; costs `work`.
    fn gaps(&self, operator: &Address, experts: &Selection, work: &mut u64) -> Vec<usize> {
        *work = work.saturating_sub(self.wanted.len() as u64 * experts.0.len() as u64);
        let mine = self.by_operator.get(operator);
        (0..self.wanted.len())
            .filter(|&i| self.replicas[i] < self.target)
            .filter(|&i| !mine.is_some_and(|m| m[i]))
            .filter(|&i| experts.contains(self.wanted[i]))
            .collect()
    }

    fn add(&mut self, operator: Address, indexes: &[usize]) {
        let len = self.wanted.len();
        let mine = self
            .by_operator
            .entry(operator)
            .or_insert_with(|| vec![false; len]);
        for &i in indexes {
            if !mine[i] {
                mine[i] = true;
                self.replicas[i] = self.replicas[i].saturating_add(1);
            }
        }
    }

    fn full(&self) -> bool {
        self.replicas.iter().all(|&r| r >= self.target)
    }

    fn state(&self, placements: usize) -> OrderState {
        if placements == 0 {
            OrderState::Open
        } else if self.full() {
            OrderState::Active
        } else {
            OrderState::Degraded
        }
    }
}

/// Matches one order; false when the work budget ran out before it was done (its flag
/// stays, so the next boundary goes on from its placements).
fn match_order(
    staged: &mut Staged,
    mut order: Order,
    height: u64,
    work: &mut u64,
) -> Result<bool, TxError> {
    let state = staged.state();
    let market = state.market();
    let mut coverage = Coverage::new(&order);
    let mut placed_offers = BTreeSet::new();
    let mut reserve = Amount::ZERO;
    let mut placements = 0;
    for placement in market.live_placements_of_order(order.id) {
        let indexes = coverage.gaps(&placement.operator, &placement.experts, work);
        coverage.add(placement.operator, &indexes);
        placed_offers.insert(placement.offer);
        reserve = reserve
            .checked_add(placement.price)
            .ok_or(TxError::Overflow)?;
        placements += 1;
    }
    let mut finished = true;
    let mut next_id = staged.next_placement_id();
    for offer in market.open_offers_of_model(&order.model) {
        if coverage.full() || offer.price > order.max_price {
            break;
        }
        if *work == 0 {
            finished = false;
            break;
        }
        if placed_offers.contains(&offer.id) || !eligible(state, &offer.operator, height) {
            continue;
        }
        let with_offer = reserve.checked_add(offer.price).ok_or(TxError::Overflow)?;
        if order.escrow < with_offer {
            // Every later offer costs at least as much.
            break;
        }
        let indexes = coverage.gaps(&offer.operator, &offer.experts, work);
        if indexes.is_empty() {
            continue;
        }
        let keys: Vec<(u16, u16)> = indexes.iter().map(|&i| coverage.wanted[i]).collect();
        coverage.add(offer.operator, &indexes);
        staged.set_placement(Placement {
            id: next_id,
            order: order.id,
            offer: offer.id,
            operator: offer.operator,
            model: order.model.clone(),
            experts: Selection::from_keys(&keys),
            price: offer.price,
            start_height: height,
            end_height: 0,
            state: PlacementState::Live,
        });
        next_id += 1;
        placements += 1;
        reserve = with_offer;
    }
    order.rematch = !finished;
    order.matched_through = market.newest_open_offer(&order.model);
    let next = coverage.state(placements);
    if next != order.state {
        order.state = next;
        order.since_height = height;
    }
    staged.set_order(order);
    Ok(finished)
}

/// Keeps a live order's state in step with its escrow, and closes one that stayed paused
/// or unplaced too long.
fn follow_funds(staged: &mut Staged, id: u64, height: u64) -> Result<(), TxError> {
    let Some(mut order) = staged.order(id) else {
        return Ok(());
    };
    if order.state.is_closed() {
        return Ok(());
    }
    let market = staged.state().market();
    let mut reserve = Amount::ZERO;
    let mut placements = 0;
    for placement in market.live_placements_of_order(id) {
        reserve = reserve
            .checked_add(placement.price)
            .ok_or(TxError::Overflow)?;
        placements += 1;
    }
    let short = placements > 0 && order.escrow < reserve;
    let waited = height.saturating_sub(order.since_height);
    let next = match order.state {
        OrderState::Paused if short => {
            if waited >= PAUSED_BLOCKS_BEFORE_CLOSE {
                return close_order(staged, id, CloseReason::InsufficientFunds, height);
            }
            return Ok(());
        }
        OrderState::Paused => {
            let mut coverage = Coverage::new(&order);
            let mut unlimited = u64::MAX;
            for placement in market.live_placements_of_order(id) {
                let indexes =
                    coverage.gaps(&placement.operator, &placement.experts, &mut unlimited);
                coverage.add(placement.operator, &indexes);
            }
            coverage.state(placements)
        }
        _ if short => OrderState::Paused,
        OrderState::Open if placements == 0 => {
            if waited >= UNPLACED_BLOCKS_BEFORE_CLOSE {
                return close_order(staged, id, CloseReason::Unfillable, height);
            }
            return Ok(());
        }
        // Placements lost outside matching (an offer ended while the order was paused).
        OrderState::Active | OrderState::Degraded if placements == 0 => OrderState::Open,
        _ => return Ok(()),
    };
    if next != order.state {
        order.state = next;
        order.since_height = height;
        staged.set_order(order);
    }
    Ok(())
}
