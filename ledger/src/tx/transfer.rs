//! The transfer action: the sender pays `amount` of its spendable balance to `to`. Its three
//! stages, as `tx` dispatches them: a transfer moves something (no zero amount) to someone
//! else (no self-transfer), only from funds the sender holds, never overflows the
//! receiver's balance, and creates an account only with at least the chain's
//! `min_new_account`, so dust cannot grow the state without bound.

use crate::amount::Amount;
use crate::keys::Address;
use crate::state::{Account, Staged, State};

use super::{Tx, TxError, TxSignature};

/// Format: the rules that need no state. A transfer carries no signature but the sender's.
pub(super) fn check_stateless(
    tx: &Tx,
    to: &Address,
    amount: Amount,
) -> Result<Vec<TxSignature>, TxError> {
    if amount.is_zero() {
        return Err(TxError::ZeroAmount);
    }
    if *to == tx.sender {
        return Err(TxError::SelfTransfer);
    }
    Ok(Vec::new())
}

/// The sender's account can pay `amount`.
pub(super) fn check_funds(sender: &Account, amount: Amount) -> Result<(), TxError> {
    if sender.balance < amount {
        return Err(TxError::InsufficientFunds {
            balance: sender.balance,
            needed: amount,
        });
    }
    Ok(())
}

/// The sender's account can pay `amount`, and `to` can hold it: an existing account without
/// overflow, or a new one with at least the chain's minimum.
pub(super) fn check_stateful(
    state: &State,
    sender: &Account,
    to: &Address,
    amount: Amount,
) -> Result<(), TxError> {
    check_funds(sender, amount)?;
    let minimum = state.genesis().params.min_new_account;
    if amount < minimum && !state.has_account(to) {
        return Err(TxError::BelowNewAccountMinimum {
            to: *to,
            amount,
            minimum,
        });
    }
    state
        .account(to)
        .balance
        .checked_add(amount)
        .ok_or(TxError::Overflow)?;
    Ok(())
}

/// Moves `amount` from `sender` to `to`.
pub(super) fn execute(
    staged: &mut Staged,
    sender: &Address,
    to: &Address,
    amount: Amount,
) -> Result<(), TxError> {
    let mut from = staged.account(sender);
    from.balance = from.balance.checked_sub(amount).ok_or(TxError::Overflow)?;
    staged.set_account(*sender, from);
    let mut receiver = staged.account(to);
    receiver.balance = receiver
        .balance
        .checked_add(amount)
        .ok_or(TxError::Overflow)?;
    staged.set_account(*to, receiver);
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::amount::Amount;
    use crate::genesis::tests::test_genesis;
    use crate::state::State;
    use crate::tx::tests::transfer;
    use crate::tx::{check_stateful, stateless_results, TxError};

    #[test]
    fn a_transfer_moves_something_to_someone_else() {
        let (genesis, keys) = test_genesis();
        let zero = transfer(&keys.alice, 0, keys.bob.address(), "0");
        let to_self = transfer(&keys.alice, 0, keys.alice.address(), "1");
        assert_eq!(
            stateless_results(&genesis, &[zero, to_self]),
            [Err(TxError::ZeroAmount), Err(TxError::SelfTransfer)]
        );
    }

    #[test]
    fn dust_cannot_create_an_account_but_may_top_one_up() {
        let (mut genesis, keys) = test_genesis();
        genesis.params.min_new_account = Amount::parse("0.5").unwrap();
        let state = State::from_genesis(genesis);
        let fresh = crate::keys::Keypair::from_seed(&[42; 32]).address();
        assert_eq!(
            check_stateful(&state, &transfer(&keys.alice, 0, fresh, "0.499999999")),
            Err(TxError::BelowNewAccountMinimum {
                to: fresh,
                amount: Amount::parse("0.499999999").unwrap(),
                minimum: Amount::parse("0.5").unwrap(),
            })
        );
        assert_eq!(
            check_stateful(&state, &transfer(&keys.alice, 0, fresh, "0.5")),
            Ok(())
        );
        // Bob's account exists (genesis allocates to it): any amount tops it up.
        let bob = keys.bob.address();
        assert_eq!(
            check_stateful(&state, &transfer(&keys.alice, 0, bob, "0.000000001")),
            Ok(())
        );
    }
}
