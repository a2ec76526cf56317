//! The ledger service's REST API over a real process: good transactions commit, and every
//! kind of bad input gets the right status and changes nothing.

use std::time::Duration;

use kvasir_api::ledger::{AccountView, Direction, History, HistoryEvent, TxState, ValidatorsView};
use kvasir_api::{Client, ClientError, ErrorBody};
use kvasir_devnet::Process;
use kvasir_ledger::fees::Lane;
use kvasir_ledger::{Amount, Genesis, Keypair, Receipt, SignedTx, TxKind};
use kvasir_tests::swarm::{http, start_ledger};
use kvasir_tests::{path_str, run, stderr};
use utoipa::openapi::{OpenApi, RefOr};

struct Chain {
    _dir: tempfile::TempDir,
    _ledger: Process,
    addr: String,
    client: Client,
    genesis: Genesis,
    key: Box<dyn Fn(&str) -> Keypair>,
    keys: std::path::PathBuf,
}

fn start() -> Chain {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain");
    kvasir_tests::genesis_init(&chain);
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
            kvasir_keyfile::read(&keys.join(format!("{role}.key")), None).unwrap()
        }),
    }
}

impl Chain {
    fn dir_key(&self, role: &str) -> std::path::PathBuf {
        self.keys.join(format!("{role}.key"))
    }

    fn account(&self, who: &Keypair) -> AccountView {
        self.client.account(&who.address()).unwrap()
    }

    fn nonce(&self, who: &Keypair) -> u64 {
        self.account(who).nonce
    }

    fn chain_id(&self) -> String {
        self.genesis.chain_id()
    }

    /// `kind` as transaction `nonce` of `key` on this chain, bidding the fee the node quotes.
    fn sign(&self, kind: TxKind, key: &Keypair, nonce: u64) -> SignedTx {
        let fee = self
            .client
            .fees()
            .unwrap()
            .bid(Lane::of(&kind), Amount::ZERO);
        kind.signed_paying(&self.chain_id(), fee, key, nonce)
    }

    /// Submits `tx` and waits until it is committed; its hash.
    fn commit(&self, tx: SignedTx) -> kvasir_ledger::Hash {
        let hash = self.client.submit(&tx).unwrap();
        self.client
            .wait_committed(&hash, Duration::from_secs(30))
            .unwrap();
        hash
    }

    /// Submits `tx`; the refusal's HTTP status and error kind, if refused.
    fn refused(&self, tx: &SignedTx) -> (u16, String) {
        match self.client.submit(tx) {
            Err(ClientError::Api { status, error, .. }) => (status, error),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
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
            order: 0,
            cumulative_bytes: bytes,
        }
        .sign(hub)
    };

    // A chain from the template asks workers for a bond before their credits pay: the faucet
    // funds the worker with exactly that and the bond's fee (the blocks are near empty, so
    // the base fee stays at its lowest), and the worker bonds all of it.
    let params = chain.client.params().unwrap();
    assert_eq!(params.chain_id, chain.chain_id());
    assert_eq!(params.genesis_hash, chain.genesis.hash());
    let min_bond = params.min_bond.base_units;
    assert!(!min_bond.is_zero() && params.unbonding_blocks > params.challenge_window);
    let bond = chain.sign(TxKind::Bond { amount: min_bond }, &worker, 0);
    let fees = chain.client.fees().unwrap();
    assert!(
        fees.charged && fees.base_fee == fees.min_base_fee,
        "{fees:?}"
    );
    let per_byte = |price: kvasir_api::ledger::AmountView, tx: &SignedTx| {
        Amount::from_base_units(price.base_units.base_units() * tx.to_bytes().len() as u64)
    };
    let amount = min_bond
        .checked_add(per_byte(fees.base_fee, &bond))
        .unwrap();
    let to = worker.address();
    let fund = chain.sign(
        TxKind::Transfer { to, amount },
        &faucet,
        chain.nonce(&faucet),
    );
    chain.commit(fund);
    chain.commit(bond);
    let bonded = chain.account(&worker);
    assert_eq!(bonded.bonded.base_units, min_bond, "{bonded:?}");
    assert!(bonded.balance.base_units.is_zero() && !bonded.jailed && bonded.jailed_until == 0);

