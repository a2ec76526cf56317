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
    // The template chain has bonds (min_bond 10), which offers need, and pins the model they
    // offer: its short name is its directory's, `tiny`.
    let model = kvasir_tests::model("tiny");
    kvasir_tests::genesis_init_with(&chain, &["--model", kvasir_tests::path_str(&model)]);
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
            "tiny",
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

    // The buyer orders two replicas, naming the model by its id where the operators named
    // it by its short name; the chain places it at once on both operators.
    let tiny_id = model_id(&model);
    let ordered: MarketTxReport = serde_json::from_str(&node.json(
        &buyer,
        &[
            "order",
            "create",
            "--model",
            &tiny_id,
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
        serde_json::from_str(&node.json(&buyer, &["market", "coverage", "tiny"])).unwrap();
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

    // The buyer closes: the whole escrow comes back, once, with one reason, after the grace.
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
    // The escrow waits out the grace (credits of work done before the close land in it)
    // and is refunded at its end, once: the ledger's unit tests watch the refund itself.
    assert_eq!(order.refund_height, Some(done.height + 60));
    assert_eq!(
        (order.escrow.kvr, order.refunded.kvr),
        (kvr("5"), Amount::ZERO)
    );
    let after = client
        .account(&buyer_address.parse().unwrap())
        .unwrap()
        .balance
        .kvr;
    // Nothing came back yet: the balance only paid the close's fee.
    let fee = done.fee.expect("a fee on a format-2 chain");
    let fee = fee.burned.checked_add(fee.tip).unwrap();
    assert_eq!(after, before.checked_sub(fee).unwrap());
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

/// A worker's key file is its operator key: `kvasir-wallet` with it against the ledger.
fn wallet_json(ledger: &str, key: &std::path::Path, args: &[&str]) -> String {
    let mut all = vec!["--url", ledger, "--keyfile", kvasir_tests::path_str(key)];
    all.extend(args);
    all.push("--json");
    let output = kvasir_tests::wallet::wallet(&all, None);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        kvasir_tests::stderr(&output)
    );
    kvasir_tests::stdout(&output)
}

#[test]
fn the_backbone_of_an_order_dispatches_only_to_placed_workers_who_are_paid_from_escrow() {
    use kvasir_api::ledger::AccountView;
    use kvasir_tests::swarm::{assert_all_remote_and_identical, Swarm};

    let mut swarm = Swarm::start_with("tiny", true);
    let ledger = swarm.ledger_url.clone().unwrap();
    // Two workers hold every expert; only the first offers them (at 0.01 KVR a unit, not
    // the pool's 0.007), so only it is placed.
    let placed = swarm.add_worker("*:*");
    let unplaced = swarm.add_worker("*:*");
    let (placed_key, unplaced_key) = (swarm.worker_key(placed), swarm.worker_key(unplaced));
    // Its operator pays the offer's fee: the faucet sends the key 0.01 KVR for it.
    swarm.top_up(&ledger, &placed_key, "0.01");
    let offered: MarketTxReport = serde_json::from_str(&wallet_json(
        &ledger,
        &placed_key,
        &[
            "offer",
            "create",
            "--model",
            &model_id(&swarm.model),
            // Every expert: `*` resolved by the wallet against the shape the chain pins.
            "--experts",
            "*:*",
            "--price",
            "0.01",
        ],
    ))
    .unwrap();
    assert_eq!(offered.offer.unwrap().state, "open");
    let offer_fee = offered.fee.expect("a fee on a format-2 chain");
    let offer_fee = offer_fee.burned.checked_add(offer_fee.tip).unwrap();

    // The backbone's key is the buyer: funded from the faucet, it orders every expert.
    let faucet = swarm.dir.path().join("chain/keys/faucet.key");
    let buyer = swarm.backbone_key().to_path_buf();
    let buyer_address = kvasir_keyfile::address(&buyer).unwrap().to_string();
    wallet_json(&ledger, &faucet, &["transfer", &buyer_address, "3"]);
    let ordered: MarketTxReport = serde_json::from_str(&wallet_json(
        &ledger,
        &buyer,
        &[
            "order",
            "create",
            "--model",
            &model_id(&swarm.model),
            "--experts",
            "*:*",
            "--max-price",
            "0.02",
            "--deposit",
            "2",
        ],
    ))
    .unwrap();
    let order = ordered.order.unwrap();
    assert_eq!((order.state.as_str(), order.placements), ("active", 1));

    let id = order.id.to_string();
    let remote = swarm.backbone_with("*:*", "The capital of France is", 12, &["--order", &id]);
    let local = swarm.local("The capital of France is", 12);
    assert_all_remote_and_identical(&remote, &local);

    // Only the placed worker's session metered anything, under the order.
    let listing = Client::new(&format!("http://{}", swarm.registry_addr))
        .all_receipts()
        .unwrap();
    let placed_address = kvasir_keyfile::address(&placed_key).unwrap();
    assert!(!listing.receipts.is_empty());
    for receipt in &listing.receipts {
        assert_eq!(receipt.worker, placed_address, "{receipt:?}");
        assert_eq!(receipt.order, order.id);
    }
    let bytes: u64 = listing.receipts.iter().map(|r| r.cumulative_bytes).sum();

    // Credited at the placement's price, from the escrow, to the base unit.
    let client = Client::new(&ledger);
    let earned = (u128::from(bytes) * 10_000_000 / 1_000_000) as u64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let order = loop {
        let now = client.order(order.id).unwrap();
        if now.paid.base_units.base_units() == earned {
            break now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not credited: {now:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(
        order.escrow.base_units,
        kvr("2")
            .checked_sub(Amount::from_base_units(earned))
            .unwrap()
    );
    let worker: AccountView = client.account(&placed_address).unwrap();
    let from_order: u64 = worker
        .pending
        .iter()
        .filter(|p| p.order == Some(order.id))
        .map(|p| p.amount.base_units.base_units())
        .sum();
    let settled = worker.balance.base_units.base_units();
    // What it earned less its credits' fees, and what the top-up left after the offer's fee.
    let genesis =
        kvasir_ledger::Genesis::load(&swarm.dir.path().join("chain/genesis.json")).unwrap();
    let credited = kvasir_tests::pay::expected_held(&client, &genesis, &placed_address, earned);
    let left = kvr("0.01").checked_sub(offer_fee).unwrap().base_units();
    assert_eq!(from_order + settled, credited + left, "{worker:?}");
    let unplaced_address = kvasir_keyfile::address(&unplaced_key).unwrap();
    let idle = client.account(&unplaced_address).unwrap();
    assert!(
        idle.pending.is_empty() && idle.balance.base_units.is_zero(),
        "{idle:?}"
    );

    // A backbone naming an order its key may not act for is refused by the hub, and the
    // generation runs locally.
    let refused = swarm.backbone_with("*:*", "The capital of France is", 2, &["--order", "999"]);
    assert_eq!(refused.token_ids, local.token_ids[..2].to_vec());
    let hub_log = swarm.hub.as_ref().unwrap().stderr();
    assert!(hub_log.contains("no order 999"), "{hub_log}");

    // A backbone serving the order is dropped by the hub once the buyer closes it: its
    // workers do not go on serving an order that no longer pays.
    let hub = swarm.hub.as_ref().unwrap();
    let attached = |log: &str| log.matches("backbone attached").count();
    let before = attached(&hub.stderr());
    let (mut serving, _) = swarm.serve_backbone_with("*:*", &["--order", &id]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while attached(&hub.stderr()) == before {
        assert!(std::time::Instant::now() < deadline, "{}", hub.stderr());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    wallet_json(&ledger, &buyer, &["order", "close", &id]);
    let dropped = format!("dropping the backbone of order {id}: order {id} is closed");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !hub.stderr().contains(&dropped) {
        assert!(std::time::Instant::now() < deadline, "{}", hub.stderr());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    serving.kill();
    swarm.workers.clear();
}

/// The id the checkpoint in `model` has on the chain (`kvasir-node model pin`).
fn model_id(model: &std::path::Path) -> String {
    let model = kvasir_tests::path_str(model);
    let out = kvasir_tests::run("kvasir-node", &["model", "pin", "--model", model]);
    assert!(out.status.success(), "{}", kvasir_tests::stderr(&out));
    let pin: serde_json::Value = serde_json::from_str(&kvasir_tests::stdout(&out)).unwrap();
    pin["id"].as_str().unwrap().to_string()
}
