//! The market over real blocks: each scenario is a complaint users of compute markets have,
//! checked against `produce_block` and `apply_block` as nodes run them.

use proptest::prelude::*;

use super::*;
use crate::apply::tests::{block_of, rejection, verified};
use crate::apply::{apply_block, produce_block};
use crate::genesis::tests::{bonded_genesis, TestKeys};
use crate::genesis::{Allocation, Genesis};
use crate::keys::Keypair;
use crate::state::{MeterKey, SessionKey, State};
use crate::tx::{NewOffer, NewOrder, Receipt, SignedTx, TxError, TxKind};

fn kvr(text: &str) -> Amount {
    Amount::parse(text).unwrap()
}

fn operator(i: u8) -> Keypair {
    Keypair::from_seed(&[40 + i; 32])
}

/// `bonded_genesis` with four funded operators and a rich buyer (alice).
fn market_genesis() -> (Genesis, TestKeys) {
    let (mut genesis, keys) = bonded_genesis();
    for i in 0..4 {
        genesis.allocations.push(Allocation {
            address: operator(i).address(),
            amount: kvr("100"),
        });
    }
    (genesis, keys)
}

fn tx(state: &State, key: &Keypair, kind: TxKind) -> SignedTx {
    kind.signed("kvasir-test", key, state.account(&key.address()).nonce)
}

/// The state after each operator in `ops` bonds 10 KVR.
fn bonded(keys: &TestKeys, ops: &[u8]) -> State {
    let (genesis, _) = market_genesis();
    let state = State::from_genesis(genesis);
    let bonds = ops
        .iter()
        .map(|&i| tx(&state, &operator(i), TxKind::Bond { amount: kvr("10") }))
        .collect();
    block_of(&state, keys, bonds)
}

fn offer(state: &State, op: u8, experts: &str, price: &str) -> SignedTx {
    let new = NewOffer {
        model: "m".into(),
        experts: experts.parse().unwrap(),
        price: kvr(price),
        expiry_height: 1_000_000,
    };
    tx(state, &operator(op), TxKind::OfferCreate(new))
}

fn new_order(experts: &str, replicas: u8, max_price: &str, deposit: &str) -> NewOrder {
    NewOrder {
        model: "m".into(),
        experts: experts.parse().unwrap(),
        replicas,
        max_price: kvr(max_price),
        deposit: kvr(deposit),
        end_height: 1_000_000,
        delegate: None,
    }
}

fn order(state: &State, keys: &TestKeys, new: NewOrder) -> SignedTx {
    tx(state, &keys.alice, TxKind::OrderCreate(new))
}

/// (offer id, experts) of an order's live placements.
fn placed(state: &State, order: u64) -> Vec<(u64, String)> {
    state
        .market()
        .live_placements_of_order(order)
        .map(|p| (p.offer, p.experts.to_string()))
        .collect()
}

fn order_state(state: &State, id: u64) -> OrderState {
    state.market().order(id).unwrap().state
}

/// A gateway's credit of `bytes` for worker `op`'s session 1, under `order`.
fn credit(state: &State, keys: &TestKeys, op: u8, order: u64, bytes: u64) -> SignedTx {
    let receipt = Receipt {
        chain_id: "kvasir-test".into(),
        hub: keys.hub.address(),
        session_id: u64::from(op) + 1,
        worker: operator(op).address(),
        order,
        cumulative_bytes: bytes,
    };
    tx(
        state,
        &keys.gateway,
        TxKind::Credit(receipt.sign(&keys.hub)),
    )
}

/// Empty blocks until the head is `height`.
fn until(mut state: State, keys: &TestKeys, height: u64) -> State {
    while state.height() < height {
        state = block_of(&state, keys, Vec::new());
    }
    state
}

