//! The market's block-boundary step, pure and deterministic like the rest of `apply_block`:
//! closed orders past their grace refund their escrow, offers past their expiry end, placements of operators jailed or unbonded since close,
//! orders past their end height close, every live order's state follows its escrow (paused,
//! resumed, closed for funds or for want of placements), and orders that need it are
//! matched.
//!
//! Matching one order: its wanted experts each need `replicas` placements from distinct
//! operators, and an operator holds at most one placement under an order (its workers' traffic
//! for the order then has one price). Open offers of its model are taken cheapest first (ties
//! by id) up to its max price, each for the wanted experts it covers that still lack replicas
//! from other operators, while the escrow covers one block's expected pay of every placement
//! (the reserve: each placement's price for one reward unit). Placements already made stay: a
//! cheaper offer appearing later does not displace a running lease.  An order is matched when
//! it is new, got money, or lost a placement (`Order::rematch`), and when it is short of
//! replicas and a newer offer of its model exists. The work of one boundary is bounded
//! (`MATCH_WORK_PER_BLOCK`, at most `MATCH_WORK_PER_ORDER` of it for one order): an order not
//! reached, or not finished, keeps its flag and is matched at a later boundary; each boundary
//! starts at another order.

use std::collections::BTreeMap;

use crate::amount::Amount;
use crate::keys::Address;
use crate::state::{Staged, State};
use crate::tx::TxError;

use super::lifecycle::{close_order, end_offer, end_placement, refund};
use super::{
    CloseReason, ExpertKey, OfferState, Order, OrderState, Placement, PlacementState, Rect,
    Selection, PAUSED_BLOCKS_BEFORE_CLOSE, UNPLACED_BLOCKS_BEFORE_CLOSE,
};

/// The work one block boundary may spend on matching: rectangles compared and experts
/// looked at (`Coverage::overlap`), offers visited.
pub const MATCH_WORK_PER_BLOCK: u64 = 4_000_000;
/// The most of it one order may take, so that no order (however large, however many
/// fruitless offers its model has) holds up the others.
pub const MATCH_WORK_PER_ORDER: u64 = 1_000_000;

