//! The ledger service's REST API over a real process: good transactions commit, and every
//! kind of bad input gets the right status and changes nothing.

use std::time::Duration;

use kvasir_ledger::{Amount, Genesis, Keypair, Receipt, SignedTx, TxKind};
use kvasir_tests::swarm::{http, start_ledger, Proc};
use kvasir_tests::{path_str, run, stderr};
use kvasir_wallet::client::{Client, ClientError};
use serde_json::Value;

struct Chain {
    _dir: tempfile::TempDir,
    _ledger: Proc,
    addr: String,
    client: Client,
    genesis: Genesis,
    key: Box<dyn Fn(&str) -> Keypair>,
    keys: std::path::PathBuf,
}

fn start() -> Chain {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain");
    let init = run(
        "kvasir-node",
        &["genesis", "init", "--out", path_str(&chain)],
    );
    assert!(init.status.success(), "{}", stderr(&init));
    let (ledger, addr) = start_ledger(&chain, &dir.path().join("ledger"));
    let keys = chain.join("keys");
    let key_dir = keys.clone();
    Chain {
        keys: key_dir,
        genesis: Genesis::load(&chain.join("genesis.json")).unwrap(),
        client: Client::new(&format!("http://{addr}")),
        addr,
        _ledger: ledger,
        _dir: dir,
        key: Box::new(move |role| {
            Keypair::read_key_file(&keys.join(format!("{role}.key")), None).unwrap()
        }),
    }
}

impl Chain {
    fn dir_key(&self, role: &str) -> std::path::PathBuf {
        self.keys.join(format!("{role}.key"))
    }

    fn account(&self, who: &Keypair) -> Value {
        self.client
            .get(&format!("/accounts/{}", who.address()))
            .unwrap()
    }

    fn nonce(&self, who: &Keypair) -> u64 {
        self.account(who)["nonce"].as_u64().unwrap()
    }

    fn chain_id(&self) -> String {
        self.genesis.params.chain_id.clone()
    }