#[test]
fn orders_take_the_cheapest_offers_first_ties_by_id_and_distinct_operators() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0, 1, 2]);
    let offers = vec![
        offer(&state, 0, "0:0-3", "0.002"),
        offer(&state, 1, "0:0-3", "0.001"),
        offer(&state, 2, "0:0-1", "0.001"),
    ];
    let state = block_of(&state, &keys, offers);
    // A second offer of operator 1 must not count as another replica of its experts.
    let again = offer(&state, 1, "0:0-3", "0.0005");
    let state = block_of(&state, &keys, vec![again]);
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0-3", 2, "0.01", "1"))],
    );
    // Offer 4 (operator 1, cheapest) first, then offer 2 (operator 1 again: nothing new),
    // offer 3 (operator 2, experts 0-1), then offer 1 (operator 0) for what is left.
    assert_eq!(
        placed(&state, 1),
        vec![
            (4, "0:0-3".to_string()),
            (3, "0:0-1".to_string()),
            (1, "0:2-3".to_string())
        ]
    );
    assert_eq!(order_state(&state, 1), OrderState::Active);
    // Placements take the offer's price, never above the order's max.
    for p in state.market().live_placements_of_order(1) {
        assert_eq!(p.price, state.market().offer(p.offer).unwrap().price);
    }
}

#[test]
fn unused_offers_stay_open_and_withdrawable_and_offers_need_a_bond() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let state = block_of(&state, &keys, vec![offer(&state, 0, "0:0-7", "0.001")]);
    let state = until(state, &keys, 20);
    assert_eq!(state.market().offer(1).unwrap().state, OfferState::Open);
    let withdraw = tx(&state, &operator(0), TxKind::OfferWithdraw { offer: 1 });
    let state = block_of(&state, &keys, vec![withdraw]);
    assert_eq!(
        state.market().offer(1).unwrap().state,
        OfferState::Withdrawn
    );
    let twice = tx(&state, &operator(0), TxKind::OfferWithdraw { offer: 1 });
    assert_eq!(rejection(&state, &keys, twice), TxError::OfferNotOpen(1));
    let not_mine = tx(&state, &operator(1), TxKind::OfferWithdraw { offer: 1 });
    assert_eq!(
        rejection(&state, &keys, not_mine),
        TxError::NotYours(operator(1).address())
    );
    // Operator 1 never bonded.
    assert!(matches!(
        rejection(&state, &keys, offer(&state, 1, "0:0", "0.001")),
        TxError::InsufficientBond { .. }
    ));
}

#[test]
fn a_closed_order_refunds_exactly_once_with_one_reason() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let state = block_of(&state, &keys, vec![offer(&state, 0, "0:0-3", "0.001")]);
    let alice = keys.alice.address();
    let before = state.account(&alice).balance;
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0-3", 1, "0.01", "5"))],
    );
    assert_eq!(
        state.account(&alice).balance,
        before.checked_sub(kvr("5")).unwrap()
    );
    assert_eq!(order_state(&state, 1), OrderState::Active);
    let close = tx(&state, &keys.alice, TxKind::OrderClose { order: 1 });
    let state = block_of(&state, &keys, vec![close]);
    let closed_at = state.height();
    let closed = state.market().order(1).unwrap();
    assert_eq!(closed.state, OrderState::Closed(CloseReason::Buyer));
    let lease = state.market().placement(1).unwrap();
    assert_eq!(lease.state, PlacementState::OrderClosed(CloseReason::Buyer));
    // The escrow waits out the grace: a credit for traffic served before the close, landing
    // after it, is still paid at the placement's price (closing skips no work done).
    assert_eq!((closed.escrow, closed.refunded), (kvr("5"), Amount::ZERO));
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 1, 2_000_000)]);
    let worker = state.account(&operator(0).address());
    assert_eq!(worker.pending_total(), kvr("0.002"));
    let state = until(state, &keys, closed_at + CLOSE_GRACE_BLOCKS);
    let closed = state.market().order(1).unwrap();
    assert_eq!(
        (closed.escrow, closed.refunded),
        (Amount::ZERO, kvr("4.998"))
    );
    assert_eq!(
        state.account(&alice).balance,
        before.checked_sub(kvr("0.002")).unwrap()
    );
    // After the refund, a later credit of the order pays nothing.
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 1, 9_000_000)]);
    assert_eq!(state.market().order(1).unwrap().paid, kvr("0.002"));
    // Closing again, depositing, or letting its end height pass refunds nothing more.
    let again = tx(&state, &keys.alice, TxKind::OrderClose { order: 1 });
    assert_eq!(rejection(&state, &keys, again), TxError::OrderClosed(1));
    let deposit = tx(
        &state,
        &keys.alice,
        TxKind::OrderDeposit {
            order: 1,
            amount: kvr("1"),
        },
    );
    assert_eq!(rejection(&state, &keys, deposit), TxError::OrderClosed(1));
    // Only the buyer closes.
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0", 1, "0.01", "1"))],
    );
    let theirs = tx(&state, &keys.bob, TxKind::OrderClose { order: 2 });
    assert_eq!(
        rejection(&state, &keys, theirs),
        TxError::NotYours(keys.bob.address())
    );
    // The offer outlives the order and serves the next one.
    assert_eq!(state.market().offer(1).unwrap().state, OfferState::Open);
    assert_eq!(placed(&state, 2), vec![(1, "0:0".to_string())]);
}