    // A good credit commits and pays exactly earned(bytes) less its fee (at the reserved
    // lane's price), pending under its session.
    let credit = chain.sign(
        TxKind::Credit(receipt(&hub, chain.chain_id(), 1_277_952)),
        &gateway,
        0,
    );
    let fee = per_byte(fees.lane_fee, &credit).base_units();
    let hash = chain.commit(credit);
    let paid = chain.account(&worker);
    assert_eq!(
        paid.pending_total.base_units.base_units(),
        8_945_664 - fee,
        "{paid:?}"
    );
    let session = paid.pending[0].session.expect("a credited session");
    assert_eq!((session.hub, session.session_id), (hub.address(), 7));
    let session = chain.client.session(&hub.address(), 7, 0).unwrap();
    assert_eq!(session.cumulative_bytes, 1_277_952);
    assert_eq!(session.worker, Some(worker.address()));
    let history = chain.client.history(&worker.address(), None).unwrap();
    assert!(
        matches!(
            history.entries[0].event,
            HistoryEvent::Credit {
                cumulative_bytes: 1_277_952,
                ..
            }
        ),
        "{history:?}"
    );
    let committed = chain.client.tx_status(&hash).unwrap();
    let TxState::Committed { height, .. } = committed.state else {
        panic!("not committed: {committed:?}");
    };
    let block = chain.client.block(height).unwrap();
    assert!(block.txs.contains(&hash));
    assert_eq!(chain.client.block_by_hash(&block.hash).unwrap(), block);
    // Committed by the one validator's precommit, as the validator set says it must be.
    let validators: ValidatorsView = chain.client.get("/validators").unwrap();
    assert_eq!((validators.total_voting_power, validators.quorum), (1, 1));
    let validator = validators.validators[0].address;
    let certificate = block.certificate.expect("a certificate");
    assert_eq!(certificate.signatures.len(), 1);
    assert_eq!(certificate.signatures[0].validator, validator);
    assert_eq!(certificate.signatures[0].signature.len(), 128);
    assert_eq!(chain.client.head().unwrap().signers, vec![validator]);
    assert_eq!(chain.client.block(0).unwrap().certificate, None);

