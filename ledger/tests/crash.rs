//! Crash safety, proven by killing: a child process commits blocks as fast as it can and is
//! killed with SIGKILL at random instants, many times over the same data directory. After
//! every kill the ledger must reopen with every block the child reported committed intact,
//! its stored state must match its head's state root (nothing half-applied), and a replay
//! of all committed blocks from genesis must reach exactly the stored state.
//!
//! The harness (`kvasir_devnet::crash`) is the one the consensus proposals' and the hub
//! registry's crash tests use: `KVASIR_CRASH_ITERATIONS` sets the number of kills (default
//! 200 here), `KVASIR_CRASH_SEED` replays a run's instants. The child is this same test
//! binary, started on the ignored test `crash_child_commits_blocks_forever`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvasir_devnet::crash::{self, Kills};
use kvasir_ledger::fees::Lane;
use kvasir_ledger::{
    check_stateless, produce_block, verify_chain, Address, Amount, Certificate, Genesis, Hash,
    Keypair, Receipt, SledStore, Storage, StoreError, TxKind,
};

fn dev_chain() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../genesis/dev")
}

/// A published dev key, parsed from its text: a checkout leaves the files readable by
/// everyone, which `kvasir_keyfile::read` rightly refuses.
fn dev_key(role: &str) -> Keypair {
    let path = dev_chain().join("keys").join(format!("{role}.key"));
    kvasir_keyfile::parse(&std::fs::read_to_string(path).unwrap(), None).unwrap()
}

fn dev_genesis() -> Genesis {
    Genesis::load(&dev_chain().join("genesis.json")).unwrap()
}

/// The child: commits blocks of transfers and credits until killed, reporting
/// `HEIGHT STATE_ROOT` after each commit returns.
#[test]
#[ignore = "the child half of sigkill_at_random_instants_loses_no_committed_block"]
fn crash_child_commits_blocks_forever() {
    let Some(dir) = crash::child_dir() else {
        return;
    };
    let genesis = dev_genesis();
    let (validator, gateway, hub, faucet) = (
        dev_key("validator"),
        dev_key("gateway"),
        dev_key("hub"),
        dev_key("faucet"),
    );
    let store = SledStore::open_or_create(&dir, &genesis).unwrap();
    let mut state = store.load_state().unwrap();
    loop {
        let height = state.height() + 1;
        let nonce = |who: &Keypair| state.account(&who.address()).nonce;
        let mut txs = Vec::new();
        for i in 0..20u64 {
            let to =
                Address::from_bytes(*blake3::hash(&(height * 100 + i).to_le_bytes()).as_bytes());
            let kind = TxKind::Transfer {
                to,
                amount: Amount::from_base_units(1 + i),
            };
            let fee = state.suggested_bid(Lane::Open, Amount::ZERO);
            txs.push(kind.signed_paying(state.chain_id(), fee, &faucet, nonce(&faucet) + i));
        }
        for session in 0..3u64 {
            let receipt = Receipt {
                chain_id: genesis.chain_id(),
                hub: hub.address(),
                session_id: session,
                worker: Address::from_bytes([session as u8 + 1; 32]),
                order: 0,
                cumulative_bytes: height * 100_003 + session,
            };
            let kind = TxKind::Credit(receipt.sign(&hub));
            let fee = state.suggested_bid(Lane::Reserved, Amount::ZERO);
            let nonce = nonce(&gateway) + session;
            txs.push(kind.signed_paying(state.chain_id(), fee, &gateway, nonce));
        }
        let candidates: Vec<_> = check_stateless(&genesis, txs)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let produced = produce_block(&state, &candidates, &validator, height).unwrap();
        assert!(produced.rejected.is_empty(), "{:?}", produced.rejected);
        let certificate = Certificate::for_block(&produced.block, 0, &[&validator]);
        store
            .commit(&produced.block, &produced.changes, &certificate)
            .unwrap();
        state = produced.state;
        crash::report_durable(format_args!("{} {}", state.height(), state.root()));
    }
}

#[test]
fn sigkill_at_random_instants_loses_no_committed_block() {
    let mut kills = Kills::from_env("ledger", 200);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let started = Instant::now();
    let mut reported_max = 0u64;
    for iteration in 0..kills.iterations {
        let reported: Vec<(u64, Hash)> = kills
            .kill_child("crash_child_commits_blocks_forever", &path)
            .iter()
            .map(|line| {
                let (height, root) = line.split_once(' ').unwrap();
                (height.parse().unwrap(), root.parse().unwrap())
            })
            .collect();
        let store = match SledStore::open(&path) {
            Ok(store) => store,
            // Killed before the chain was ever created: nothing can have been reported.
            Err(StoreError::NotInitialised(_)) => {
                assert_eq!(
                    reported_max, 0,
                    "iteration {iteration}: a committed chain vanished"
                );
                continue;
            }
            Err(e) => {
                let kept = dir.keep().join("ledger");
                panic!(
                    "iteration {iteration}: reopening failed: {e}; {}",
                    crash::listing(&kept)
                )
            }
        };
        let head = store.head().unwrap();
        for (height, root) in &reported {
            assert!(
                *height <= head,
                "iteration {iteration}: block {height} was reported committed, head is {head}"
            );
            let block = store
                .block(*height)
                .unwrap()
                .expect("a reported block is stored");
            assert_eq!(
                block.header.state_root, *root,
                "iteration {iteration}: block {height} changed"
            );
            reported_max = reported_max.max(*height);
        }
        assert!(
            head >= reported_max,
            "iteration {iteration}: head {head} is behind committed {reported_max}"
        );
        // The stored state matches the head's state root: no block is half-applied.
        let state = store
            .load_state()
            .unwrap_or_else(|e| panic!("iteration {iteration}: {e}"));
        assert_eq!(state.height(), head);
        if iteration % 50 == 49 || iteration + 1 == kills.iterations {
            // Balances equal a replay of every committed block from genesis.
            let report = verify_chain(&store, Some(&dev_genesis()), None, |_, _| {})
                .unwrap_or_else(|e| panic!("iteration {iteration}: {e}"));
            assert_eq!(report.state_root, state.root());
        }
    }
    eprintln!(
        "crash test of the ledger: {} kills in {:.1}s, {} after at least one commit, head {reported_max}",
        kills.iterations,
        started.elapsed().as_secs_f64(),
        kills.after_writes
    );
    kills.assert_enough_after_writes();
}
