//! Settlement over real processes: the gateway, the hub or the ledger is SIGKILLed again and
//! again while the gateway credits, and in the end every worker's pending + settled rewards
//! equal `earned` of its sessions' metered bytes, to the base unit: nothing lost, nothing paid
//! twice. The same over a chain of four validators and two full nodes, a validator and the
//! full node the gateway talks to killed while it credits: every node agrees on every pay.

use std::time::{Duration, Instant};

use kvasir_api::Client;
use kvasir_ledger::Genesis;
use kvasir_tests::swarm::Swarm;

#[test]
fn killing_the_gateway_while_it_credits_pays_every_byte_exactly_once() {
    kill_while_crediting(8, Swarm::restart_gateway);
}

#[test]
fn killing_the_hub_while_its_receipts_are_credited_pays_every_byte_exactly_once() {
    kill_while_crediting(3, Swarm::kill_and_restart_hub);
}

#[test]
fn killing_the_ledger_while_it_takes_credits_pays_every_byte_exactly_once() {
    kill_while_crediting(3, Swarm::restart_ledger);
}

#[test]
fn over_four_validators_and_two_full_nodes_every_byte_is_paid_exactly_once_on_every_node() {
    let swarm = Swarm::start_over_validators("tiny", 4, 2);
    kill_while_crediting_in(swarm, 2, |swarm| {
        let network = swarm.network.as_mut().expect("a network");
        // A validator, and the full node the gateway, hub and backbone try first: for two
        // seconds they must fail over to the other.
        for node in [1, 4] {
            network.kill(node);
        }
        std::thread::sleep(Duration::from_secs(2));
        for node in [1, 4] {
            network.restart(node);
        }
    });
}

/// `kills` rounds of traffic, each with `restart` at a varying instant while the gateway is
/// crediting it; then every session credited to its count, and each worker paid exactly.
fn kill_while_crediting(kills: usize, restart: fn(&mut Swarm)) {
    kill_while_crediting_in(Swarm::start_with("tiny", true), kills, restart);
}

/// As `kill_while_crediting`, in `swarm`; with a network, every node must agree on the pay.
fn kill_while_crediting_in(mut swarm: Swarm, kills: usize, restart: impl Fn(&mut Swarm)) {
    swarm.add_worker("*:0-3");
    swarm.add_worker("*:4-7");
    let ledger = Client::new(&swarm.ledger_url.clone().unwrap());
    let hub = kvasir_keyfile::read(&swarm.dir.path().join("chain/keys/hub.key"), None)
        .unwrap()
        .address();
    let credited = |session: u64| ledger.session(&hub, session, 0).unwrap().cumulative_bytes;
    let credited_total =
        |swarm: &Swarm| -> u64 { swarm.metered().iter().map(|(s, _, _)| credited(*s)).sum() };
    // Each round: a generation makes traffic, the gateway starts crediting it, and a role is
    // killed at a varying instant while it does; the survivors must pick up where it left off.
    let mut before = 0;
    for kill in 0..kills {
        let backbone = swarm.start_backbone("*:*", "Once upon a time", 40);
        let deadline = Instant::now() + Duration::from_secs(120);
        while credited_total(&swarm) <= before {
            assert!(
                Instant::now() < deadline,
                "round {kill}: nothing new was credited"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(37 * kill as u64 % 300));
        restart(&mut swarm);
        backbone.finish(Duration::from_secs(300)).unwrap();
        before = credited_total(&swarm);
    }

    // Wait until the (restarted) gateway has credited every session up to its count.
    let genesis = Genesis::load(&swarm.dir.path().join("chain/genesis.json")).unwrap();
    let sessions = swarm.metered();
    assert!(sessions.len() >= 2, "{sessions:?}");
    let deadline = Instant::now() + Duration::from_secs(120);
    for (session, _, bytes) in &sessions {
        loop {
            let mark = ledger.session(&hub, *session, 0).unwrap();
            if mark.cumulative_bytes == *bytes {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "session {session} never fully credited: {mark:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let mut workers: Vec<&String> = sessions.iter().map(|(_, w, _)| w).collect();
    workers.sort();
    workers.dedup();
    assert_eq!(workers.len(), 2);
    // Every node, once at the head the last credit reached.
    let nodes: Vec<Client> = match &swarm.network {
        Some(network) => {
            network.wait_height(ledger.head().unwrap().height, Duration::from_secs(60));
            network.assert_agree(network.lowest_height(), 3);
            (0..network.len()).map(|n| network.client(n)).collect()
        }
        None => vec![ledger],
    };
    for worker in workers {
        let earned: u64 = sessions
            .iter()
            .filter(|(_, w, _)| w == worker)
            .map(|(_, _, b)| genesis.earned(*b).unwrap().base_units())
            .sum();
        assert!(earned > 0);
        for node in &nodes {
            let address = worker.parse().unwrap();
            let account = node.account(&address).unwrap();
            assert_eq!(
                account.balance.base_units.base_units()
                    + account.pending_total.base_units.base_units(),
                kvasir_tests::pay::expected_held(node, &genesis, &address, earned),
                "worker {worker}: {account:?}"
            );
        }
    }
}
