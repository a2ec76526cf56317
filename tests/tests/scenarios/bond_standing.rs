//! The hub admits a worker only while its key has at least min_bond bonded and is not jailed:
//! a key without the bond is refused at its hello, and a connected worker whose key unbonds
//! below min_bond is dropped within a few of the hub's re-checks, told why, and refused when
//! it says hello again. Each worker logs the hub's reason.

use std::time::{Duration, Instant};

use kvasir_devnet::{roles, Process};
use kvasir_tests::start;
use kvasir_tests::swarm::{http_get, new_key, Swarm};
use kvasir_tests::{path_str, run, stderr};

/// How long anything here may take: far above what it needs (a few re-checks of 2 s).
const PATIENCE: Duration = Duration::from_secs(30);

/// What a refusal for too small a bond says (`bonds::Refused::Unbonded`).
const UNBONDED: &str = "bonded, this chain asks at least";

/// Waits until `done` holds; panics with `what` and `context()` after `PATIENCE`.
fn wait_for(what: &str, mut done: impl FnMut() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: {}", context());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A worker process holding every expert with the key in `keyfile`, not waited for.
fn worker(swarm: &Swarm, keyfile: &std::path::Path) -> Process {
    let args = roles::worker(
        &swarm.gateway_url(),
        keyfile,
        &swarm.model,
        "*:*",
        &swarm.cert(),
    );
    start("kvasir-node", &args.into_vec())
}

fn metrics(swarm: &Swarm) -> String {
    http_get(&swarm.registry_addr, "/metrics")
}

/// Whether one line `proc` wrote to stderr holds every one of `parts`.
fn logged(proc: &Process, parts: &[&str]) -> bool {
    let stderr = proc.stderr();
    let mut lines = stderr.lines();
    lines.any(|line| parts.iter().all(|part| line.contains(part)))
}

#[test]
fn a_key_without_the_bond_is_refused_at_hello_and_its_worker_logs_why() {
    let swarm = Swarm::start_with("tiny", true);
    let key = swarm.dir.path().join("unbonded.key");
    let address = new_key(&key);
    let unbonded = worker(&swarm, &key);
    let refusal = format!("the hub refused this Worker: {address} has 0 KVR {UNBONDED}");
    wait_for(
        "the unbonded worker was not refused with the reason",
        || logged(&unbonded, &[&refusal]),
        || unbonded.stderr(),
    );
    assert!(metrics(&swarm).contains("kvasir_hub_sessions 0\n"));
}

#[test]
fn a_connected_worker_whose_key_unbonds_below_min_bond_is_dropped_and_refused_again() {
    let mut swarm = Swarm::start_with("tiny", true);
    let index = swarm.add_worker("*:*");
    let key = swarm.worker_key(index);
    let owner = format!("{} has ", kvasir_keyfile::address(&key).unwrap());
    assert!(metrics(&swarm).contains("kvasir_hub_sessions 1\n"));

    // One KVR out of a bond of exactly min_bond leaves it short. (Its operator pays the
    // unbond's fee: the faucet tops the key up for it.)
    let ledger = swarm.ledger_url.clone().unwrap();
    swarm.top_up(&ledger, &key, "0.01");
    let unbond = run(
        "kvasir-wallet",
        &["--url", &ledger, "--keyfile", path_str(&key), "unbond", "1"],
    );
    assert!(unbond.status.success(), "{}", stderr(&unbond));

    // The hub drops it and counts the drop; the worker logs why.
    wait_for(
        "the hub kept the unbonded worker",
        || {
            let text = metrics(&swarm);
            text.contains("kvasir_hub_standing_drops_total 1\n")
                && text.contains("kvasir_hub_sessions 0\n")
        },
        || metrics(&swarm),
    );
    let worker = &swarm.workers[index];
    wait_for(
        "the dropped worker did not log why",
        || logged(worker, &["the hub dropped this worker: ", &owner, UNBONDED]),
        || worker.stderr(),
    );
    // It redials, and its hello is refused for the same reason.
    wait_for(
        "the unbonded worker's hello was not refused",
        || logged(worker, &["the hub refused this Worker: ", &owner, UNBONDED]),
        || worker.stderr(),
    );
    assert!(metrics(&swarm).contains("kvasir_hub_sessions 0\n"));
}
