//! Crash safety, proven by killing: a child process commits blocks as fast as it can and is
//! killed with SIGKILL at random instants, many times over the same data directory. After
//! every kill the ledger must reopen with every block the child reported committed intact,
//! its stored state must match its head's state root (nothing half-applied), and a replay
//! of all committed blocks from genesis must reach exactly the stored state.
//!
//! `KVASIR_CRASH_ITERATIONS` sets the number of kills (default 200); `KVASIR_CRASH_SEED`
//! replays a run's instants. The child is this same test binary, started on the ignored
//! test `crash_child_commits_blocks_forever`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvasir_ledger::{
    check_stateless, produce_block, verify_chain, Address, Amount, Certificate, Genesis, Hash,
    Keypair, Receipt, SledStore, Storage, StoreError, TxKind,
};
use rand::{Rng, SeedableRng};

const CHILD_DIR: &str = "KVASIR_CRASH_CHILD_DIR";

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

/// The child: commits blocks of transfers and credits until killed, printing
/// `committed HEIGHT STATE_ROOT` after each commit returns.
#[test]
#[ignore = "the child half of sigkill_at_random_instants_loses_no_committed_block"]
fn crash_child_commits_blocks_forever() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let genesis = dev_genesis();
    let (validator, gateway, hub, faucet) = (
        dev_key("validator"),
        dev_key("gateway"),
        dev_key("hub"),
        dev_key("faucet"),
    );
    let store = SledStore::open_or_create(Path::new(&dir), &genesis).unwrap();
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
            txs.push(kind.signed(&genesis.params.chain_id, &faucet, nonce(&faucet) + i));
        }
        for session in 0..3u64 {
            let receipt = Receipt {
                chain_id: genesis.params.chain_id.clone(),
                hub: hub.address(),
                session_id: session,
                worker: Address::from_bytes([session as u8 + 1; 32]),
                order: 0,
                cumulative_bytes: height * 100_003 + session,
            };
            let kind = TxKind::Credit(receipt.sign(&hub));
            txs.push(kind.signed(
                &genesis.params.chain_id,
                &gateway,
                nonce(&gateway) + session,
            ));
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
        println!("committed {} {}", state.height(), state.root());
    }
}

/// When the child is killed: `delay` after it starts, or `delay` after it reports its
/// first commit (kills then land inside the commit loop rather than in start-up).
#[derive(Debug, Clone, Copy)]
enum KillAt {
    AfterStart(Duration),
    AfterFirstCommit(Duration),
}

/// Runs the child until killed; returns the (height, root) pairs it reported.
fn run_child_and_kill(dir: &Path, kill_at: KillAt) -> Vec<(u64, Hash)> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child_commits_blocks_forever",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("committed ") {
                let (height, root) = rest.split_once(' ').unwrap();
                sender
                    .send((
                        height.parse::<u64>().unwrap(),
                        root.parse::<Hash>().unwrap(),
                    ))
                    .unwrap();
            }
        }
    });
    let mut reported = Vec::new();
    match kill_at {
        KillAt::AfterStart(delay) => std::thread::sleep(delay),
        KillAt::AfterFirstCommit(delay) => {
            let first = receiver.recv_timeout(Duration::from_secs(30));
            reported.extend(first.ok());
            std::thread::sleep(delay);
        }
    }
    child.kill().unwrap(); // SIGKILL on Unix
    let status = child.wait().unwrap();
    reader.join().unwrap();
    assert!(
        !status.success(),
        "the child must have been killed, not have exited"
    );
    reported.extend(receiver.try_iter());
    reported
}

#[test]
fn sigkill_at_random_instants_loses_no_committed_block() {
    let iterations: usize = std::env::var("KVASIR_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let seed: u64 = std::env::var("KVASIR_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("crash test: {iterations} kills, KVASIR_CRASH_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let started = Instant::now();
    let mut reported_max = 0u64;
    let mut kills_after_commits = 0;
    for iteration in 0..iterations {
        let kill_at = if rng.gen_bool(0.5) {
            KillAt::AfterStart(Duration::from_micros(rng.gen_range(0..150_000)))
        } else {
            KillAt::AfterFirstCommit(Duration::from_micros(rng.gen_range(0..40_000)))
        };
        let reported = run_child_and_kill(&path, kill_at);
        if !reported.is_empty() {
            kills_after_commits += 1;
        }
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
                // Kept, with what it holds, so that the cause can be read.
                let kept = dir.keep();
                let files: Vec<String> = std::fs::read_dir(kept.join("ledger"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|f| {
                        let size = f.metadata().map_or(0, |m| m.len());
                        format!("{} ({size} bytes)", f.file_name().to_string_lossy())
                    })
                    .collect();
                panic!(
                    "iteration {iteration}: reopening failed: {e}; the store is kept in {} and holds {files:?}",
                    kept.display()
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
        if iteration % 50 == 49 || iteration + 1 == iterations {
            // Balances equal a replay of every committed block from genesis.
            let report = verify_chain(&store, Some(&dev_genesis()), None, |_, _| {})
                .unwrap_or_else(|e| panic!("iteration {iteration}: {e}"));
            assert_eq!(report.state_root, state.root());
        }
    }
    eprintln!(
        "crash test: {iterations} kills in {:.1}s, {kills_after_commits} after at least one commit, head {reported_max}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        kills_after_commits * 2 >= iterations,
        "too few kills landed after a commit to prove anything"
    );
}
