//! The wallet as a user runs it against the public side: over HTTPS through the gateway
//! (trusting its self-signed certificate with `--ca`), with a key file sealed under a
//! passphrase.

use std::process::{Command, Output};

use kvasir_api::ledger::AccountView;
use kvasir_tests::swarm::Swarm;
use kvasir_tests::{bin, path_str, stderr, stdout};

fn wallet(args: &[&str], passphrase: Option<&str>) -> Output {
    let mut command = Command::new(bin("kvasir-wallet"));
    command.args(args).env_remove("KVASIR_PASSPHRASE");
    if let Some(passphrase) = passphrase {
        command.env("KVASIR_PASSPHRASE", passphrase);
    }
    command.output().expect("running kvasir-wallet")
}

fn one_line_error(output: &Output, says: &str) {
    assert!(!output.status.success(), "{}", stdout(output));
    let message = stderr(output);
    assert!(message.starts_with("error: "), "{message}");
    assert!(message.to_lowercase().contains(says), "{says}: {message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
}

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

    let mut balance = public.to_vec();
    balance.extend(["balance", "--keyfile", path_str(&sealed), "--json"]);
    let account: AccountView = serde_json::from_str(&stdout(&wallet(&balance, None))).unwrap();
    assert_eq!(account.address.to_string(), address);
    assert_eq!(account.balance.kvr.to_decimal(), "1.5", "{account:?}");
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
    let init = kvasir_tests::run(
        "kvasir-node",
        &["genesis", "init", "--out", path_str(&chain)],
    );
    assert!(init.status.success(), "{}", stderr(&init));
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
