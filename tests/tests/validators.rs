//! Validators on the Malachite engine, as real processes on loopback: four validators and a
//! full node agree on every block, a transaction submitted to the full node is committed,
//! one validator down does not stop the chain, two down stop it without any node committing
//! a conflicting block, and the chain resumes when one returns. Every node's store then
//! verifies against the genesis file, certificates included.

use std::time::Duration;

use kvasir_ledger::{Amount, Keypair, TxKind};
use kvasir_tests::network::Network;

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
    let nonce = client.account(&faucet.address()).unwrap().nonce;
    let to = Keypair::generate().address();
    let amount = Amount::parse("1.5").unwrap();
    let tx = TxKind::Transfer { to, amount }.signed(&head.chain_id, &faucet, nonce);
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
