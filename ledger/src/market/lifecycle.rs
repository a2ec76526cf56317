//! Ending market objects, shared by the transactions that end them (a buyer closing an
//! order, an operator withdrawing an offer) and the block boundary (end heights, expiries,
//! funds, unfillable orders). Each works on staged writes, so it happens whole within the
//! transaction or boundary step that caused it, or not at all.

use crate::amount::Amount;
use crate::state::Staged;
use crate::tx::TxError;

use super::{CloseReason, OfferState, OrderState, PlacementState, CLOSE_GRACE_BLOCKS};

/// Closes order `id` with `reason` at `height`: every live placement under it closes, and
/// what is left in the escrow goes back to the buyer `CLOSE_GRACE_BLOCKS` later, once
/// (`refund`); meanwhile credits for traffic its placements served are still paid. Pay
/// already credited from it stays pending with the workers; if evidence cancels some, it
/// returns to the escrow, or to the buyer once refunded (`return_pay`).
pub(crate) fn close_order(
    staged: &mut Staged,
    id: u64,
    reason: CloseReason,
    height: u64,
) -> Result<(), TxError> {
    let mut order = staged.order(id).ok_or(TxError::UnknownOrder(id))?;
    if order.state.is_closed() {
        return Err(TxError::OrderClosed(id));
    }
    let live: Vec<u64> = staged
        .state()
        .market()
        .live_placements_of_order(id)
        .map(|p| p.id)
        .collect();
    for placement_id in live {
        end_placement(
            staged,
            placement_id,
            PlacementState::OrderClosed(reason),
            height,
        )?;
    }
    order.state = OrderState::Closed(reason);
    order.since_height = height;
    order.rematch = false;
    order.refund_height = height
        .checked_add(CLOSE_GRACE_BLOCKS)
        .ok_or(TxError::Overflow)?;
    staged.set_order(order);
    Ok(())
}

/// Refunds closed order `id`'s escrow to its buyer, once: the escrow is then zero.
pub(crate) fn refund(staged: &mut Staged, id: u64) -> Result<(), TxError> {
    let mut order = staged.order(id).ok_or(TxError::UnknownOrder(id))?;
    let refund = std::mem::replace(&mut order.escrow, Amount::ZERO);
    order.refunded = order
        .refunded
        .checked_add(refund)
        .ok_or(TxError::Overflow)?;
    order.refund_height = 0;
    let buyer = order.buyer;
    staged.set_order(order);
    staged.add_balance(buyer, refund)
}

/// Ends open offer `id` (withdrawn or expired) at `height`: its live placements close, and
/// the orders they served are matched again at the block boundary.
pub(crate) fn end_offer(
    staged: &mut Staged,
    id: u64,
    state: OfferState,
    height: u64,
) -> Result<(), TxError> {
    let mut offer = staged.offer(id).ok_or(TxError::UnknownOffer(id))?;
    if offer.state != OfferState::Open {
        return Err(TxError::OfferNotOpen(id));
    }
    let placement_state = match state {
        OfferState::Expired => PlacementState::OfferExpired,
        _ => PlacementState::OfferWithdrawn,
    };
    let live: Vec<(u64, u64)> = staged
        .state()
        .market()
        .live_placements_of_offer(id)
        .map(|p| (p.id, p.order))
        .collect();
    for (placement_id, order_id) in live {
        end_placement(staged, placement_id, placement_state, height)?;
        let mut order = staged
            .order(order_id)
            .ok_or(TxError::UnknownOrder(order_id))?;
        order.rematch = true;
        staged.set_order(order);
    }
    offer.state = state;
    offer.ended_height = height;
    staged.set_offer(offer);
    Ok(())
}

/// Closes placement `id` in `state` at `height` (its order's rematching is the caller's).
pub(crate) fn end_placement(
    staged: &mut Staged,
    id: u64,
    state: PlacementState,
    height: u64,
) -> Result<(), TxError> {
    let mut placement = staged.placement(id).ok_or(TxError::UnknownPlacement(id))?;
    placement.state = state;
    placement.end_height = height;
    staged.set_placement(placement);
    Ok(())
}

/// Pay from order `id`'s escrow that evidence cancelled goes back: into the escrow until it
/// is refunded, to the buyer after.
pub(crate) fn return_pay(staged: &mut Staged, id: u64, amount: Amount) -> Result<(), TxError> {
    let mut order = staged.order(id).ok_or(TxError::UnknownOrder(id))?;
    order.paid = order.paid.checked_sub(amount).ok_or(TxError::Overflow)?;
    if order.state.is_closed() && order.refund_height == 0 {
        order.refunded = order
            .refunded
            .checked_add(amount)
            .ok_or(TxError::Overflow)?;
        let buyer = order.buyer;
        staged.set_order(order);
        return staged.add_balance(buyer, amount);
    }
    order.escrow = order.escrow.checked_add(amount).ok_or(TxError::Overflow)?;
    order.rematch = true;
    staged.set_order(order);
    Ok(())
}