    // Unauthorised or stale credits: refused, nothing changes.
    let stranger = Keypair::generate();
    let bad: Vec<(&str, SignedTx)> = vec![
        (
            "a credit from a non-gateway key",
            chain.sign(
                TxKind::Credit(receipt(&hub, chain.chain_id(), 2_000_000)),
                &faucet,
                chain.nonce(&faucet),
            ),
        ),
        (
            "a receipt signed by a non-hub key",
            chain.sign(
                TxKind::Credit(receipt(&stranger, chain.chain_id(), 2_000_000)),
                &gateway,
                1,
            ),
        ),
        (
            "a receipt for another chain",
            chain.sign(
                TxKind::Credit(receipt(&hub, "another-chain".into(), 2_000_000)),
                &gateway,
                1,
            ),
        ),
        (
            "the same receipt again",
            chain.sign(
                TxKind::Credit(receipt(&hub, chain.chain_id(), 1_277_952)),
                &gateway,
                1,
            ),
        ),
        (
            "a transfer beyond the balance",
            chain.sign(
                TxKind::Transfer {
                    to: stranger.address(),
                    amount: Amount::parse("1").unwrap(),
                },
                &worker,
                chain.nonce(&worker),
            ),
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
    let mut forged = chain.sign(
        TxKind::Transfer {
            to: stranger.address(),
            amount: Amount::parse("1").unwrap(),
        },
        &faucet,
        chain.nonce(&faucet),
    );
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
        chain.sign(
            TxKind::Transfer {
                to: stranger.address(),
                amount: Amount::parse("0.5").unwrap(),
            },
            &faucet,
            chain.nonce(&faucet),
        ),
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
    let transfer = chain.sign(
        TxKind::Transfer {
            to: stranger.address(),
            amount,
        },
        &faucet,
        chain.nonce(&faucet),
    );
    chain.commit(transfer);
    assert_eq!(
        chain.account(&stranger).balance.base_units.base_units(),
        3_000_000_000
    );
    // The refusals above are counted by reason.
    let metrics = http(&chain.addr, "GET", "/metrics", "").1;
    assert!(
        metrics.contains("kvasir_refused_transactions_total{reason=\"BadSignature\"}"),
        "{metrics}"
    );
}

#[test]
fn a_flood_from_one_key_is_refused_past_its_window() {
    let chain = start();
    let faucet = (chain.key)("faucet");
    let pay = |from: &Keypair, nonce| {
        let to = Keypair::generate().address();
        let amount = Amount::parse("1").unwrap();
        chain.sign(TxKind::Transfer { to, amount }, from, nonce)
    };
    // A key with nothing cannot queue a transaction, at its next nonce or a later one.
    let broke = Keypair::generate();
    for nonce in [0, 5] {
        assert_eq!(
            chain.refused(&pay(&broke, nonce)),
            (422, "invalid_tx".to_string())
        );
    }
    assert_eq!(
        chain.refused(&pay(&broke, 16)),
        (429, "sender_limit".to_string())
    );
    // A funded one gets its window of 16 in, and the rest are refused with 429.
    let flood: Vec<SignedTx> = (0..40).map(|nonce| pay(&faucet, nonce)).collect();
    let verdicts = chain.client.submit_batch(&flood).unwrap();
    assert!(verdicts[..16].iter().all(Result::is_ok), "{verdicts:?}");
    for verdict in &verdicts[16..] {
        let refused = verdict.as_ref().unwrap_err();
        assert_eq!(refused.error, "sender_limit", "{refused:?}");
    }
}

#[test]
fn a_long_history_is_served_newest_first_in_pages() {
    let chain = start();
    let faucet = (chain.key)("faucet");
    let payee = Keypair::generate().address();
    // The first transfer creates the payee's account, so it carries the chain's minimum for
    // that; then 150 small ones. A sender has at most 16 waiting: a batch of 16 at a time.
    let minimum = chain.genesis.params.min_new_account.base_units();
    let sent: Vec<u64> = std::iter::once(minimum).chain(1..=150).collect();
    for (round, units) in sent.chunks(16).enumerate() {
        let txs: Vec<SignedTx> = units
            .iter()
            .zip(round as u64 * 16..)
            .map(|(units, nonce)| {
                let amount = kvasir_ledger::Amount::from_base_units(*units);
                chain.sign(TxKind::Transfer { to: payee, amount }, &faucet, nonce)
            })
            .collect();
        let admitted = chain.client.submit_batch(&txs).unwrap();
        let last = admitted.last().unwrap().clone().unwrap();
        chain
            .client
            .wait_committed(&last, std::time::Duration::from_secs(60))
            .unwrap();
    }
    let mut amounts = Vec::new();
    let mut before: Option<String> = None;
    loop {
        let page = chain.client.history(&payee, before.as_deref()).unwrap();
        assert!(page.entries.len() <= 100);
        for entry in &page.entries {
            match &entry.event {
                HistoryEvent::Transfer {
                    direction: Direction::In,
                    amount,
                    ..
                } => amounts.push(amount.base_units.base_units()),
                other => panic!("not a transfer in: {other:?}"),
            }
        }
        match page.next_before {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    // Together the pages list every transfer exactly once, newest (highest nonce) first, even
    // where a page ends inside a block.
    assert_eq!(amounts, sent.into_iter().rev().collect::<Vec<u64>>());
    let faucet_history = chain.client.history(&faucet.address(), None).unwrap();
    assert!(matches!(
        faucet_history.entries[0].event,
        HistoryEvent::Transfer {
            direction: Direction::Out,
            ..
        }
    ));
}

/// The statuses `/openapi.json` documents for `method` on the route that `path` matches (a
/// `{name}` segment matches any one segment); None for a path it does not describe.
fn documented_statuses(openapi: &OpenApi, method: &str, path: &str) -> Option<Vec<String>> {
    let path = path.split('?').next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').collect();
    let (_, item) = openapi.paths.paths.iter().find(|(template, _)| {
        let parts: Vec<&str> = template.split('/').collect();
        parts.len() == segments.len()
            && parts
                .iter()
                .zip(&segments)
                .all(|(t, s)| t == s || t.starts_with('{'))
    })?;
    let operation = match method {
        "GET" => item.get.as_ref(),
        "POST" => item.post.as_ref(),
        _ => None,
    }?;
    Some(operation.responses.responses.keys().cloned().collect())
}

#[test]
fn every_route_and_body_is_in_the_openapi_document() {
    let chain = start();
    let openapi: OpenApi = chain.client.get("/openapi.json").unwrap();
    for (method, path) in [
        ("GET", "/healthz"),
        ("GET", "/head"),
        ("GET", "/params"),
        ("GET", "/validators"),
        ("GET", "/accounts/{address}"),
        ("GET", "/accounts/{address}/history"),
        ("GET", "/blocks/{height}"),
        ("GET", "/blocks/by-hash/{hash}"),
        ("POST", "/txs"),
        ("POST", "/txs/batch"),
        ("GET", "/txs/{hash}"),
        ("GET", "/sessions/{hub}/{session}"),
        ("GET", "/sessions/{hub}"),
        ("GET", "/metrics"),
    ] {
        let item = openapi
            .paths
            .paths
            .get(path)
            .unwrap_or_else(|| panic!("{path} missing from /openapi.json"));
        let operation = match method {
            "GET" => item.get.as_ref(),
            _ => item.post.as_ref(),
        }
        .unwrap_or_else(|| panic!("{method} {path} missing from /openapi.json"));
        // Every response, errors included, says what its body is.
        for (status, response) in &operation.responses.responses {
            let RefOr::T(response) = response else {
                panic!("{method} {path} {status}: a bare reference")
            };
            let described = response.content.values().all(|c| c.schema.is_some());
            assert!(
                !response.content.is_empty() && described,
                "{method} {path} {status}: no body schema"
            );
        }
        if method == "POST" {
            assert!(
                operation.request_body.is_some(),
                "{path}: no request body schema"
            );
        }
    }
    for schema in [
        "AccountView",
        "ParamsView",
        "ValidatorsView",
        "CertificateView",
        "UnbondingView",
        "History",
        "TxStatus",
        "BatchVerdicts",
        "ErrorBody",
    ] {
        let components = openapi.components.as_ref().expect("components");
        assert!(
            components.schemas.contains_key(schema),
            "{schema} has no schema"
        );
    }
}

#[test]
fn malformed_requests_get_the_right_status_and_a_json_error() {
    let chain = start();
    let unknown_tx = format!("/txs/{}", "ab".repeat(32));
    let bad_page = format!(
        "/accounts/{}/history?before=soon",
        Keypair::generate().address()
    );
    let upper_account = format!(
        "/accounts/{}",
        Keypair::generate().address().to_string().to_uppercase()
    );
    let spaced_hash = format!("/blocks/by-hash/%20{}", "ab".repeat(32));
    let long_page = format!(
        "/accounts/{}/history?before=1.0000000001",
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
        ("GET", "/accounts/%FF", String::new(), 400),
        ("GET", "/txs", String::new(), 405),
        ("GET", "/sessions/kvr1x?after=-1", String::new(), 400),
        // Found by the contract test (tests/contract): a struct's array form, and text the
        // document's patterns do not admit.
        ("POST", "/txs", r#"["00"]"#.into(), 422),
        ("POST", "/txs/batch", "[[]]".into(), 422),
        ("GET", "/blocks/+1", String::new(), 400),
        ("GET", &spaced_hash, String::new(), 400),
        ("GET", &upper_account, String::new(), 400),
        ("GET", &long_page, String::new(), 400),
        // The market's reads: ids are decimal, filters typed, unknown objects 404.
        ("GET", "/offers/1", String::new(), 404),
        ("GET", "/orders/18446744073709551615", String::new(), 404),
        (
            "GET",
            "/placements/99999999999999999999",
            String::new(),
            400,
        ),
        ("GET", "/orders/+1", String::new(), 400),
        ("GET", "/offers?operator=kvr1x", String::new(), 400),
        ("GET", "/orders?buyer=nobody", String::new(), 400),
        ("GET", "/placements?order=-1", String::new(), 400),
        ("GET", "/offers?limit=lots", String::new(), 400),
        ("GET", "/coverage/m?layer=70000", String::new(), 400),
        ("POST", "/offers", String::new(), 405),
    ];
    let openapi: OpenApi = chain.client.get("/openapi.json").unwrap();
    for (method, path, body, expected) in &cases {
        let (status, reply) = http(&chain.addr, method, path, body);
        assert_eq!(status, *expected, "{method} {path}: {reply}");
        if let Some(documented) = documented_statuses(&openapi, method, path) {
            assert!(
                documented.contains(&status.to_string()),
                "{method} {path} answered {status}, which /openapi.json does not list: {documented:?}"
            );
        }
        let error: Result<ErrorBody, _> = serde_json::from_str(&reply);
        assert!(error.is_ok(), "{method} {path}: not an error body: {reply}");
    }
    // Empty market lists and coverage are empty pages, not errors; a huge limit is capped.
    let offers: kvasir_api::market::OfferPage = chain.client.get("/offers?limit=99999999").unwrap();
    assert!(offers.offers.is_empty() && offers.next_after.is_none());
    let coverage = chain.client.coverage("no such model/..", None).unwrap();
    assert!(coverage.experts.is_empty() && !coverage.truncated);
    // An order whose selection is beyond the chain's bounds is refused before the mempool.
    let buyer = (chain.key)("faucet");
    let huge = TxKind::OrderCreate(kvasir_ledger::tx::NewOrder {
        model: "m".into(),
        experts: kvasir_ledger::market::Selection(vec![kvasir_ledger::market::Rect {
            layers: (0, 999),
            experts: (0, 999),
        }]),
        replicas: 1,
        max_price: Amount::ZERO,
        deposit: Amount::parse("1").unwrap(),
        end_height: 1_000_000,
        delegate: None,
    });
    let huge = chain.sign(huge, &buyer, chain.nonce(&buyer));
    match chain.client.submit(&huge) {
        Err(ClientError::Api {
            status, message, ..
        }) => {
            assert_eq!(status, 422, "{message}");
            assert!(message.contains("over the limit of 16384"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // An account nobody has used is an empty account, not an error.
    let fresh = chain
        .client
        .account(&Keypair::generate().address())
        .unwrap();
    assert!(fresh.balance.base_units.is_zero() && fresh.nonce == 0);
    let metrics = http(&chain.addr, "GET", "/metrics", "").1;
    for line in [
        "# HELP kvasir_height ",
        "# TYPE kvasir_block_interval_seconds histogram",
        "kvasir_block_interval_seconds_bucket{le=\"+Inf\"} ",
        "# HELP kvasir_refused_transactions_total ",
    ] {
        assert!(metrics.contains(line), "{line:?} missing: {metrics}");
    }
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
    let account: AccountView = serde_json::from_str(&kvasir_tests::stdout(&balance)).unwrap();
    assert_eq!(account.balance.kvr.to_decimal(), "0.25");
    let text = wallet(&["balance", "--keyfile", path_str(&poor)]);
    assert!(
        kvasir_tests::stdout(&text).contains("settled 0.25 KVR, pending 0 KVR"),
        "{}",
        kvasir_tests::stdout(&text)
    );
    let history = wallet(&["history", "--keyfile", path_str(&poor), "--json"]);
    let history: History = serde_json::from_str(&kvasir_tests::stdout(&history)).unwrap();
    match &history.entries[0].event {
        HistoryEvent::Transfer {
            direction: Direction::In,
            amount,
            ..
        } => assert_eq!(amount.kvr.to_decimal(), "0.25"),
        other => panic!("not a transfer in: {other:?}"),
    }
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
        let message = kvasir_tests::wallet::error_text(&failed);
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
