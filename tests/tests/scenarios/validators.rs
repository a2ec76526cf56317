//! Validators on the Malachite engine, as real processes on loopback: four validators and a
//! full node agree on every block, a transaction submitted to the full node is committed,
//! one validator down does not stop the chain, two down stop it without any node committing
//! a conflicting block, and the chain resumes when one returns. Every node's store then
//! verifies against the genesis file, certificates included. A validator cut off from the
//! others for ten seconds rejoins them.

use std::time::Duration;

use kvasir_ledger::{Amount, Keypair, TxKind};
use kvasir_tests::network::Network;
use rand::{Rng, SeedableRng};

const PATIENCE: Duration = Duration::from_secs(90);

#[test]
fn four_validators_and_a_full_node_agree_and_tolerate_one_failure() {
    let mut net = Network::start(4, 1);
    let full = 4;
    net.wait_height(3, PATIENCE);

    // Submitted to the full node, forwarded to the validators, committed everywhere.
    let faucet = kvasir_keyfile::read(&net.chain.join("keys/faucet.key"), None).unwrap();
    let client = net.client(full);
    let head = client.head().unwrap();
    let to = Keypair::generate().address();
    let amount = Amount::parse("1.5").unwrap();
    let tx = client
        .sign_next(
            &head.chain_id,
            TxKind::Transfer { to, amount },
            &faucet,
            Amount::ZERO,
        )
        .unwrap();
    let hash = client.submit(&tx).unwrap();
    let height = client.wait_committed(&hash, PATIENCE).unwrap();
    net.wait_height(height, PATIENCE);
    for node in 0..net.len() {
        let balance = net.client(node).account(&to).unwrap().balance.base_units;
        assert_eq!(balance, amount, "node {node}");
    }
    net.assert_agree(height, 3);
    assert!(client.head().unwrap().signers.len() >= 3);

    // One of four down: blocks go on.
    net.kill(3);
    let before = net.highest_height();
    net.wait_height(before + 3, PATIENCE);

    // Two of four down: no quorum, no block; nobody commits anything of its own meanwhile.
    net.kill(2);
    std::thread::sleep(Duration::from_secs(3));
    let stalled = net.highest_height();
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(net.highest_height(), stalled, "a block without a quorum");
    net.assert_agree(net.lowest_height(), 3);

    // One returns: three of four again, and the returning one catches up.
    net.restart(2);
    net.wait_height(stalled + 3, PATIENCE);
    net.restart(3);
    net.wait_height(net.highest_height(), PATIENCE);
    net.assert_agree(net.lowest_height(), 3);

    for node in 0..net.len() {
        net.stop(node);
    }
    for node in 0..net.len() {
        let report = net.verify(node);
        assert!(report.contains("chain ok"), "node {node}: {report}");
    }
}

#[test]
fn a_validator_killed_twenty_times_rejoins_without_equivocating_and_an_empty_node_syncs_all() {
    let mut net = Network::start(4, 1);
    let full = 4;
    net.wait_height(2, PATIENCE);
    // The full node is wiped now, to come back later with nothing.
    net.kill(full);
    std::fs::remove_dir_all(net.data_dir(full)).unwrap();

    let seed = std::env::var("KVASIR_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for kill in 0..20 {
        // Anywhere in its life: starting, replaying its log, voting, committing.
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..1500)));
        net.kill(1);
        net.restart(1);
        assert!(
            net.height(0).is_some(),
            "kill {kill} (KVASIR_KILL_SEED={seed}): node 0 stopped answering"
        );
    }
    let target = net.highest_height() + 2;
    net.wait_height(target, PATIENCE);
    net.assert_agree(net.lowest_height(), 3);
    for node in net.running() {
        let errors = net.stderr(node);
        assert!(
            !errors.contains("equivocation"),
            "node {node} saw equivocation (KVASIR_KILL_SEED={seed}):\n{errors}"
        );
    }

    // From an empty data directory, a full node syncs every block and certificate.
    net.restart(full);
    net.wait_height(net.highest_height(), PATIENCE);
    net.assert_agree(net.lowest_height(), 3);
    for node in 0..net.len() {
        net.stop(node);
    }
    let report = net.verify(full);
    assert!(report.contains("chain ok"), "{report}");
}

#[test]
fn a_validator_cut_off_for_ten_seconds_rejoins() {
    let isolated = 3;
    let net = Network::start_isolatable(4, 0, isolated);
    net.wait_height(3, PATIENCE);

    net.cut();
    let cut_at = net.height(isolated).unwrap();
    std::thread::sleep(Duration::from_secs(10));
    // The three others went on; the isolated one could not have: no quorum alone.
    let others = (0..isolated).filter_map(|n| net.height(n)).min().unwrap();
    assert!(
        others >= cut_at + 5,
        "the three others stalled: {others} from {cut_at}"
    );
    let alone = net.height(isolated).unwrap();
    assert!(
        alone <= cut_at + 1,
        "a block decided alone: {alone} from {cut_at}"
    );

    net.heal();
    net.wait_height(net.highest_height() + 3, PATIENCE);
    net.assert_agree(net.lowest_height(), 3);
    // It takes part again: with one of the others gone, it is needed for every block.
    let mut net = net;
    net.kill(0);
    net.wait_height(net.highest_height() + 3, PATIENCE);
    net.assert_agree(net.lowest_height(), 3);
}
