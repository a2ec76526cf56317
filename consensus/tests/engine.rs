//! The engine deciding blocks on loopback: one validator, four, four of which one is
//! refused, a full node following them, and a validator restarted on its home.

mod common;

use std::time::Duration;

use common::{
    checked_chain, free_addresses, genesis_with, id_of, init_logs, settings, wait_for, Net,
    ToyChain,
};

const WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_validator_decides_blocks_with_offline_verifiable_certificates() {
    init_logs();
    let (genesis, keys) = genesis_with(1);
    let net = Net::start(&genesis, &keys, 0, Vec::new()).await;
    net.wait_for(3, WITHIN).await;
    for (block, certificate) in net.checked_chain(0, 3) {
        assert_eq!(block.proposer, keys[0].address());
        assert_eq!(certificate.signatures.len(), 1);
    }
    net.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_validators_and_a_full_node_commit_the_same_blocks() {
    init_logs();
    let (genesis, keys) = genesis_with(4);
    let net = Net::start(&genesis, &keys, 1, Vec::new()).await;
    net.wait_for(3, WITHIN).await;
    let first = net.checked_chain(0, 3);
    for i in 1..5 {
        let other = net.checked_chain(i, 3);
        for ((a, _), (b, certificate)) in first.iter().zip(&other) {
            assert_eq!(
                id_of(&borsh::to_vec(a).unwrap()),
                id_of(&borsh::to_vec(b).unwrap())
            );
            assert!(certificate.signatures.len() >= 3);
        }
    }
    net.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocks_every_validator_refuses_are_never_committed() {
    init_logs();
    let (genesis, keys) = genesis_with(4);
    let refused = keys[1].address();
    let net = Net::start(&genesis, &keys, 0, vec![refused]).await;
    // Round 0 of height h is proposed by validator h mod 4: the refused one opens heights 1
    // and 5, the second time on a network long connected.
    net.wait_for(6, WITHIN).await;
    for i in 0..4 {
        for (block, certificate) in net.checked_chain(i, 6) {
            assert_ne!(block.proposer, refused);
            assert!(certificate.signatures.len() >= 3);
        }
    }
    let refusals: usize = net.ledgers.iter().map(|l| l.lock().unwrap().refusals).sum();
    assert!(
        refusals > 0,
        "no node was ever offered the refused proposer's block"
    );
    net.stop().await;
}

/// Stopped at whatever point of a height, a validator restarted on its home (WAL and
/// proposal store) and its committed blocks goes on deciding. (That it proposes the same
/// block again is `app::tests`' to show: where this stop lands is up to timing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_validator_goes_on_from_its_home() {
    init_logs();
    let (genesis, keys) = genesis_with(1);
    let home = tempfile::tempdir().unwrap();
    let me = Some(keys[0].address());
    let chain = ToyChain::new(&genesis, me, Vec::new());
    let ledger = chain.ledger.clone();
    let addresses = free_addresses(2);

    let handle = kvasir_consensus::start(
        &genesis,
        Some(keys[0].clone()),
        settings(&home, &addresses, 0),
        chain,
    )
    .await
    .unwrap();
    wait_for(std::slice::from_ref(&ledger), 2, WITHIN).await;
    handle.stop().await.unwrap();
    let stopped_at = ledger.lock().unwrap().blocks.len() as u64;

    let chain = ToyChain::reopen(&genesis, me, ledger.clone());
    let handle = kvasir_consensus::start(
        &genesis,
        Some(keys[0].clone()),
        settings(&home, &addresses, 1),
        chain,
    )
    .await
    .unwrap();
    wait_for(std::slice::from_ref(&ledger), stopped_at + 3, WITHIN).await;
    checked_chain(&genesis, &ledger, stopped_at + 3);
    handle.stop().await.unwrap();
}
