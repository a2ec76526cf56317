//! The credit action: a genesis gateway submits a hub's signed receipt, and the worker it
//! names is paid for the bytes relayed since the session's last credited receipt. Receipts
//! are cumulative, so a replay or a duplicate pays nothing. A receipt for a session its
//! worker is convicted in, a jailed worker, or (on a chain with bonds) a worker bonded below `min_bond`
//! is taken, raising the session's mark, but pays nothing: such a key cannot be paid, and
//! the gateway's crediting need not treat it as an error. Its three stages, as `tx`
//! dispatches them, and the receipt itself.

use crate::amount::Amount;
use crate::fees::Charge;
use crate::genesis::Genesis;
use crate::intent::{self, Intent};
use crate::keys::{Address, SignatureCheck};
use crate::market::{Placement, PlacementState};
use crate::receipt::{Receipt, SignedReceipt};
use crate::state::{MeterKey, ReceiptMark, SessionKey, Staged, State};

use super::{TxError, TxSignature};

/// Format: the receipt is for this chain, does not pay the pool, and carries the hub's
/// signature (returned, to verify with the rest of the batch).
pub(super) fn check_stateless(
    genesis: &Genesis,
    chain_id: &str,
    signed: &SignedReceipt,
) -> Result<Vec<TxSignature>, TxError> {
    let r = &signed.receipt;
    if r.chain_id != chain_id {
        return Err(TxError::ReceiptWrongChain {
            expected: chain_id.to_string(),
            got: r.chain_id.clone(),
        });
    }
    if r.worker == genesis.rewards_pool_address() {
        return Err(TxError::ReceiptToPool);
    }
    let message = intent::signing_message(Intent::Receipt, &r.chain_id, r);
    let check = SignatureCheck::new(&r.hub, &message, &signed.signature)
        .map_err(|_| TxError::BadReceiptSignature)?;
    Ok(vec![TxSignature {
        check,
        error: TxError::BadReceiptSignature,
    }])
}

/// `sender` is a genesis gateway, the receipt's hub a genesis hub, and the receipt is newer
/// than the session's mark and for the same worker.
pub(super) fn check_stateful(
    state: &State,
    sender: &Address,
    signed: &SignedReceipt,
) -> Result<(), TxError> {
    let genesis = state.genesis();
    if !genesis.is_gateway(sender) {
        return Err(TxError::NotAGateway(*sender));
    }
    let r = &signed.receipt;
    if !genesis.is_hub(&r.hub) {
        return Err(TxError::NotAHub(r.hub));
    }
    if let Some(worker) = state.session_worker(&SessionKey::of(r)) {
        if worker != r.worker {
            return Err(TxError::SessionWorkerMismatch {
                stored: worker,
                got: r.worker,
            });
        }
    }
    if let Some(mark) = state.receipt_mark(&MeterKey::of(r)) {
        if r.cumulative_bytes <= mark.cumulative_bytes {
            return Err(TxError::ReceiptNotNewer {
                stored: mark.cumulative_bytes,
                got: r.cumulative_bytes,
            });
        }
    }
    // What `execute` pays must fit an amount at the price it pays at (the worker's placement
    // under the order, else the pool's rate): a credit that passed here and failed in a block
    // would leave a gap in its gateway's nonces, and every later credit waiting on it.
    let placed = placement_for(state, r.order, &r.worker).filter(|_| r.order != 0);
    let price = placed.map_or(genesis.params.reward_per_unit, |p| p.price);
    genesis
        .earned_at(price, r.cumulative_bytes)
        .ok_or(TxError::Overflow)?;
    Ok(())
}

/// Whether the worker of a session may be paid now: not convicted in it, not jailed, and
/// bonded as the chain asks.
fn may_be_paid(state: &State, receipt: &Receipt) -> bool {
    let worker = state.account(&receipt.worker);
    let convicted = worker.is_convicted_in(&SessionKey::of(receipt));
    let genesis = state.genesis();
    let bonded = !genesis.bonds_required() || worker.bonded >= genesis.params.min_bond;
    // The block being built is the one after the head.
    !convicted && !worker.is_jailed(state.height() + 1) && bonded
}

/// The placement under `order` of `worker`'s offers that pays its traffic: its oldest live
/// one; or, while a closed order waits out its grace before the refund, the one that closed
/// with it (traffic served before the close is paid).
fn placement_for(state: &State, order: u64, worker: &Address) -> Option<Placement> {
    let market = state.market();
    let mine = |p: &&Placement| p.operator == *worker;
    if let Some(live) = market.live_placements_of_order(order).find(mine) {
        return Some(live.clone());
    }
    let closing = market
        .order(order)
        .is_some_and(|o| o.state.is_closed() && o.refund_height != 0);
    market
        .placements_of_order(order)
        .filter(|p| closing && matches!(p.state, PlacementState::OrderClosed(_)))
        .find(mine)
        .cloned()
}

/// What a credit pays now: `due` for the receipt's new bytes, of which its source (the pool,
/// or the order's escrow at the worker's placement's price) `covers` what it holds.
struct Pay {
    due: Amount,
    covered: Amount,
}