#[test]
fn escrow_pays_the_placed_worker_at_its_price_pauses_when_overdrawn_and_resumes_on_deposit() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0, 1]);
    let state = block_of(&state, &keys, vec![offer(&state, 0, "0:0-3", "0.5")]);
    // Escrow for the 0.5 reserve and 1.5 KVR of pay.
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0-3", 1, "1", "2"))],
    );
    assert_eq!(order_state(&state, 1), OrderState::Active);
    let worker = operator(0).address();
    // 3 units at 0.5 KVR: 1.5 KVR from the escrow into pending pay tagged with the order.
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 1, 3_000_000)]);
    let pending = &state.account(&worker).pending;
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].amount, pending[0].order), (kvr("1.5"), 1));
    let o = state.market().order(1).unwrap();
    assert_eq!((o.escrow, o.paid), (kvr("0.5"), kvr("1.5")));
    assert_eq!(order_state(&state, 1), OrderState::Active);
    // 2 more units: only 0.5 is left, paid; the escrow is below one block's pay: paused.
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 1, 5_000_000)]);
    let o = state.market().order(1).unwrap();
    assert_eq!((o.escrow, o.paid), (Amount::ZERO, kvr("2")));
    assert_eq!(o.state, OrderState::Paused);
    // Operator 1 is not placed for the order: its traffic under it is paid nothing.
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 1, 1, 9_000_000)]);
    assert_eq!(
        state.account(&operator(1).address()).pending_total(),
        Amount::ZERO
    );
    // A deposit resumes it; anyone may deposit.
    let deposit = tx(
        &state,
        &keys.bob,
        TxKind::OrderDeposit {
            order: 1,
            amount: kvr("1"),
        },
    );
    let state = block_of(&state, &keys, vec![deposit]);
    assert_eq!(order_state(&state, 1), OrderState::Active);
    // The pay settles after the challenge window like any other: 100 KVR less the bond,
    // and the 2 KVR of pay.
    let settled = state.height() + 4;
    let state = until(state, &keys, settled);
    assert_eq!(state.account(&worker).balance, kvr("92"));
}

/// A credit whose count, at the worker's placement price, earns more than an amount holds
/// is refused when checked, before a block (at the pool's far lower rate it would fit): one
/// that failed only in a block would leave its gateway's later credits waiting on the gap.
#[test]
fn a_credit_that_would_overflow_at_its_placement_price_is_refused_when_checked() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let state = block_of(&state, &keys, vec![offer(&state, 0, "0:0-3", "50")]);
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0-3", 1, "50", "60"))],
    );
    assert_eq!(order_state(&state, 1), OrderState::Active);
    let bytes = 1_000_000_000_000_000;
    assert!(
        state.genesis().earned(bytes).is_some(),
        "fits at the pool's rate"
    );
    let huge = credit(&state, &keys, 0, 1, bytes);
    assert_eq!(
        crate::tx::check_stateful(&state, &huge),
        Err(TxError::Overflow)
    );
    // Outside the order, at the pool's rate, the same count is fine.
    let pool = credit(&state, &keys, 0, 0, bytes);
    assert_eq!(crate::tx::check_stateful(&state, &pool), Ok(()));
}

/// Operators 0 and 1 offer experts 0:0-3 at 0.001 and 0.002; order 1 wants one replica of
/// them and is placed on operator 0's offer (offer 1).
fn placed_on_the_cheaper_of_two(keys: &TestKeys) -> State {
    let state = bonded(keys, &[0, 1]);
    let offers = vec![
        offer(&state, 0, "0:0-3", "0.001"),
        offer(&state, 1, "0:0-3", "0.002"),
    ];
    let state = block_of(&state, keys, offers);
    let order = order(&state, keys, new_order("0:0-3", 1, "0.01", "1"));
    let state = block_of(&state, keys, vec![order]);
    assert_eq!(placed(&state, 1), vec![(1, "0:0-3".to_string())]);
    state
}

