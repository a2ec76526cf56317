//! Verified work over real processes: a worker lying on 1%, 10% or 100% of its answers
//! among honest ones is caught by the backbone's audits, its Evidence is recomputed and
//! accepted by the ledger, its session's pending rewards are cancelled, half its bond is
//! slashed, its key is jailed and refused at its next hello; the honest workers are paid
//! exactly, and the output equals the all-local run bit for bit. The ledger runs without the
//! model, as any format-2 validator may: the evidence carries the disputed expert's weights
//! and their proof against the genesis pin.

use std::time::{Duration, Instant};

use kvasir_api::Client;
use kvasir_devnet::roles;
use kvasir_ledger::{Address, Amount, Genesis};
use kvasir_tests::swarm::Swarm;

#[test]
fn a_worker_lying_on_every_answer_is_caught_slashed_jailed_and_refused() {
    caught_among_honest("1", "zeros", 32);
}

#[test]
fn a_worker_lying_on_a_tenth_of_its_answers_is_caught() {
    caught_among_honest("0.1", "flip", 32);
}

#[test]
fn a_worker_lying_on_one_answer_in_a_hundred_is_caught() {
    // Its first lie is its 100th answer: enough tokens that it gives well over that.
    caught_among_honest("0.01", "swap", 160);
}

fn caught_among_honest(fraction: &str, kind: &str, tokens: usize) {
    // Nothing settles during the test, so the liar's whole session is still pending when its
    // lie is judged, even on a slow machine (ten seconds of blocks did not always suffice).
    let mut swarm = Swarm::start_with_challenge_window("tiny", 600);
    swarm.add_worker("*:0-2");
    let liar = swarm.add_worker_with(
        "*:3-5",
        &["--dishonest-fraction", fraction, "--dishonest-kind", kind],
    );
    swarm.add_worker("*:6-7");
    let liar_key = swarm.worker_key(liar);
    let liar_address = kvasir_keyfile::address(&liar_key).unwrap();
    let ledger = Client::new(&swarm.ledger_url.clone().unwrap());
    let genesis = Genesis::load(&swarm.dir.path().join("chain/genesis.json")).unwrap();
    let min_bond = genesis.params.min_bond;

    // Every answer audited: the lie is caught the first time it is told.
    let prompt = "Once upon a time";
    let remote = swarm.backbone_with("*:*", prompt, tokens, &["--audit-rate", "1"]);
    let local = swarm.local(prompt, tokens);
    assert_eq!(
        remote.token_ids, local.token_ids,
        "the output must not change"
    );
    assert_eq!(remote.logits_blake3, local.logits_blake3);
    let audit = remote.audit.expect("an audit report");
    assert!(audit.audits > 0);
    assert_eq!(audit.caught.len(), 1, "{audit:?}");
    let caught = &audit.caught[0];
    assert_eq!(caught.worker, liar_address);
    assert!(caught.committed_height.is_some(), "{caught:?}");

    // Every session credited to its count, the convicted one included (it pays nothing).
    let hub = caught.hub;
    let sessions = swarm.metered();
    let deadline = Instant::now() + Duration::from_secs(120);
    for (session, _, bytes) in &sessions {
        while ledger.session(&hub, *session, 0).unwrap().cumulative_bytes < *bytes {
            assert!(
                Instant::now() < deadline,
                "session {session} never credited"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // The liar: nothing earned, half its bond gone, jailed.
    let account = ledger.account(&liar_address).unwrap();
    assert_eq!(
        account.pending_total.base_units,
        Amount::ZERO,
        "{account:?}"
    );
    assert_eq!(account.balance.base_units, Amount::ZERO, "{account:?}");
    let half = Amount::from_base_units(min_bond.base_units() / 2);
    assert_eq!(account.bonded.base_units, half);
    assert!(account.jailed, "{account:?}");

    // The honest workers: paid exactly what their sessions' bytes earned.
    let honest: Vec<String> = sessions
        .iter()
        .map(|(_, w, _)| w.clone())
        .filter(|w| *w != liar_address.to_string())
        .collect();
    assert!(!honest.is_empty());
    for worker in honest {
        let earned: u64 = sessions
            .iter()
            .filter(|(_, w, _)| *w == worker)
            .map(|(_, _, b)| genesis.earned(*b).unwrap().base_units())
            .sum();
        let address: Address = worker.parse().unwrap();
        let account = ledger.account(&address).unwrap();
        assert!(earned > 0);
        assert!(!account.jailed);
        assert_eq!(
            account.balance.base_units.base_units() + account.pending_total.base_units.base_units(),
            kvasir_tests::pay::expected_held(&ledger, &genesis, &address, earned),
            "worker {worker}: {account:?}"
        );
    }

    // Its next hello is refused, with the reason in its log.
    swarm.workers[liar].kill();
    let (url, cert) = (swarm.gateway_url(), swarm.cert());
    let args = roles::worker(&url, &liar_key, &swarm.model, "*:3-5", &cert);
    let again = kvasir_tests::start("kvasir-node", &args.into_vec());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !again.stderr().contains("jailed until height") {
        assert!(
            Instant::now() < deadline,
            "the jailed worker was not refused: {}",
            again.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
