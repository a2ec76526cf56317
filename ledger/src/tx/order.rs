//! The order actions. `OrderCreate`: a buyer asks for replicas of experts of a model at most
//! at a price, and moves a deposit from its balance into the order's escrow; matching
//! places it at the block boundary. `OrderDeposit`: anyone adds to a live order's escrow
//! (a paused order resumes). `OrderClose`: the buyer closes it; its placements close in the
//! same transaction, and the escrow left is refunded `CLOSE_GRACE_BLOCKS` later.

use borsh::{BorshDeserialize, BorshSerialize};

use crate::amount::Amount;
use crate::keys::Address;
use crate::market::{self, CloseReason, Order, OrderState, Selection, MAX_LIVE_ORDERS_PER_BUYER};
use crate::state::{Account, Staged, State};

use super::offer::{check_future, check_model_id, next_height, pinned_model};
use super::{transfer::check_funds, TxError, TxSignature};

/// What a buyer orders.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct NewOrder {
    pub model: String,
    pub experts: Selection,
    /// Placements wanted for each expert, from distinct operators.
    pub replicas: u8,
    /// The most it pays per reward unit.
    pub max_price: Amount,
    /// Moved from the buyer's balance into the escrow.
    pub deposit: Amount,
    /// The order closes at the end of this block.
    pub end_height: u64,
    /// A key that may run the backbone for the order besides the buyer's.
    pub delegate: Option<Address>,
}

pub(super) fn check_stateless_create(new: &NewOrder) -> Result<Vec<TxSignature>, TxError> {
    check_model_id(&new.model)?;
    new.experts.validate().map_err(TxError::BadSelection)?;
    if new.replicas == 0 || new.replicas > market::MAX_REPLICAS {
        return Err(TxError::BadReplicas(new.replicas));
    }
    if new.deposit.is_zero() {
        return Err(TxError::ZeroAmount);
    }
    // A deposit below one unit at the max price could never hold a single placement.
    if new.deposit < new.max_price {
        return Err(TxError::DepositBelowPrice {
            deposit: new.deposit,
            max_price: new.max_price,
        });
    }
    if let Some(delegate) = new.delegate {
        delegate
            .check_key()
            .map_err(|_| TxError::BadDelegate(delegate))?;
    }
    Ok(Vec::new())
}

/// The balance covers the deposit, the buyer holds fewer live orders than the limit, and the
/// end is ahead.
pub(super) fn check_create(
    state: &State,
    buyer: &Address,
    account: &Account,
    new: &NewOrder,
) -> Result<(), TxError> {
    check_funds(account, new.deposit)?;
    if state.market().live_order_count(buyer) >= MAX_LIVE_ORDERS_PER_BUYER {
        return Err(TxError::TooManyLiveOrders(MAX_LIVE_ORDERS_PER_BUYER));
    }
    pinned_model(state, &new.model, &new.experts)?;
    check_future(state, new.end_height)
}

pub(super) fn execute_create(
    staged: &mut Staged,
    buyer: &Address,
    new: &NewOrder,
) -> Result<(), TxError> {
    let state = staged.state();
    let height = next_height(state);
    let model = pinned_model(state, &new.model, &new.experts)?;
    staged.sub_balance(*buyer, new.deposit)?;
    staged.set_order(Order {
        id: state.market().next_order_id(),
        buyer: *buyer,
        delegate: new.delegate,
        model,
        experts: new.experts.clone(),
        replicas: new.replicas,
        max_price: new.max_price,
        escrow: new.deposit,
        paid: Amount::ZERO,
        refunded: Amount::ZERO,
        refund_height: 0,
        end_height: new.end_height,
        created_height: height,
        state: OrderState::Open,
        since_height: height,
        rematch: true,
        matched_through: 0,
    });
    Ok(())
}

fn live_order(state: &State, id: u64) -> Result<&Order, TxError> {
    let order = state.market().order(id).ok_or(TxError::UnknownOrder(id))?;
    if order.state.is_closed() {
        return Err(TxError::OrderClosed(id));
    }
    Ok(order)
}

/// The order is live and the balance covers the deposit.
pub(super) fn check_deposit(
    state: &State,
    account: &Account,
    id: u64,
    amount: Amount,
) -> Result<(), TxError> {
    let order = live_order(state, id)?;
    check_funds(account, amount)?;
    order.escrow.checked_add(amount).ok_or(TxError::Overflow)?;
    Ok(())
}

pub(super) fn execute_deposit(
    staged: &mut Staged,
    sender: &Address,
    id: u64,
    amount: Amount,
) -> Result<(), TxError> {
    staged.sub_balance(*sender, amount)?;
    let mut order = staged.order(id).ok_or(TxError::UnknownOrder(id))?;
    order.escrow = order.escrow.checked_add(amount).ok_or(TxError::Overflow)?;
    order.rematch = true;
    staged.set_order(order);
    Ok(())
}

/// The order is live and the sender is its buyer.
pub(super) fn check_close(state: &State, buyer: &Address, id: u64) -> Result<(), TxError> {
    let order = live_order(state, id)?;
    if order.buyer != *buyer {
        return Err(TxError::NotYours(*buyer));
    }
    Ok(())
}

pub(super) fn execute_close(staged: &mut Staged, id: u64) -> Result<(), TxError> {
    let height = next_height(staged.state());
    market::close_order(staged, id, CloseReason::Buyer, height)
}