#[test]
fn a_withdrawn_offers_experts_are_placed_on_another_offer_at_once() {
    let keys = TestKeys::new();
    let state = placed_on_the_cheaper_of_two(&keys);
    let withdraw = tx(&state, &operator(0), TxKind::OfferWithdraw { offer: 1 });
    let state = block_of(&state, &keys, vec![withdraw]);
    assert_eq!(
        state.market().placement(1).unwrap().state,
        PlacementState::OfferWithdrawn
    );
    assert_eq!(placed(&state, 1), vec![(2, "0:0-3".to_string())]);
    assert_eq!(order_state(&state, 1), OrderState::Active);
}

#[test]
fn orders_and_offers_end_at_their_heights_and_unplaced_or_unfunded_orders_close() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let h = state.height();
    let mut short = new_order("0:0", 1, "0.01", "1");
    short.end_height = h + 3;
    let state = block_of(&state, &keys, vec![order(&state, &keys, short)]);
    assert_eq!(order_state(&state, 1), OrderState::Open);
    let state = until(state, &keys, h + 3);
    assert_eq!(
        order_state(&state, 1),
        OrderState::Closed(CloseReason::Expired)
    );
    let state = until(state, &keys, h + 3 + CLOSE_GRACE_BLOCKS);
    assert_eq!(state.market().order(1).unwrap().refunded, kvr("1"));

    // An order nobody can serve closes as unfillable.
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("9:9", 1, "0.01", "1"))],
    );
    let created = state.height();
    let state = until(state, &keys, created + UNPLACED_BLOCKS_BEFORE_CLOSE - 1);
    assert_eq!(order_state(&state, 2), OrderState::Open);
    let state = block_of(&state, &keys, Vec::new());
    assert_eq!(
        order_state(&state, 2),
        OrderState::Closed(CloseReason::Unfillable)
    );

    // An offer past its expiry ends, and its placements with it.
    let mut brief = NewOffer {
        model: "m".into(),
        experts: "0:0".parse().unwrap(),
        price: kvr("0.5"),
        expiry_height: state.height() + 3,
    };
    let state = block_of(
        &state,
        &keys,
        vec![tx(&state, &operator(0), TxKind::OfferCreate(brief.clone()))],
    );
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0", 1, "1", "1"))],
    );
    assert_eq!(placed(&state, 3), vec![(1, "0:0".to_string())]);
    let state = until(state, &keys, brief.expiry_height);
    assert_eq!(state.market().offer(1).unwrap().state, OfferState::Expired);
    assert_eq!(placed(&state, 3), Vec::new());
    assert_eq!(order_state(&state, 3), OrderState::Open);

    // A paused order that is never topped up closes for insufficient funds.
    brief.expiry_height = 1_000_000;
    let state = block_of(
        &state,
        &keys,
        vec![tx(&state, &operator(0), TxKind::OfferCreate(brief))],
    );
    assert_eq!(order_state(&state, 3), OrderState::Active);
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 3, 2_000_000)]);
    assert_eq!(order_state(&state, 3), OrderState::Paused);
    let paused = state.height();
    let state = until(state, &keys, paused + PAUSED_BLOCKS_BEFORE_CLOSE);
    let closed = state.market().order(3).unwrap();
    assert_eq!(
        closed.state,
        OrderState::Closed(CloseReason::InsufficientFunds)
    );
    assert_eq!(placed(&state, 3), Vec::new());
}