/// What the receipt's new bytes pay: outside any order, `earned(new) - earned(old)` from the
/// pool; for an order, the same count at the price of the worker's live placement under it,
/// from the order's escrow. `None` when nothing is paid: the worker may not be paid, or is
/// not placed for the order (the backbone should not have dispatched to it).
fn pay_of(state: &State, receipt: &Receipt) -> Result<Option<Pay>, TxError> {
    if !may_be_paid(state, receipt) {
        return Ok(None);
    }
    let (price, held) = if receipt.order == 0 {
        let pool = state.account(&state.rewards_pool()).balance;
        (state.genesis().params.reward_per_unit, pool)
    } else {
        let Some(placement) = placement_for(state, receipt.order, &receipt.worker) else {
            return Ok(None);
        };
        let order = state.market().order(receipt.order);
        let escrow = order.ok_or(TxError::UnknownOrder(receipt.order))?.escrow;
        (placement.price, escrow)
    };
    let old = state
        .receipt_mark(&MeterKey::of(receipt))
        .map_or(0, |mark| mark.cumulative_bytes);
    let earned = |bytes| {
        state
            .genesis()
            .earned_at(price, bytes)
            .ok_or(TxError::Overflow)
    };
    let due = earned(receipt.cumulative_bytes)?
        .checked_sub(earned(old)?)
        .ok_or(TxError::Overflow)?;
    // New bytes worth nothing (a placement at price zero, a count that rounds to nothing)
    // pay nothing, and so no fee.
    if due.is_zero() {
        return Ok(None);
    }
    Ok(Some(Pay {
        due,
        covered: due.min(held),
    }))
}

/// The fee a credit pays out of its pay: its price, or all its source covers if that is
/// less. The gateway holds back a credit whose pay would not cover its fee (counts being
/// cumulative, the session's next receipt brings it); one that comes anyway, its escrow or
/// the pool run low, must still be taken, or every later credit of its gateway would wait
/// on its nonce. (A credit bids no tip: `check_format`.)
fn fee_of(pay: &Pay, charge: Charge) -> Charge {
    Charge {
        burned: charge.burned.min(pay.covered),
        tip: Amount::ZERO,
    }
}

/// Pays the worker for the receipt's new bytes (`pay_of`), less the credit's fee, and raises
/// the mark. From the pool, what it cannot cover is recorded as owed; from an order, the
/// escrow pays as far as it goes. A credit that pays nothing pays no fee either: it only
/// raises the mark.
pub(super) fn execute(
    staged: &mut Staged,
    receipt: &Receipt,
    charge: Charge,
) -> Result<(), TxError> {
    let key = MeterKey::of(receipt);
    let state = staged.state();
    if let Some(pay) = pay_of(state, receipt)? {
        let fee = fee_of(&pay, charge);
        let net = pay
            .covered
            .checked_sub(fee.burned)
            .ok_or(TxError::Overflow)?;
        staged.pay_fee(fee)?;
        if receipt.order == 0 {
            let mut pool = staged.account(&state.rewards_pool());
            pool.balance = pool
                .balance
                .checked_sub(pay.covered)
                .ok_or(TxError::Overflow)?;
            staged.set_account(state.rewards_pool(), pool);
            let unpaid = pay.due.checked_sub(pay.covered).ok_or(TxError::Overflow)?;
            if !unpaid.is_zero() {
                let mut worker = staged.account(&receipt.worker);
                worker.owed = worker.owed.checked_add(unpaid).ok_or(TxError::Overflow)?;
                staged.set_account(receipt.worker, worker);
            }
        } else {
            let mut order = staged
                .order(receipt.order)
                .ok_or(TxError::UnknownOrder(receipt.order))?;
            order.escrow = order
                .escrow
                .checked_sub(pay.covered)
                .ok_or(TxError::Overflow)?;
            order.paid = order
                .paid
                .checked_add(pay.covered)
                .ok_or(TxError::Overflow)?;
            staged.set_order(order);
        }
        staged.add_pending(receipt.worker, net, Some(key.session), receipt.order)?;
    }
    let mark = ReceiptMark {
        worker: receipt.worker,
        cumulative_bytes: receipt.cumulative_bytes,
    };
    staged.set_receipt_mark(key, mark);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::genesis::tests::test_genesis;
    use crate::tx::{stateless_results, SignedTx, TxKind};

    #[test]
    fn a_credit_carries_a_receipt_for_this_chain_signed_by_its_hub() {
        let (genesis, keys) = test_genesis();
        let receipt = Receipt {
            chain_id: "kvasir-test".into(),
            hub: keys.hub.address(),
            session_id: 1,
            worker: keys.worker.address(),
            order: 0,
            cumulative_bytes: 10,
        };
        let credit = |signed: SignedReceipt| -> SignedTx {
            TxKind::Credit(signed).signed("kvasir-test", &keys.gateway, 0)
        };
        let good = credit(receipt.clone().sign(&keys.hub));
        let mut bad_signature = receipt.clone().sign(&keys.hub);
        bad_signature.receipt.cumulative_bytes = 1_000_000;
        let bad_signature = credit(bad_signature);
        let mut small_order_hub = receipt.clone().sign(&keys.hub);
        small_order_hub.receipt.hub = Address::from_bytes([0; 32]);
        let small_order_hub = credit(small_order_hub);
        let other_chain = credit(
            Receipt {
                chain_id: "other".into(),
                ..receipt.clone()
            }
            .sign(&keys.hub),
        );
        let to_pool = credit(
            Receipt {
                worker: genesis.rewards_pool_address(),
                ..receipt.clone()
            }
            .sign(&keys.hub),
        );
        let results = stateless_results(
            &genesis,
            &[good, bad_signature, small_order_hub, other_chain, to_pool],
        );
        assert_eq!(results[0], Ok(()));
        assert_eq!(results[1], Err(TxError::BadReceiptSignature));
        assert_eq!(results[2], Err(TxError::BadReceiptSignature));
        assert!(matches!(results[3], Err(TxError::ReceiptWrongChain { .. })));
        assert_eq!(results[4], Err(TxError::ReceiptToPool));
    }
}
