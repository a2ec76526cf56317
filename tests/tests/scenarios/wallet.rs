//! The wallet as a user runs it: against the public side, over HTTPS through the gateway
//! (trusting its self-signed certificate with `--ca`), with a key file sealed under a
//! passphrase; and bonding and unbonding against a ledger node.

use std::process::Command;

use kvasir_api::ledger::AccountView;
use kvasir_api::reports::{BondReport, UnbondReport};
use kvasir_api::Client;
use kvasir_ledger::Amount;
use kvasir_tests::swarm::Swarm;
use kvasir_tests::wallet::{one_line_error, wallet, Node};
use kvasir_tests::{bin, path_str, stderr, stdout};

#[test]
fn a_sealed_wallet_sends_and_reads_over_the_gateways_https() {
    let swarm = Swarm::start_with("tiny", true);
    let port = swarm.gateway_addr.rsplit(':').next().unwrap().to_string();
    let url = format!("https://localhost:{port}");
    let ca = swarm.cert();
    let public = ["--url", &url, "--ca", path_str(&ca)];
    let dir = swarm.dir.path();

    let sealed = dir.join("sealed.key");
    let created = wallet(
        &["new", "--encrypt", "--keyfile", path_str(&sealed)],
        Some("pw 1"),
    );
    assert!(created.status.success(), "{}", stderr(&created));
    let address = stdout(&created).trim().to_string();
    let text = std::fs::read_to_string(&sealed).unwrap();
    assert!(
        text.contains("\"sealed\"") && !text.contains("secret_key"),
        "{text}"
    );
    // The address is readable without the passphrase.
    let shown = wallet(&["address", "--keyfile", path_str(&sealed)], None);
    assert_eq!(stdout(&shown).trim(), address, "{}", stderr(&shown));

    // The faucet (a plain key file) pays it, through the gateway over TLS.
    let faucet = dir.join("chain/keys/faucet.key");
    let mut args = public.to_vec();
    args.extend(["transfer", &address, "2", "--keyfile", path_str(&faucet)]);
    let sent = wallet(&args, None);
    assert!(sent.status.success(), "{}", stderr(&sent));

    // Spending from the sealed key needs its passphrase, and the right one.
    let someone = kvasir_ledger::Keypair::generate().address().to_string();
    let mut spend = public.to_vec();
    spend.extend([
        "transfer",
        &someone,
        "0.5",
        "--keyfile",
        path_str(&sealed),
        "--json",
    ]);
    one_line_error(&wallet(&spend, None), "kvasir_passphrase");
    one_line_error(&wallet(&spend, Some("pw 2")), "wrong passphrase");
    let spent = wallet(&spend, Some("pw 1"));
    assert!(spent.status.success(), "{}", stderr(&spent));
    // What it paid besides the 0.5, as quoted before signing (the chain's blocks are near
    // empty, so the base fee it was included at is the one quoted).
    let report: kvasir_api::reports::TransferReport =
        serde_json::from_str(&stdout(&spent)).unwrap();
    let fee = report.fee.expect("a fee on a format-2 chain");
    let paid = fee.burned.checked_add(fee.tip).unwrap();
    assert!(!paid.is_zero() && paid <= fee.at_most, "{fee:?}");
    let left = kvasir_ledger::Amount::parse("1.5")
        .unwrap()
        .checked_sub(paid)
        .unwrap();

    let mut balance = public.to_vec();
    balance.extend(["balance", "--keyfile", path_str(&sealed), "--json"]);
    let account: AccountView = serde_json::from_str(&stdout(&wallet(&balance, None))).unwrap();
    assert_eq!(account.address.to_string(), address);
    assert_eq!(account.balance.kvr, left, "{account:?}");
    assert_eq!(account.nonce, 1);

    // Without the certificate the gateway is not trusted; a CA file that is no certificate is
    // refused before any connection.
    one_line_error(
        &wallet(&["balance", &address, "--url", &url], None),
        "cannot reach",
    );
    one_line_error(
        &wallet(
            &[
                "balance",
                &address,
                "--url",
                &url,
                "--ca",
                path_str(&sealed),
            ],
            None,
        ),
        "no pem certificate",
    );
}

#[test]
fn a_role_opens_a_sealed_key_with_the_passphrase_from_its_environment() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain");
    kvasir_tests::genesis_init(&chain);
    let validator = kvasir_keyfile::read(&chain.join("keys/validator.key"), None).unwrap();
    let sealed = dir.path().join("validator-sealed.key");
    kvasir_keyfile::write(&sealed, &validator, Some("s3cret")).unwrap();
    let ledger = |passphrase: Option<&str>| {
        let mut command = Command::new(bin("kvasir-node"));
        command
            .args(["ledger", "--listen", "127.0.0.1:0", "--genesis"])
            .arg(chain.join("genesis.json"))
            .arg("--data-dir")
            .arg(dir.path().join("ledger"))
            .arg("--key")
            .arg(&sealed)
            .env_remove("KVASIR_PASSPHRASE")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(passphrase) = passphrase {
            command.env("KVASIR_PASSPHRASE", passphrase);
        }
        command.spawn().expect("starting the ledger")
    };
    for (passphrase, says) in [
        (None, "passphrase is needed"),
        (Some("guess"), "wrong passphrase"),
    ] {
        let refused = ledger(passphrase).wait_with_output().unwrap();
        one_line_error(&refused, says);
        assert!(
            stderr(&refused).contains(path_str(&sealed)),
            "{}",
            stderr(&refused)
        );
    }
    let mut opened = ledger(Some("s3cret"));
    let mut first = String::new();
    BufReader::new(opened.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let _ = opened.kill();
    let _ = opened.wait();
    assert!(first.starts_with("ledger listening on "), "{first}");
}

