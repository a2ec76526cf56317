//! The bond actions. `Bond` moves spendable balance into the sender's bond, which the hub
//! and the backbone ask a worker to hold (at least the genesis `min_bond`) before serving;
//! `Unbond` moves bonded money into an unbonding entry that returns to the balance after
//! `unbonding_blocks`, a delay longer than the challenge window, during which evidence
//! still slashes it. A chain without `min_bond` has no bonds and refuses both.

use crate::amount::Amount;
use crate::keys::Address;
use crate::state::{Account, Staged, State, Unbonding};

use super::{TxError, TxSignature};

/// Format: a bond moves something. It carries no signature but the sender's.
pub(super) fn check_stateless(amount: Amount) -> Result<Vec<TxSignature>, TxError> {
    if amount.is_zero() {
        return Err(TxError::ZeroAmount);
    }
    Ok(Vec::new())
}

fn check_bonds_exist(state: &State) -> Result<(), TxError> {
    if !state.genesis().bonds_required() {
        return Err(TxError::NoBonds);
    }
    Ok(())
}

/// Bond: the chain has bonds and the balance covers it.
pub(super) fn check_bond(state: &State, sender: &Account, amount: Amount) -> Result<(), TxError> {
    check_bonds_exist(state)?;
    super::transfer::check_funds(sender, amount)
}

/// Unbond: the chain has bonds and at most what is bonded is unbonded.
pub(super) fn check_unbond(state: &State, sender: &Account, amount: Amount) -> Result<(), TxError> {
    check_bonds_exist(state)?;
    if sender.bonded < amount {
        return Err(TxError::InsufficientBond {
            bonded: sender.bonded,
            needed: amount,
        });
    }
    Ok(())
}

pub(super) fn execute_bond(
    staged: &mut Staged,
    sender: &Address,
    amount: Amount,
) -> Result<(), TxError> {
    let mut account = staged.account(sender);
    account.balance = account
        .balance
        .checked_sub(amount)
        .ok_or(TxError::Overflow)?;
    account.bonded = account
        .bonded
        .checked_add(amount)
        .ok_or(TxError::Overflow)?;
    staged.set_account(*sender, account);
    Ok(())
}

/// Starts the unbonding delay. Unbondings released at the same height are merged, so an
/// account holds at most one entry per height of the delay.
pub(super) fn execute_unbond(
    staged: &mut Staged,
    sender: &Address,
    amount: Amount,
) -> Result<(), TxError> {
    let release_height = staged.height_after(staged.state().genesis().params.unbonding_blocks)?;
    let mut account = staged.account(sender);
    account.bonded = account
        .bonded
        .checked_sub(amount)
        .ok_or(TxError::Overflow)?;
    match account.unbonding.last_mut() {
        Some(last) if last.release_height == release_height => {
            last.amount = last.amount.checked_add(amount).ok_or(TxError::Overflow)?;
        }
        _ => account.unbonding.push(Unbonding {
            release_height,
            amount,
        }),
    }
    staged.set_account(*sender, account);
    Ok(())
}