/// The market's part of the block boundary at `height`.
pub fn end_block(state: &mut State, height: u64) -> Result<(), TxError> {
    for id in state.market().offers_expiring_by(height) {
        run(state, |staged| {
            end_offer(staged, id, OfferState::Expired, height)
        })?;
    }
    for id in state.market().refunds_due_by(height) {
        run(state, |staged| refund(staged, id))?;
    }
    let live: Vec<u64> = state.market().live_orders().map(|o| o.id).collect();
    drop_ineligible(state, &live, height)?;
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
    // Funds first: an order resumed by a deposit is matched again at this boundary.
    for &id in &live {
        run(state, |staged| follow_funds(staged, id, height))?;
    }
    // Orders are taken from a point that moves with the height, so that no order, however
    // costly, is always first and no order is always last.
    let start = match live.len() {
        0 => 0,
        n => (height.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % n,
    };
    let mut budget = MATCH_WORK_PER_BLOCK;
    for &id in live[start..].iter().chain(&live[..start]) {
        let Some(order) = state.market().order(id) else {
            continue;
        };
        if budget == 0 {
            break;
        }
        if !needs_matching(state, order) {
            continue;
        }
        let order = order.clone();
        let mut work = budget.min(MATCH_WORK_PER_ORDER);
        let given = work;
        run(state, |staged| {
            match_order(staged, order, height, &mut work)
        })?;
        budget -= given - work;
    }
    Ok(())
}

/// Closes the live placements whose operator may no longer be placed (jailed, or unbonded
/// below `min_bond`), so their orders are matched again: a placement that cannot be paid
/// or dispatched to must not hold a replica.
fn drop_ineligible(state: &mut State, live: &[u64], height: u64) -> Result<(), TxError> {
    let market = state.market();
    let gone: Vec<(u64, u64)> = live
        .iter()
        .flat_map(|&order| market.live_placements_of_order(order))
        .filter(|p| !eligible(state, &p.operator, height))
        .map(|p| (p.id, p.order))
        .collect();
    for (placement, order) in gone {
        run(state, |staged| {
            end_placement(
                staged,
                placement,
                PlacementState::OperatorIneligible,
                height,
            )?;
            let mut order = staged.order(order).ok_or(TxError::UnknownOrder(order))?;
            order.rematch = true;
            staged.set_order(order);
            Ok(())
        })?;
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
    let min_bond = state.genesis().params.min_bond;
    match state.account_ref(operator) {
        Some(account) => account.bonded >= min_bond && !account.is_jailed(height),
        None => min_bond.is_zero(),
    }
}

/// What matching knows of one order's coverage: for each wanted expert (sorted), how many
/// replicas it has and from which operators.
struct Coverage {
    wanted: Vec<ExpertKey>,
    rects: Vec<Rect>,
    replicas: Vec<u8>,
    by_operator: BTreeMap<Address, Vec<bool>>,
    target: u8,
}

impl Coverage {
    /// An order's coverage before any placement; `None` when `work` cannot pay for it.
    fn new(order: &Order, work: &mut u64) -> Option<Coverage> {
        let wanted = order.experts.expand();
        charge(work, wanted.len() as u64)?;
        Some(Coverage {
            replicas: vec![0; wanted.len()],
            wanted,
            rects: order.experts.0.clone(),
            by_operator: BTreeMap::new(),
            target: order.replicas,
        })
    }

    /// The wanted experts (their indexes) that `experts` covers. What it costs, charged to
    /// `work` before anything is computed, is the rectangles compared and the experts they
    /// share, so an offer far from the order costs little and none costs more than it
    /// yields; `None` when `work` cannot pay.
    fn overlap(&self, experts: &Selection, work: &mut u64) -> Option<Vec<usize>> {
        let pairs = (experts.0.len() * self.rects.len()) as u64;
        let shared: Vec<Rect> = experts
            .0
            .iter()
            .flat_map(|a| self.rects.iter().filter_map(|b| a.intersect(b)))
            .collect();
        charge(work, pairs + shared.iter().map(Rect::size).sum::<u64>())?;
        let mut indexes: Vec<usize> = shared
            .iter()
            .flat_map(Rect::keys)
            .filter_map(|key| self.wanted.binary_search(&key).ok())
            .collect();
        indexes.sort_unstable();
        indexes.dedup();
        Some(indexes)
    }

    /// Whether `experts` shares any expert with the order, at the cost of the rectangles
    /// compared (charged to `work`, which may run out: then it says no).
    fn touches(&self, experts: &Selection, work: &mut u64) -> bool {
        let pairs = (experts.0.len() * self.rects.len()) as u64;
        charge(work, pairs).is_some()
            && experts
                .0
                .iter()
                .any(|a| self.rects.iter().any(|b| a.intersect(b).is_some()))
    }

    /// Experts of `experts` that `operator` could still add a replica to.
    fn gaps(&self, operator: &Address, experts: &Selection, work: &mut u64) -> Option<Vec<usize>> {
        let mine = self.by_operator.get(operator);
        let overlap = self.overlap(experts, work)?;
        Some(
            overlap
                .into_iter()
                .filter(|&i| self.replicas[i] < self.target && !mine.is_some_and(|m| m[i]))
                .collect(),
        )
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

    /// Counts the order's live placements; `None` when `work` cannot pay for it.
    fn of_placements(mut self, placements: &[&Placement], work: &mut u64) -> Option<Coverage> {
        for placement in placements {
            let indexes = self.overlap(&placement.experts, work)?;
            self.add(placement.operator, &indexes);
        }
        Some(self)
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

/// Takes `cost` (at least one) from `work`, or nothing when it cannot pay (`None`).
fn charge(work: &mut u64, cost: u64) -> Option<()> {
    *work = work.checked_sub(cost.max(1))?;
    Some(())
}

/// Matches one order within `work`. An order the work ran out on keeps its flag: a later
/// boundary goes on from the placements made so far.
fn match_order(
    staged: &mut Staged,
    mut order: Order,
    height: u64,
    work: &mut u64,
) -> Result<(), TxError> {
    let state = staged.state();
    let market = state.market();
    let live: Vec<&Placement> = market.live_placements_of_order(order.id).collect();
    let mut placements = live.len();
    let mut reserve = Amount::ZERO;
    for placement in &live {
        reserve = reserve
            .checked_add(placement.price)
            .ok_or(TxError::Overflow)?;
    }
    let coverage =
        Coverage::new(&order, work).and_then(|coverage| coverage.of_placements(&live, work));
    let mut finished = false;
    let mut eligibility: BTreeMap<Address, bool> = BTreeMap::new();
    if let Some(mut coverage) = coverage {
        let mut next_id = staged.next_placement_id();
        finished = true;
        for offer in market.open_offers_of_model(&order.model) {
            if coverage.full() || offer.price > order.max_price {
                break;
            }
            // Every offer looked at costs something, even one passed over.
            if charge(work, 1).is_none() {
                finished = false;
                break;
            }
            // One placement per operator and order, so that a session's traffic has one
            // price; then the cheap test: most of a model's offers are elsewhere in it.
            let operator_placed = coverage.by_operator.contains_key(&offer.operator);
            if operator_placed || !coverage.touches(&offer.experts, work) {
                continue;
            }
            let operator_ok = *eligibility
                .entry(offer.operator)
                .or_insert_with(|| eligible(state, &offer.operator, height));
            if !operator_ok {
                continue;
            }
            let with_offer = reserve.checked_add(offer.price).ok_or(TxError::Overflow)?;
            if order.escrow < with_offer {
                // Every later offer costs at least as much.
                break;
            }
            let Some(indexes) = coverage.gaps(&offer.operator, &offer.experts, work) else {
                finished = false;
                break;
            };
            if indexes.is_empty() {
                continue;
            }
            let keys: Vec<ExpertKey> = indexes.iter().map(|&i| coverage.wanted[i]).collect();
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
        let next = coverage.state(placements);
        if next != order.state {
            order.state = next;
            order.since_height = height;
        }
    }
    order.rematch = !finished;
    order.matched_through = market.newest_open_offer(&order.model);
    staged.set_order(order);
    Ok(())
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
        // Resumed: its coverage is found again at the next boundary's matching.
        OrderState::Paused => {
            order.rematch = true;
            if placements == 0 {
                OrderState::Open
            } else {
                OrderState::Degraded
            }
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
