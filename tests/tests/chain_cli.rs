//! The chain's command line over real processes: a fresh chain, the dev demo, re-verification,
//! and tampering caught by `verify-chain`.

use std::path::Path;

use kvasir_ledger::{Address, Genesis, Store};
use kvasir_tests::{run, stderr, stdout};

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

#[test]
fn genesis_init_writes_a_chain_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("chain");
    let output = run(
        "kvasir-node",
        &["genesis", "init", "--out", path_str(&out), "--json"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let genesis = Genesis::load(&out.join("genesis.json")).unwrap();
    assert_eq!(report["genesis_hash"], genesis.hash().to_string());
    assert_eq!(report["chain_id"], "kvasir-dev");
    for role in ["validator", "gateway", "hub", "faucet"] {
        let key = out.join("keys").join(format!("{role}.key"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        assert!(key.exists(), "{role}");
    }
    let again = run("kvasir-node", &["genesis", "init", "--out", path_str(&out)]);
    assert!(!again.status.success());
    let message = stderr(&again);
    assert!(
        message.starts_with("error: ") && message.contains("already exists"),
        "{message}"
    );
    assert_eq!(
        message.trim_end().lines().count(),
        1,
        "one-line error: {message}"
    );
}

#[test]
fn dev_credits_the_announcement_session_and_verify_chain_catches_one_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let output = run("kvasir-node", &["dev", "--data-dir", path_str(&data)]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains("1.277952 units x 0.007 KVR per unit = 0.008945664 KVR"),
        "{text}"
    );
    assert!(
        text.contains("pending 0.008945664 KVR settling at height 11"),
        "{text}"
    );
    assert!(
        text.contains("settled 1.008945664 KVR, pending none"),
        "{text}"
    );

    // A second run reuses the chain and meters the next session.
    let second = run("kvasir-node", &["dev", "--data-dir", path_str(&data)]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert!(
        stdout(&second).contains("session 2:"),
        "{}",
        stdout(&second)
    );
    assert!(
        stdout(&second).contains("settled 2.017891328 KVR"),
        "{}",
        stdout(&second)
    );

    let ledger = data.join("ledger");
    let verify = run(
        "kvasir-node",
        &["verify-chain", "--data-dir", path_str(&ledger), "--json"],
    );
    assert!(verify.status.success(), "{}", stderr(&verify));
    let report: serde_json::Value = serde_json::from_str(&stdout(&verify)).unwrap();
    assert_eq!(report["blocks"], 22);
    assert_eq!(report["transactions"], 4);

    // The worker really holds what dev printed, under the address of its own key file.
    let worker = kvasir_ledger::Keypair::read_key_file(&data.join("keys/worker-1.key")).unwrap();
    let wallet = run(
        "kvasir-wallet",
        &[
            "address",
            "--keyfile",
            path_str(&data.join("keys/worker-1.key")),
        ],
    );
    assert_eq!(
        stdout(&wallet).trim().parse::<Address>().unwrap(),
        worker.address()
    );
    let original = {
        let store = Store::open(&ledger).unwrap();
        let state = store.load_state().unwrap();
        assert_eq!(
            state.account(&worker.address()).balance.to_string(),
            "2.017891328 KVR"
        );
        store.block_bytes(12).unwrap().unwrap()
    };

    // Flip one byte at several places in block 12 (header, signature, transactions).
    for at in [
        3,
        original.len() / 3,
        original.len() / 2,
        original.len() - 1,
    ] {
        let mut tampered = original.clone();
        tampered[at] ^= 0x01;
        Store::open(&ledger)
            .unwrap()
            .tamper_block_bytes(12, &tampered)
            .unwrap();
        let caught = run(
            "kvasir-node",
            &["verify-chain", "--data-dir", path_str(&ledger)],
        );
        assert!(
            !caught.status.success(),
            "byte {at}: tampering went unnoticed"
        );
        let message = stderr(&caught);
        assert!(message.contains("block 12 is bad"), "byte {at}: {message}");
    }
}

#[test]
fn verify_chain_without_a_ledger_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let output = run(
        "kvasir-node",
        &[
            "verify-chain",
            "--data-dir",
            path_str(&dir.path().join("none")),
        ],
    );
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("no ledger at"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn wallet_new_creates_a_private_key_file_and_address_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let keyfile = dir.path().join("nested/wallet.key");
    let created = run(
        "kvasir-wallet",
        &["new", "--keyfile", path_str(&keyfile), "--json"],
    );
    assert!(created.status.success(), "{}", stderr(&created));
    let value: serde_json::Value = serde_json::from_str(&stdout(&created)).unwrap();
    let address: Address = value["address"].as_str().unwrap().parse().unwrap();
    let shown = run(
        "kvasir-wallet",
        &["address", "--keyfile", path_str(&keyfile)],
    );
    assert_eq!(stdout(&shown).trim().parse::<Address>().unwrap(), address);
    let again = run("kvasir-wallet", &["new", "--keyfile", path_str(&keyfile)]);
    assert!(!again.status.success(), "new must never overwrite a key");
    std::fs::write(&keyfile, "{not json").unwrap();
    let broken = run(
        "kvasir-wallet",
        &["address", "--keyfile", path_str(&keyfile)],
    );
    assert!(!broken.status.success());
    assert!(
        stderr(&broken).starts_with("error: key file is not valid JSON"),
        "{}",
        stderr(&broken)
    );
}