    /// Submits `tx`; the refusal's HTTP status and error kind, if refused.
    fn refused(&self, tx: &SignedTx) -> (u16, String) {
        match self.client.submit(tx) {
            Err(ClientError::Api { status, error, .. }) => (status, error),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

fn units(v: &Value) -> u64 {
    v["base_units"].as_str().unwrap().parse().unwrap()
}

#[test]
fn credits_and_transfers_commit_and_bad_ones_change_nothing() {
    let chain = start();
    let (gateway, hub, faucet) = (
        (chain.key)("gateway"),
        (chain.key)("hub"),
        (chain.key)("faucet"),
    );
    let worker = Keypair::generate();
    let receipt = |hub: &Keypair, chain_id: String, bytes: u64| {
        Receipt {
            chain_id,
            hub: hub.address(),
            session_id: 7,
            worker: worker.address(),
            cumulative_bytes: bytes,
        }
        .sign(hub)
    };

    // A good credit commits and pays exactly earned(bytes), pending.
    let credit = TxKind::Credit(receipt(&hub, chain.chain_id(), 1_277_952)).signed(
        &chain.chain_id(),
        &gateway,
        0,
    );
    let hash = chain.client.submit(&credit).unwrap();
    chain
        .client
        .wait_committed(&hash, Duration::from_secs(30))
        .unwrap();
    let paid = chain.account(&worker);
    assert_eq!(units(&paid["pending_total"]), 8_945_664, "{paid}");
    let session = chain
        .client
        .get(&format!("/sessions/{}/7", hub.address()))
        .unwrap();
    assert_eq!(session["cumulative_bytes"], 1_277_952);
    let history = chain
        .client
        .get(&format!("/accounts/{}/history", worker.address()))
        .unwrap();
    assert_eq!(history["entries"][0]["kind"], "credit", "{history}");
    assert_eq!(history["entries"][0]["cumulative_bytes"], 1_277_952);
    let committed = chain.client.get(&format!("/txs/{hash}")).unwrap();
    assert_eq!(committed["status"], "committed");
    let block = chain
        .client
        .get(&format!("/blocks/{}", committed["height"]))
        .unwrap();
    assert!(block["txs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == hash.as_str()));
    let by_hash = chain
        .client
        .get(&format!(
            "/blocks/by-hash/{}",
            block["hash"].as_str().unwrap()
        ))
        .unwrap();
    assert_eq!(by_hash, block);

    // Unauthorised or stale credits: refused, nothing changes.
    let stranger = Keypair::generate();
    let bad: Vec<(&str, SignedTx)> = vec![
        (
            "a credit from a non-gateway key",
            TxKind::Credit(receipt(&hub, chain.chain_id(), 2_000_000)).signed(
                &chain.chain_id(),
                &faucet,
                chain.nonce(&faucet),
            ),
        ),
        (
            "a receipt signed by a non-hub key",
            TxKind::Credit(receipt(&stranger, chain.chain_id(), 2_000_000)).signed(
                &chain.chain_id(),
                &gateway,
                1,
            ),
        ),
        (
            "a receipt for another chain",
            TxKind::Credit(receipt(&hub, "another-chain".into(), 2_000_000)).signed(
                &chain.chain_id(),
                &gateway,
                1,
            ),
        ),
        (
            "the same receipt again",
            TxKind::Credit(receipt(&hub, chain.chain_id(), 1_277_952)).signed(
                &chain.chain_id(),
                &gateway,
                1,
            ),
        ),
        (
            "a transfer beyond the balance",
            TxKind::Transfer {
                to: stranger.address(),
                amount: Amount::parse("1").unwrap(),
            }
            .signed(&chain.chain_id(), &worker, 0),
        ),
        (
            "a transaction for another chain",
            TxKind::Transfer {
                to: stranger.address(),
                amount: Amount::parse("1").unwrap(),
            }
            .signed("another-chain", &faucet, chain.nonce(&faucet)),
        ),
    ];
    let before = (
        chain.account(&worker),
        chain.account(&gateway),
        chain.account(&faucet),
    );
    for (what, tx) in &bad {
        let (status, error) = chain.refused(tx);
        assert_eq!((status, error.as_str()), (422, "invalid_tx"), "{what}");
    }
    // A signature that does not verify.
    let mut forged = TxKind::Transfer {
        to: stranger.address(),
        amount: Amount::parse("1").unwrap(),
    }
    .signed(&chain.chain_id(), &faucet, chain.nonce(&faucet));
    forged.signature.0[0] ^= 1;
    assert_eq!(chain.refused(&forged), (422, "invalid_tx".to_string()));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        (
            chain.account(&worker),
            chain.account(&gateway),
            chain.account(&faucet)
        ),
        before
    );

    // A batch: one verdict per transaction, in order; the bad one changes nothing.
    let batch = vec![
        TxKind::Transfer {
            to: stranger.address(),
            amount: Amount::parse("0.5").unwrap(),
        }
        .signed(&chain.chain_id(), &faucet, chain.nonce(&faucet)),
        forged.clone(),
    ];
    let verdicts = chain.client.submit_batch(&batch).unwrap();
    assert!(verdicts[0].is_ok() && verdicts[1].is_err(), "{verdicts:?}");
    chain
        .client
        .wait_committed(verdicts[0].as_ref().unwrap(), Duration::from_secs(30))
        .unwrap();

    // A good transfer commits.
    let amount = Amount::parse("2.5").unwrap();
    let transfer = TxKind::Transfer {
        to: stranger.address(),
        amount,
    }
    .signed(&chain.chain_id(), &faucet, chain.nonce(&faucet));
    let hash = chain.client.submit(&transfer).unwrap();
    chain
        .client
        .wait_committed(&hash, Duration::from_secs(30))
        .unwrap();
    assert_eq!(units(&chain.account(&stranger)["balance"]), 3_000_000_000);
}

#[test]
fn a_long_history_is_served_newest_first_in_pages() {
    let chain = start();
    let faucet = (chain.key)("faucet");
    let payee = Keypair::generate().address();
    let txs: Vec<SignedTx> = (0..150)
        .map(|nonce| {
            let amount = kvasir_ledger::Amount::from_base_units(nonce + 1);
            TxKind::Transfer { to: payee, amount }.signed(&chain.chain_id(), &faucet, nonce)
        })
        .collect();
    let admitted = chain.client.submit_batch(&txs).unwrap();
    let last = admitted.last().unwrap().clone().unwrap();
    chain
        .client
        .wait_committed(&last, std::time::Duration::from_secs(60))
        .unwrap();
    let mut amounts = Vec::new();
    let mut path = format!("/accounts/{payee}/history");
    loop {
        let page = chain.client.get(&path).unwrap();
        let entries = page["entries"].as_array().unwrap();
        assert!(entries.len() <= 100);
        for entry in entries {
            assert_eq!(entry["direction"], "in");
            amounts.push(units(&entry["amount"]));
        }
        match page["next_before"].as_str() {
            Some(before) => path = format!("/accounts/{payee}/history?before={before}"),
            None => break,
        }
    }
    // Together the pages list every transfer exactly once, newest (highest nonce) first, even
    // where a page ends inside a block.
    assert_eq!(amounts, (1..=150).rev().collect::<Vec<u64>>());
    let faucet_history = chain
        .client
        .get(&format!("/accounts/{}/history", faucet.address()))
        .unwrap();
    assert_eq!(faucet_history["entries"][0]["direction"], "out");
}

#[test]
fn malformed_requests_get_the_right_status_and_a_json_error() {
    let chain = start();
    let unknown_tx = format!("/txs/{}", "ab".repeat(32));
    let bad_page = format!(
        "/accounts/{}/history?before=soon",
        Keypair::generate().address()
    );
    let cases: Vec<(&str, &str, String, u16)> = vec![
        ("POST", "/txs", "{not json".into(), 400),
        ("POST", "/txs", r#"{"transaction": "00"}"#.into(), 422),
        ("POST", "/txs", r#"{"tx": "zz"}"#.into(), 400),
        ("POST", "/txs", r#"{"tx": "0011"}"#.into(), 400),
        (
            "POST",
            "/txs",
            format!(r#"{{"tx": "{}"}}"#, "00".repeat(100_000)),
            413,
        ),
        ("GET", "/accounts/kvr1notanaddress", String::new(), 400),
        ("GET", "/blocks/999999", String::new(), 404),
        ("GET", "/blocks/minus-one", String::new(), 400),
        ("GET", &unknown_tx, String::new(), 404),
        ("GET", "/txs/nothex", String::new(), 400),
        ("GET", "/sessions/kvr1x/1", String::new(), 400),
        ("GET", "/sessions/kvr1x", String::new(), 400),
        ("GET", "/accounts/kvr1x/history", String::new(), 400),
        ("GET", &bad_page, String::new(), 400),
        ("POST", "/txs/batch", r#"{"txs": ["zz"]}"#.into(), 400),
        ("POST", "/txs/batch", r#"{"txs": 5}"#.into(), 422),
        (
            "POST",
            "/txs/batch",
            format!(r#"{{"txs": [{}]}}"#, vec![r#""00""#; 10_001].join(",")),
            400,
        ),
        ("GET", "/no/such/thing", String::new(), 404),
    ];
    for (method, path, body, expected) in &cases {
        let (status, reply) = http(&chain.addr, method, path, body);
        assert_eq!(status, *expected, "{method} {path}: {reply}");
        if status != 413 {
            let error: Value =
                serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{path}: {e}: {reply}"));
            assert!(
                error["error"].is_string() && error["message"].is_string(),
                "{reply}"
            );
        }
    }
    // An account nobody has used is an empty account, not an error.
    let fresh = chain
        .client
        .get(&format!("/accounts/{}", Keypair::generate().address()))
        .unwrap();
    assert_eq!(units(&fresh["balance"]), 0);
    let openapi: Value = chain.client.get("/openapi.json").unwrap();
    for path in [
        "/accounts/{address}",
        "/txs",
        "/txs/batch",
        "/sessions/{hub}/{session}",
    ] {
        assert!(
            openapi["paths"][path].is_object(),
            "{path} missing from /openapi.json"
        );
    }
    let metrics = http(&chain.addr, "GET", "/metrics", "").1;
    assert!(metrics.contains("kvasir_height"), "{metrics}");
}

#[test]
fn the_wallet_reads_balances_sends_and_explains_failures_in_one_line() {
    let chain = start();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://{}", chain.addr);
    let faucet_key = dir.path().join("faucet.key");
    std::fs::copy(chain.dir_key("faucet"), &faucet_key).unwrap();
    let poor = dir.path().join("poor.key");
    let created = run("kvasir-wallet", &["new", "--keyfile", path_str(&poor)]);
    let poor_address = kvasir_tests::stdout(&created).trim().to_string();
    let wallet = |args: &[&str]| {
        let mut all = vec!["--url", url.as_str()];
        all.extend(args);
        run("kvasir-wallet", &all)
    };
    let sent = wallet(&[
        "transfer",
        &poor_address,
        "0.25",
        "--keyfile",
        path_str(&faucet_key),
        "--json",
    ]);
    assert!(sent.status.success(), "{}", stderr(&sent));
    let balance = wallet(&["balance", &poor_address, "--json"]);
    let account: Value = serde_json::from_str(&kvasir_tests::stdout(&balance)).unwrap();
    assert_eq!(account["balance"]["kvr"], "0.25");
    let text = wallet(&["balance", "--keyfile", path_str(&poor)]);
    assert!(
        kvasir_tests::stdout(&text).contains("settled 0.25 KVR, pending 0 KVR"),
        "{}",
        kvasir_tests::stdout(&text)
    );
    let history = wallet(&["history", "--keyfile", path_str(&poor), "--json"]);
    let history: Value = serde_json::from_str(&kvasir_tests::stdout(&history)).unwrap();
    assert_eq!(history["entries"][0]["kind"], "transfer");
    assert_eq!(history["entries"][0]["direction"], "in");
    assert_eq!(history["entries"][0]["amount"]["kvr"], "0.25");
    let lines = kvasir_tests::stdout(&wallet(&["history", "--keyfile", path_str(&poor)]));
    assert!(lines.contains("in  0.25 KVR from"), "{lines}");
    let someone = Keypair::generate().address().to_string();
    for (args, says) in [
        (
            vec!["transfer", &someone, "5", "--keyfile", path_str(&poor)],
            "insufficient",
        ),
        (
            vec!["transfer", "kvr1nope", "1", "--keyfile", path_str(&poor)],
            "invalid value",
        ),
        (
            vec!["history", "--before", "1&x=2", "--keyfile", path_str(&poor)],
            "is not height",
        ),
        (
            vec![
                "transfer",
                &someone,
                "1.0000000001",
                "--keyfile",
                path_str(&poor),
            ],
            "invalid value",
        ),
    ] {
        let failed = wallet(&args);
        assert!(!failed.status.success(), "{args:?}");
        let message = stderr(&failed);
        assert!(message.to_lowercase().contains(says), "{args:?}: {message}");
        assert!(message.starts_with("error: "), "{message}");
    }
    let unreachable = run(
        "kvasir-wallet",
        &["balance", &poor_address, "--url", "http://127.0.0.1:9"],
    );
    assert!(!unreachable.status.success());
    let message = stderr(&unreachable);
    assert!(
        message.starts_with("error: cannot reach http://127.0.0.1:9"),
        "{message}"
    );
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
}
