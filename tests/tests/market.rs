//! The market as its users drive it, through `kvasir-wallet` against a real ledger node:
//! operators offer, a buyer orders with escrow, the chain places the order on the cheapest
//! offers from distinct operators, a withdrawn offer degrades it, closing refunds the escrow
//! once, and every read comes back through the REST API.

use kvasir_api::market::{CoverageView, OfferPage};
use kvasir_api::reports::{MarketTxReport, OrderReport};
use kvasir_api::Client;
use kvasir_ledger::Amount;
use kvasir_tests::wallet::{one_line_error, Node};

fn kvr(text: &str) -> Amount {
    Amount::parse(text).unwrap()
}

#[test]
fn operators_offer_a_buyer_orders_the_chain_places_and_closing_refunds_once() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain");
    // The template chain has bonds (min_bond 10), which offers need.
    kvasir_tests::genesis_init(&chain);
    let node = Node::start(&chain, &dir.path().join("ledger"));
    let key = |name: &str| dir.path().join(format!("{name}.key"));
    let (cheap, dear, buyer) = (key("cheap"), key("dear"), key("buyer"));
    node.funded_key(&chain, &cheap, "30");
    node.funded_key(&chain, &dear, "30");
    let buyer_address = node.funded_key(&chain, &buyer, "50");

    // Without a bond an operator cannot offer.
    let offer = |price: &'static str| {
        [
            "offer",
            "create",
            "--model",
            "m",
            "--experts",
            "0-1:0-3",
            "--price",
            price,
        ]
    };
    one_line_error(&node.wallet(&dear, &offer("0.002")), "insufficient bond");
    for operator in [&dear, &cheap] {
        let bonded = node.wallet(operator, &["bond", "10"]);
        assert!(bonded.status.success());
    }
    let created: MarketTxReport = serde_json::from_str(&node.json(&dear, &offer("0.002"))).unwrap();
    let dear_offer = created.offer.unwrap();
    assert_eq!(
        (dear_offer.state.as_str(), dear_offer.price.kvr),
        ("open", kvr("0.002"))
    );
    let created: MarketTxReport =
        serde_json::from_str(&node.json(&cheap, &offer("0.001"))).unwrap();
    let cheap_offer = created.offer.unwrap();

    // The buyer orders two replicas; the chain places it at once on both operators.
    let ordered: MarketTxReport = serde_json::from_str(&node.json(
        &buyer,
        &[
            "order",
            "create",
            "--model",
            "m",
            "--experts",
            "0-1:0-3",
            "--replicas",
            "2",
            "--max-price",
            "0.01",
            "--deposit",
            "5",
            "--blocks",
            "1000",
        ],
    ))
    .unwrap();
    let order = ordered.order.unwrap();
    assert_eq!(order.escrow.kvr, kvr("5"));
    let client = Client::new(&node.url);
    let id = order.id.to_string();
    let show = |node: &Node| -> OrderReport {
        serde_json::from_str(&node.json(&buyer, &["order", "show", &id])).unwrap()
    };
    let report = show(&node);
    assert_eq!(report.order.state, "active", "{report:?}");
    let offers: Vec<u64> = report.placements.iter().map(|p| p.offer).collect();
    assert_eq!(
        offers,
        vec![cheap_offer.id, dear_offer.id],
        "cheapest first"
    );
    assert_eq!(report.order.reserve.kvr, kvr("0.003"));
    let coverage: CoverageView =
        serde_json::from_str(&node.json(&buyer, &["market", "coverage", "m"])).unwrap();
    assert_eq!(coverage.experts.len(), 8);
    for expert in &coverage.experts {
        assert_eq!((expert.placements, expert.replicas_wanted), (2, 2));
        assert_eq!(expert.min_price.unwrap().kvr, kvr("0.001"));
        assert_eq!(expert.max_price.unwrap().kvr, kvr("0.002"));
    }

    // The dear operator withdraws: the order runs on one replica, degraded.
    let withdrawn = node.wallet(&dear, &["offer", "withdraw", &dear_offer.id.to_string()]);
    assert!(withdrawn.status.success());
    let report = show(&node);
    assert_eq!(report.order.state, "degraded", "{report:?}");
    let closed = &report.placements[1];
    assert_eq!(closed.close_reason.as_deref(), Some("offer_withdrawn"));

    // The buyer closes: the whole escrow comes back, once, with one reason.
    let before = client
        .account(&buyer_address.parse().unwrap())
        .unwrap()
        .balance
        .kvr;
    let done: MarketTxReport =
        serde_json::from_str(&node.json(&buyer, &["order", "close", &id])).unwrap();
    let order = done.order.unwrap();
    assert_eq!(
        (order.state.as_str(), order.close_reason.as_deref()),
        ("closed", Some("buyer"))
    );
    assert_eq!(
        (order.escrow.kvr, order.refunded.kvr),
        (Amount::ZERO, kvr("5"))
    );
    let after = client
        .account(&buyer_address.parse().unwrap())
        .unwrap()
        .balance
        .kvr;
    assert_eq!(after, before.checked_add(kvr("5")).unwrap());
    one_line_error(&node.wallet(&buyer, &["order", "close", &id]), "is closed");
    one_line_error(
        &node.wallet(&buyer, &["order", "deposit", &id, "1"]),
        "is closed",
    );

    // The unused-now offer stays open and listed; a stranger cannot withdraw it.
    let listed: OfferPage =
        serde_json::from_str(&node.json(&cheap, &["offer", "list", "--mine"])).unwrap();
    assert_eq!(listed.offers.len(), 1);
    assert_eq!(
        (listed.offers[0].state.as_str(), listed.offers[0].placements),
        ("open", 0)
    );
    let stranger = node.wallet(&buyer, &["offer", "withdraw", &cheap_offer.id.to_string()]);
    one_line_error(&stranger, "not the owner");
    // Reads of what does not exist are the API's own 404, in one line.
    one_line_error(
        &node.wallet(&buyer, &["order", "show", "99"]),
        "no order 99",
    );
}