#[test]
fn bad_market_transactions_are_refused_before_anything_changes() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let stateless = |kind: TxKind| {
        let tx = tx(&state, &keys.alice, kind);
        crate::tx::check_stateless(state.genesis(), vec![tx])
            .remove(0)
            .err()
    };
    let mut bad = new_order("0:0", 0, "0.01", "1");
    assert_eq!(
        stateless(TxKind::OrderCreate(bad.clone())),
        Some(TxError::BadReplicas(0))
    );
    bad.replicas = 1;
    bad.deposit = kvr("0.001");
    assert!(matches!(
        stateless(TxKind::OrderCreate(bad.clone())),
        Some(TxError::DepositBelowPrice { .. })
    ));
    bad.deposit = kvr("1");
    bad.model = String::new();
    assert!(matches!(
        stateless(TxKind::OrderCreate(bad.clone())),
        Some(TxError::BadModelId(_))
    ));
    bad.model = "m".into();
    bad.experts = Selection(vec![Rect {
        layers: (3, 1),
        experts: (0, 0),
    }]);
    assert!(matches!(
        stateless(TxKind::OrderCreate(bad)),
        Some(TxError::BadSelection(_))
    ));
    let zero = TxKind::OrderDeposit {
        order: 1,
        amount: Amount::ZERO,
    };
    assert_eq!(stateless(zero), Some(TxError::ZeroAmount));
    // Stateful: funds, an end ahead, an order that exists.
    let rich = order(&state, &keys, new_order("0:0", 1, "0.01", "1000000"));
    assert!(matches!(
        rejection(&state, &keys, rich),
        TxError::InsufficientFunds { .. }
    ));
    let mut past = new_order("0:0", 1, "0.01", "1");
    past.end_height = state.height() + 1;
    let past = order(&state, &keys, past);
    assert!(matches!(
        rejection(&state, &keys, past),
        TxError::EndNotInFuture { .. }
    ));
    let ghost = tx(
        &state,
        &keys.alice,
        TxKind::OrderDeposit {
            order: 7,
            amount: kvr("1"),
        },
    );
    assert_eq!(rejection(&state, &keys, ghost), TxError::UnknownOrder(7));
    // An operator's open offers are bounded.
    let mut state = state;
    for _ in 0..MAX_OPEN_OFFERS_PER_OPERATOR {
        state = block_of(&state, &keys, vec![offer(&state, 0, "0:0", "0.001")]);
    }
    assert_eq!(
        rejection(&state, &keys, offer(&state, 0, "0:0", "0.001")),
        TxError::TooManyOpenOffers(MAX_OPEN_OFFERS_PER_OPERATOR)
    );
}

#[test]
fn evidence_returns_escrow_pay_to_the_escrow_or_to_the_buyer_once_closed() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0]);
    let state = block_of(&state, &keys, vec![offer(&state, 0, "0:0-3", "0.5")]);
    let state = block_of(
        &state,
        &keys,
        vec![order(&state, &keys, new_order("0:0-3", 1, "1", "4"))],
    );
    let state = block_of(&state, &keys, vec![credit(&state, &keys, 0, 1, 2_000_000)]);
    assert_eq!(state.market().order(1).unwrap().escrow, kvr("3"));
    let session = SessionKey {
        hub: keys.hub.address(),
        session_id: 1,
    };
    let mut staged = crate::state::Staged::new(&state);
    return_pay(&mut staged, 1, kvr("1")).unwrap();
    let mut live = state.clone();
    live.write(staged.into_writes());
    let o = live.market().order(1).unwrap();
    assert_eq!((o.escrow, o.paid), (kvr("4"), Amount::ZERO));
    // Once closed and refunded, the same return goes to the buyer and counts as refunded.
    let close = tx(&state, &keys.alice, TxKind::OrderClose { order: 1 });
    let closed = block_of(&state, &keys, vec![close]);
    let refunded_at = closed.height() + CLOSE_GRACE_BLOCKS;
    let closed = until(closed, &keys, refunded_at);
    let before = closed.account(&keys.alice.address()).balance;
    let mut staged = crate::state::Staged::new(&closed);
    return_pay(&mut staged, 1, kvr("1")).unwrap();
    let mut after = closed.clone();
    after.write(staged.into_writes());
    assert_eq!(
        after.account(&keys.alice.address()).balance,
        before.checked_add(kvr("1")).unwrap()
    );
    assert_eq!(after.market().order(1).unwrap().refunded, kvr("4"));
    assert_eq!(
        state
            .receipt_mark(&MeterKey { session, order: 1 })
            .map(|m| m.cumulative_bytes),
        Some(2_000_000)
    );
}