fn kvr(text: &str) -> Amount {
    Amount::parse(text).unwrap()
}

#[test]
fn a_worker_bonds_then_unbonds_and_its_balance_shows_both() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain");
    // A chain from the template, which has bonds: min_bond 10, unbonding_blocks 20.
    kvasir_tests::genesis_init(&chain);
    let node = Node::start(&chain, &dir.path().join("ledger"));
    let params = Client::new(&node.url).params().unwrap();
    assert_eq!(params.min_bond.base_units, kvr("10"));
    let faucet = chain.join("keys/faucet.key");
    let worker = dir.path().join("worker.key");
    let created = wallet(&["new", "--keyfile", path_str(&worker)], None);
    let address = stdout(&created).trim().to_string();
    let funded = node.wallet(&faucet, &["transfer", &address, "30"]);
    assert!(funded.status.success(), "{}", stderr(&funded));

    // More than the balance: the ledger's reason, in one line, and nothing changes.
    one_line_error(&node.wallet(&worker, &["bond", "31"]), "insufficient funds");
    let bond: BondReport = serde_json::from_str(&node.json(&worker, &["bond", "20"])).unwrap();
    assert_eq!(bond.amount, kvr("20"));
    let account: AccountView = serde_json::from_str(&node.json(&worker, &["balance"])).unwrap();
    assert_eq!(account.bonded.base_units, kvr("20"), "{account:?}");
    // The bond's fee came out of the balance too.
    let fee = bond.fee.expect("a fee on a format-2 chain");
    let settled = kvr("10").checked_sub(fee.burned).unwrap();
    assert_eq!(account.balance.base_units, settled, "{account:?}");
    assert!(account.unbonding.is_empty() && account.unbonding_total.base_units.is_zero());
    assert!(!account.jailed && account.jailed_until == 0, "{account:?}");
    let line = stdout(&node.wallet(&worker, &["balance"]));
    assert!(
        line.contains(&format!(
            "settled {settled}, pending 0 KVR, bonded 20 KVR, unbonding 0 KVR"
        )),
        "{line}"
    );

    // Unbonding: released unbonding_blocks after the block that starts it, and shown so.
    let unbond: UnbondReport = serde_json::from_str(&node.json(&worker, &["unbond", "5"])).unwrap();
    assert_eq!(
        unbond.release_height,
        unbond.height + params.unbonding_blocks
    );
    let account: AccountView = serde_json::from_str(&node.json(&worker, &["balance"])).unwrap();
    assert_eq!(account.bonded.base_units, kvr("15"), "{account:?}");
    assert_eq!(account.unbonding.len(), 1, "{account:?}");
    assert_eq!(account.unbonding[0].amount.base_units, kvr("5"));
    assert_eq!(account.unbonding[0].release_height, unbond.release_height);
    assert_eq!(account.unbonding_total.base_units, kvr("5"));
    let line = stdout(&node.wallet(&worker, &["balance"]));
    let shown = format!(
        "bonded 15 KVR, unbonding 5 KVR (5 KVR released at height {})",
        unbond.release_height
    );
    assert!(line.contains(&shown), "{line}");
    // Without --json, one line naming the release height.
    let text = node.wallet(&worker, &["unbond", "1"]);
    assert!(text.status.success(), "{}", stderr(&text));
    let text = stdout(&text);
    assert!(
        text.starts_with("unbonding 1 KVR in transaction ")
            && text.contains("spendable again at height ")
            && text.trim_end().lines().count() == 1,
        "{text}"
    );
    one_line_error(
        &node.wallet(&worker, &["unbond", "15"]),
        "insufficient bond",
    );
    one_line_error(&node.wallet(&worker, &["bond", "0"]), "zero");
}

#[test]
fn a_chain_without_bonds_refuses_a_bond_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // A template that sets no min_bond: a chain with no bonds, as every chain was before them.
    let template = dir.path().join("template.json");
    std::fs::write(
        &template,
        r#"{"params": {"chain_id": "kvasir-no-bonds", "unit_bytes": 1000000,
            "reward_per_unit": "0.007", "challenge_window": 10, "block_interval_ms": 1000,
            "max_block_txs": 10000, "max_block_bytes": 8388608, "rewards_pool": "1000"},
            "faucet": "1000"}"#,
    )
    .unwrap();
    let chain = dir.path().join("chain");
    let init = kvasir_tests::run(
        "kvasir-node",
        &[
            "genesis",
            "init",
            "--template",
            path_str(&template),
            "--out",
            path_str(&chain),
        ],
    );
    assert!(init.status.success(), "{}", stderr(&init));
    let node = Node::start(&chain, &dir.path().join("ledger"));
    let faucet = chain.join("keys/faucet.key");
    one_line_error(
        &node.wallet(&faucet, &["bond", "1"]),
        "this chain has no bonds",
    );
    one_line_error(
        &node.wallet(&faucet, &["unbond", "1"]),
        "this chain has no bonds",
    );
    let account: AccountView = serde_json::from_str(&node.json(&faucet, &["balance"])).unwrap();
    assert!(
        account.bonded.base_units.is_zero() && account.nonce == 0,
        "{account:?}"
    );
    // A plain account's line is as it was before bonds.
    let line = stdout(&node.wallet(&faucet, &["balance"]));
    assert!(
        line.trim_end().ends_with("settled 1000 KVR, pending 0 KVR"),
        "{line}"
    );
}
