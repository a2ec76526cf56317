//! Settlement over real processes: the gateway, the hub or the ledger is SIGKILLed again and
//! again while the gateway credits, and in the end every worker's pending + settled rewards
//! equal `earned` of its sessions' metered bytes, to the base unit: nothing lost, nothing paid
//! twice.

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

/// `kills` rounds of traffic, each with `restart` at a varying instant while the gateway is
/// crediting it; then every session credited to its count, and each worker paid exactly.
fn kill_while_crediting(kills: usize, restart: fn(&mut Swarm)) {
    let mut swarm = Swarm::start_with("tiny", true);
    swarm.add_worker("*:0-3");
    swarm.add_worker("*:4-7");
    let ledger = Client::new(&format!("http://{}", swarm.ledger_addr.clone().unwrap()));
    let hub = kvasir_keyfile::read(&swarm.dir.path().join("chain/keys/hub.key"), None)
        .unwrap()
        .address();
    let credited = |session: u64| ledger.session(&hub, session).unwrap().cumulative_bytes;
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
        backbone.finish(Duration::from_secs(300));
        before = credited_total(&swarm);
    }

    // Wait until the (restarted) gateway has credited every session up to its count.
    let genesis = Genesis::load(&swarm.dir.path().join("chain/genesis.json")).unwrap();
    let sessions = swarm.metered();
    assert!(sessions.len() >= 2, "{sessions:?}");
    let deadline = Instant::now() + Duration::from_secs(120);
    for (session, _, bytes) in &sessions {
        loop {
            let mark = ledger.session(&hub, *session).unwrap();
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
    for worker in workers {
        let earned: u64 = sessions
            .iter()
            .filter(|(_, w, _)| w == worker)
            .map(|(_, _, b)| genesis.earned(*b).unwrap().base_units())
            .sum();
        let account = ledger.account(&worker.parse().unwrap()).unwrap();
        assert!(earned > 0);
        assert_eq!(
            account.balance.base_units.base_units() + account.pending_total.base_units.base_units(),
            earned,
            "worker {worker}: {account:?}"
        );
    }
}