/// One step of a random market history.
#[derive(Clone, Debug)]
enum Op {
    Offer {
        op: u8,
        layer: u16,
        experts: u16,
        price: u64,
    },
    Withdraw {
        op: u8,
        offer: u64,
    },
    Order {
        layers: u16,
        replicas: u8,
        max_price: u64,
        deposit: u64,
        blocks: u64,
    },
    Deposit {
        order: u64,
        amount: u64,
    },
    Close {
        order: u64,
    },
    Credit {
        op: u8,
        order: u64,
        bytes: u64,
    },
    Transfer {
        amount: u64,
    },
    Empty,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 0u16..3, 1u16..4, 1u64..5).prop_map(|(op, layer, experts, price)| Op::Offer {
            op,
            layer,
            experts,
            price: price * 100_000_000
        }),
        (0u8..4, 1u64..8).prop_map(|(op, offer)| Op::Withdraw { op, offer }),
        (1u16..3, 1u8..3, 1u64..5, 1u64..5, 2u64..30).prop_map(
            |(layers, replicas, max_price, deposit, blocks)| Op::Order {
                layers,
                replicas,
                max_price: max_price * 100_000_000,
                deposit: deposit * 1_000_000_000,
                blocks
            }
        ),
        (1u64..5, 1u64..3).prop_map(|(order, amount)| Op::Deposit {
            order,
            amount: amount * 1_000_000_000
        }),
        (1u64..5).prop_map(|order| Op::Close { order }),
        (0u8..4, 0u64..5, 1u64..20).prop_map(|(op, order, bytes)| Op::Credit {
            op,
            order,
            bytes: bytes * 1_000_000
        }),
        (1u64..3).prop_map(|amount| Op::Transfer {
            amount: amount * 1_000_000_000
        }),
        Just(Op::Empty),
    ]
}

/// Every invariant the market promises, on one state.
fn check_invariants(state: &State, supply: u128) -> Result<(), TestCaseError> {
    prop_assert_eq!(state.total_money(), supply);
    let market = state.market();
    for placement in market.placements().filter(|p| p.is_live()) {
        let order = market.order(placement.order).unwrap();
        let offer = market.offer(placement.offer).unwrap();
        prop_assert!(!order.state.is_closed());
        prop_assert_eq!(offer.state, OfferState::Open);
        prop_assert!(placement.price <= order.max_price);
        prop_assert_eq!(placement.price, offer.price);
    }
    for order in market.orders() {
        if order.state.is_closed() {
            prop_assert_eq!(market.live_placements_of_order(order.id).count(), 0);
            // Refunded once its grace is over, and then holding nothing.
            let due = order.since_height + CLOSE_GRACE_BLOCKS;
            prop_assert_eq!(order.refund_height == 0, state.height() >= due);
            if order.refund_height == 0 {
                prop_assert_eq!(order.escrow, Amount::ZERO);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn supply_is_conserved_placements_stay_valid_and_matching_is_deterministic(
        blocks in proptest::collection::vec(proptest::collection::vec(op(), 0..5), 1..25)
    ) {
        let keys = TestKeys::new();
        let mut state = bonded(&keys, &[0, 1, 2]);
        let supply = state.total_money();
        for ops in blocks {
            let mut txs = Vec::new();
            let mut nonces = std::collections::BTreeMap::new();
            let mut next = |key: &Keypair, kind: TxKind| {
                let nonce = nonces.entry(key.address()).or_insert(state.account(&key.address()).nonce);
                let tx = kind.signed("kvasir-test", key, *nonce);
                *nonce += 1;
                tx
            };
            for op in ops {
                let tx = match op {
                    Op::Offer { op, layer, experts, price } => next(&operator(op), TxKind::OfferCreate(NewOffer {
                        model: "m".into(),
                        experts: Selection(vec![Rect { layers: (layer, layer), experts: (0, experts) }]),
                        price: Amount::from_base_units(price),
                        expiry_height: state.height() + 20,
                    })),
                    Op::Withdraw { op, offer } => next(&operator(op), TxKind::OfferWithdraw { offer }),
                    Op::Order { layers, replicas, max_price, deposit, blocks } => next(&keys.alice, TxKind::OrderCreate(NewOrder {
                        model: "m".into(),
                        experts: Selection(vec![Rect { layers: (0, layers), experts: (0, 3) }]),
                        replicas,
                        max_price: Amount::from_base_units(max_price),
                        deposit: Amount::from_base_units(deposit),
                        end_height: state.height() + blocks,
                        delegate: None,
                    })),
                    Op::Deposit { order, amount } => next(&keys.bob, TxKind::OrderDeposit { order, amount: Amount::from_base_units(amount) }),
                    Op::Close { order } => next(&keys.alice, TxKind::OrderClose { order }),
                    Op::Credit { op, order, bytes } => {
                        let cumulative = state
                            .receipt_mark(&MeterKey { session: SessionKey { hub: keys.hub.address(), session_id: u64::from(op) + 1 }, order })
                            .map_or(0, |m| m.cumulative_bytes) + bytes;
                        let receipt = Receipt {
                            chain_id: "kvasir-test".into(),
                            hub: keys.hub.address(),
                            session_id: u64::from(op) + 1,
                            worker: operator(op).address(),
                            order,
                            cumulative_bytes: cumulative,
                        };
                        next(&keys.gateway, TxKind::Credit(receipt.sign(&keys.hub)))
                    }
                    Op::Transfer { amount } => next(&keys.alice, TxKind::Transfer { to: keys.bob.address(), amount: Amount::from_base_units(amount) }),
                    Op::Empty => continue,
                };
                txs.push(tx);
            }
            // Failing transactions are left out (and change nothing); the rest make a block
            // that another node, applying it, turns into the same state.
            let produced = produce_block(&state, &verified(&state, txs), &keys.validator, state.timestamp_ms() + 1000).unwrap();
            let (replayed, _) = apply_block(&state, &produced.block).unwrap();
            prop_assert_eq!(replayed.root(), produced.state.root());
            state = produced.state;
            check_invariants(&state, supply)?;
        }
    }
}

#[test]
fn the_market_survives_a_store_reopen_with_the_same_root() {
    use crate::certificate::Certificate;
    use crate::store::{SledStore, Storage};
    let keys = TestKeys::new();
    let (genesis, _) = market_genesis();
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::create(dir.path(), &genesis).unwrap();
    let mut state = store.load_state().unwrap();
    type Step<'a> = Box<dyn Fn(&State) -> Vec<SignedTx> + 'a>;
    let steps: Vec<Step> = vec![
        Box::new(|s| vec![tx(s, &operator(0), TxKind::Bond { amount: kvr("10") })]),
        Box::new(|s| vec![offer(s, 0, "0:0-3,1:0-1", "0.5")]),
        Box::new(|s| vec![order(s, &keys, new_order("0-1:0-1", 1, "1", "3"))]),
        Box::new(|s| vec![credit(s, &keys, 0, 1, 1_000_000)]),
        Box::new(|s| vec![credit(s, &keys, 0, 0, 1_000_000)]),
    ];
    for step in steps {
        let txs = verified(&state, step(&state));
        let produced =
            produce_block(&state, &txs, &keys.validator, state.timestamp_ms() + 10).unwrap();
        assert!(produced.rejected.is_empty(), "{:?}", produced.rejected);
        let certificate = Certificate::for_block(&produced.block, 0, &[&keys.validator]);
        store
            .commit(&produced.block, &produced.changes, &certificate)
            .unwrap();
        state = produced.state;
    }
    drop(store);
    let reopened = SledStore::open(dir.path()).unwrap().load_state().unwrap();
    assert_eq!(reopened.root(), state.root());
    let market = |s: &State| {
        let m = s.market();
        (
            m.offers().cloned().collect::<Vec<_>>(),
            m.orders().cloned().collect::<Vec<_>>(),
            m.placements().cloned().collect::<Vec<_>>(),
        )
    };
    assert_eq!(market(&reopened), market(&state));
    assert_eq!(placed(&reopened, 1), vec![(1, "0-1:0-1".to_string())]);
    assert_eq!(reopened.receipts().count(), 2);
}

#[test]
fn an_operator_that_unbonds_loses_its_placements_and_the_order_moves_on() {
    let keys = TestKeys::new();
    let state = placed_on_the_cheaper_of_two(&keys);
    // Below min_bond the operator can be neither dispatched to nor paid: its placement
    // closes at the boundary, and the order is placed on the next offer at once.
    let unbond = tx(&state, &operator(0), TxKind::Unbond { amount: kvr("5") });
    let state = block_of(&state, &keys, vec![unbond]);
    assert_eq!(
        state.market().placement(1).unwrap().state,
        PlacementState::OperatorIneligible
    );
    assert_eq!(placed(&state, 1), vec![(2, "0:0-3".to_string())]);
    assert_eq!(order_state(&state, 1), OrderState::Active);
}

#[test]
fn an_order_that_exhausts_its_share_of_matching_holds_up_no_other() {
    let keys = TestKeys::new();
    let state = bonded(&keys, &[0, 1]);
    // Operator 0 offers all of a 64 x 256 model but the last expert of each layer, cheapest;
    // operator 1 offers the same, 64 times over, dearer. For an order of every expert, once
    // operator 0 is placed each of operator 1's offers adds nothing and costs 16,320.
    let slice = |op: u8, price: &str, nonce: u64| {
        let new = NewOffer {
            model: "m".into(),
            experts: "0-63:0-254".parse().unwrap(),
            price: kvr(price),
            expiry_height: 1_000_000,
        };
        TxKind::OfferCreate(new).signed("kvasir-test", &operator(op), nonce)
    };
    let first = state.account(&operator(0).address()).nonce;
    let mut state = block_of(&state, &keys, vec![slice(0, "0.001", first)]);
    for _ in 0..8 {
        let nonce = state.account(&operator(1).address()).nonce;
        let txs = (0..8).map(|i| slice(1, "0.002", nonce + i)).collect();
        state = block_of(&state, &keys, txs);
    }
    let huge = order(&state, &keys, new_order("0-63:0-255", 1, "0.01", "10"));
    let state = block_of(&state, &keys, vec![huge]);
    let big = state.market().order(1).unwrap();
    assert_eq!(big.state, OrderState::Degraded);
    assert!(
        big.rematch,
        "its matching ran out of work and goes on later"
    );
    // A small order after it is placed at its first boundary all the same.
    let small = tx(
        &state,
        &keys.alice,
        TxKind::OrderCreate(new_order("0:0", 1, "0.01", "1")),
    );
    let state = block_of(&state, &keys, vec![small]);
    assert_eq!(order_state(&state, 2), OrderState::Active);
    // And blocks go on being made and applied while the big one keeps trying.
    let later = state.height() + 3;
    let state = until(state, &keys, later);
    assert_eq!(order_state(&state, 1), OrderState::Degraded);
}

/// On a format-2 chain an offer or order names a pinned model by its id or its short name,
/// with a selection within the model's shape; anything else is refused with its reason
/// before any escrow moves. The market keeps the pin's id, so an offer made by name meets
/// an order made by id.
#[test]
fn on_format_2_the_market_takes_pinned_models_by_id_or_name_within_their_shape() {
    let (mut genesis, keys) = market_genesis();
    genesis.params.format = crate::genesis::FORMAT;
    genesis.params.fees = Some(crate::genesis::tests::test_fees());
    let pin = &mut genesis.models[0];
    pin.name = "small".into();
    pin.shape = Some(crate::genesis::ModelShape {
        layers: 4,
        experts: 8,
        expert_bytes: 1 << 10,
    });
    pin.arithmetic = 1;
    genesis.validate().unwrap();
    let signed = |state: &State, key: &Keypair, kind: TxKind| kind.signed_next(state, key);
    let state = State::from_genesis(genesis);
    let bond = TxKind::Bond { amount: kvr("10") };
    let state = block_of(&state, &keys, vec![signed(&state, &operator(0), bond)]);
    let by_name = NewOffer {
        model: "small".into(),
        experts: "0-3:0-7".parse().unwrap(),
        price: kvr("0.001"),
        expiry_height: 1_000_000,
    };
    let offer = signed(&state, &operator(0), TxKind::OfferCreate(by_name));
    let state = block_of(&state, &keys, vec![offer]);
    assert_eq!(state.market().offer(1).unwrap().model, "m");
    let balance = state.account(&keys.alice.address()).balance;
    for (model, experts, says) in [
        ("nonsense", "0:0", "neither the id nor the name"),
        (
            "small",
            "0-4:0",
            "past model small, which has 4 layers of 8 experts",
        ),
        ("m", "0:0-8", "past model small"),
    ] {
        let new = NewOrder {
            model: model.into(),
            experts: experts.parse().unwrap(),
            ..new_order("0:0", 1, "0.001", "1")
        };
        let tx = signed(&state, &keys.alice, TxKind::OrderCreate(new));
        let refused = rejection(&state, &keys, tx).to_string();
        assert!(refused.contains(says), "{model} {experts}: {refused}");
    }
    assert_eq!(state.account(&keys.alice.address()).balance, balance);
    let by_id = signed(
        &state,
        &keys.alice,
        TxKind::OrderCreate(new_order("0-3:0-7", 1, "0.001", "1")),
    );
    let state = block_of(&state, &keys, vec![by_id]);
    assert_eq!(state.market().order(1).unwrap().model, "m");
    assert_eq!(placed(&state, 1), vec![(1, "0-3:0-7".to_string())]);
}
