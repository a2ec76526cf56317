//! The chain's command line over real processes: a fresh chain, the dev swarm with its
//! credits checked to the base unit, re-verification, and tampering caught by `verify-chain`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvasir_api::reports::{AddressReport, DevReport, GenesisReport, VerifyReport};
use kvasir_devnet::{Mode, Process};
use kvasir_keyfile::{Problem, PASSPHRASE_ENV};
use kvasir_ledger::fees::Lane;
use kvasir_ledger::{Address, Amount, Genesis, SledStore, Storage};
use kvasir_tests::{bin, path_str, run, stderr, stdout};

/// Two chains made alike, down to their name, do not take each other's signatures: a
/// transfer signed for one is refused by the other's ledger, under its own name or the
/// other's. The wallet remembers the chain a node URL served and refuses that URL serving
/// another, or a chain other than `--genesis` names; the dev chain's name is refused.
#[test]
fn chains_made_alike_refuse_each_others_signatures_and_the_wallet_its_node_of_another_chain() {
    let dir = tempfile::tempdir().unwrap();
    let init = |name: &str| {
        let out = dir.path().join(name);
        let output = run(
            "kvasir-node",
            &[
                "genesis",
                "init",
                "--out",
                path_str(&out),
                "--chain-id",
                "twin",
            ],
        );
        assert!(output.status.success(), "{}", stderr(&output));
        (Genesis::load(&out.join("genesis.json")).unwrap(), out)
    };
    let ((first, _), (second, second_dir)) = (init("first"), init("second"));
    assert_eq!(first.params.chain_id, second.params.chain_id);
    assert_ne!(first.chain_id(), second.chain_id());
    let taken = run(
        "kvasir-node",
        &[
            "genesis",
            "init",
            "--out",
            path_str(&dir.path().join("dev")),
            "--chain-id",
            "kvasir-dev",
        ],
    );
    kvasir_tests::wallet::one_line_error(&taken, "published dev chain");

    let node = kvasir_tests::wallet::Node::start(&second_dir, &dir.path().join("ledger"));
    let client = kvasir_api::Client::new(&node.url);
    let faucet = kvasir_keyfile::parse(
        &std::fs::read_to_string(second_dir.join("keys/faucet.key")).unwrap(),
        None,
    )
    .unwrap();
    let transfer = || kvasir_ledger::TxKind::Transfer {
        to: Address::from_bytes([9; 32]),
        amount: kvasir_ledger::Amount::parse("1").unwrap(),
    };
    // Signed for the first chain: refused, whether it names that chain or this one.
    let fee = client.fees().unwrap().bid(Lane::Open, Amount::ZERO);
    let signed = transfer().signed_paying(&first.chain_id(), fee, &faucet, 0);
    let refused = client.submit(&signed).unwrap_err().to_string();
    assert!(refused.contains("chain"), "{refused}");
    let mut renamed = signed.clone();
    renamed.tx.chain_id = second.chain_id();
    let refused = client.submit(&renamed).unwrap_err().to_string();
    assert!(refused.contains("signature"), "{refused}");
    // Signed for this one: taken.
    client
        .submit(&transfer().signed_paying(&second.chain_id(), fee, &faucet, 0))
        .unwrap();

    let key = dir.path().join("wallet/wallet.key");
    let created = kvasir_tests::wallet::wallet(&["new", "--keyfile", path_str(&key)], None);
    assert!(created.status.success(), "{}", stderr(&created));
    // `--genesis` of the other chain: refused, naming both.
    let other = first.hash().to_string();
    let refused = node.wallet(&key, &["balance", "--genesis", &other]);
    kvasir_tests::wallet::one_line_error(&refused, &second.hash().to_string());
    // First use: remembered beside the key file; then a node of another chain at that URL
    // (as the file says it was) is refused.
    let first_use = node.wallet(&key, &["balance"]);
    assert!(first_use.status.success(), "{}", stderr(&first_use));
    assert!(
        stderr(&first_use).contains("now remembered"),
        "{}",
        stderr(&first_use)
    );
    // Remembered: said no more.
    let again = node.wallet(&key, &["balance"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(stderr(&again).is_empty(), "{}", stderr(&again));
    let known = dir.path().join("wallet/known-chains.json");
    let remembered = std::fs::read_to_string(&known).unwrap();
    assert!(
        remembered.contains(&second.hash().to_string()),
        "{remembered}"
    );
    std::fs::write(
        &known,
        remembered.replace(&second.hash().to_string(), &other),
    )
    .unwrap();
    let refused = node.wallet(&key, &["balance"]);
    kvasir_tests::wallet::one_line_error(&refused, &other);
    // `--genesis` of the chain it serves moves the URL on to it, remembered from then on.
    let moved = node.wallet(&key, &["balance", "--genesis", &second.hash().to_string()]);
    assert!(moved.status.success(), "{}", stderr(&moved));
    let after = node.wallet(&key, &["balance"]);
    assert!(after.status.success(), "{}", stderr(&after));
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
    let report: GenesisReport = serde_json::from_str(&stdout(&output)).unwrap();
    let genesis = Genesis::load(&out.join("genesis.json")).unwrap();
    assert_eq!(report.genesis_hash, genesis.hash());
    // Without --chain-id, a fresh random name on the template's; format 2.
    // The chain id signatures commit to: the name and the genesis hash.
    let (name, hash) = report.chain_id.split_once(':').unwrap();
    assert_eq!(hash, genesis.hash().to_string());
    let random = name.strip_prefix("kvasir-").unwrap();
    assert!(
        random.len() == 8 && random.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}",
        report.chain_id
    );
    assert_eq!(genesis.params.format, kvasir_ledger::genesis::FORMAT);
    assert_eq!(report.keys.len(), 4);
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

/// Runs `dev` on the tiny preset; its JSON report.
fn dev(data: &Path) -> DevReport {
    dev_with(data, &[]).0
}

/// As `dev`, with `extra` arguments; also what it printed.
fn dev_with(data: &Path, extra: &[&str]) -> (DevReport, String) {
    dev_preset(data, "tiny", extra)
}

/// As `dev_with`, serving `preset`.
fn dev_preset(data: &Path, preset: &str, extra: &[&str]) -> (DevReport, String) {
    dev_serving(data, &[&["--preset", preset], extra].concat())
}

/// `dev` for 8 tokens with the arguments that say what it serves (and others).
fn dev_serving(data: &Path, extra: &[&str]) -> (DevReport, String) {
    let mut args = vec![
        "dev",
        "--data-dir",
        path_str(data),
        "--tokens",
        "8",
        "--json",
    ];
    args.extend_from_slice(extra);
    let output = run("kvasir-node", &args);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains("8/8 tokens identical, logits identical"),
        "{text}"
    );
    let json = text
        .lines()
        .find(|l| l.starts_with('{'))
        .expect("a JSON report");
    let report: DevReport = serde_json::from_str(json).unwrap();
    // It went remote: requests reached the workers and none fell back.
    assert!(
        report.remote_requests > 0 && report.fallbacks == 0,
        "{report:?}"
    );
    (report, text)
}

/// Every honest worker's pending + settled rewards equal `earned` of each of its sessions'
/// metered bytes less its credits' fees (counted in the store of the chain in `data`), to
/// the base unit; a worker caught lying holds none (its pending was cancelled, and its later
/// credits paid nothing).
fn assert_paid_exactly(report: &DevReport, genesis: &Genesis, data: &Path) {
    let store = SledStore::open(&kvasir_devnet::loopback::ledger_dir(data, 0)).unwrap();
    for worker in &report.workers {
        let account = &worker.account;
        let held =
            account.balance.base_units.base_units() + account.pending_total.base_units.base_units();
        if report.caught.iter().any(|c| c.address == worker.address) {
            assert_eq!(held, 0, "caught worker {}: {account:?}", worker.address);
            continue;
        }
        let earned: u64 = report
            .sessions
            .iter()
            .filter(|s| s.worker == worker.address)
            .map(|s| genesis.earned(s.cumulative_bytes).unwrap().base_units())
            .sum();
        assert!(
            earned > 0,
            "worker {} earned nothing: {report:?}",
            worker.address
        );
        let fees = kvasir_tests::pay::credits_in_store(&store, &worker.address)
            * kvasir_tests::pay::credit_fee(genesis);
        assert_eq!(
            held,
            earned - fees,
            "worker {}: {account:?}",
            worker.address
        );
    }
    // This run's pay came from its market order's escrow: what the honest workers earned in
    // its sessions, to the base unit, and exactly what left the escrow.
    let market = &report.market;
    let order = market.order.id;
    let honest_earned: u64 = report
        .sessions
        .iter()
        .filter(|s| s.order == order && !report.caught.iter().any(|c| c.address == s.worker))
        .map(|s| genesis.earned(s.cumulative_bytes).unwrap().base_units())
        .sum();
    assert_eq!(
        market.order.paid.base_units.base_units(),
        honest_earned,
        "{market:?}"
    );
    assert_eq!(
        market.escrow_before.base_units,
        market
            .order
            .escrow
            .base_units
            .checked_add(market.order.paid.base_units)
            .unwrap()
    );
    assert_eq!(market.placements.len(), report.workers.len(), "{market:?}");
}

/// `dev --dishonest 1`: the last worker signs wrong answers; the backbone's audit catches it
/// and its evidence is committed: that session's pending cancelled, half the bond slashed,
/// the key jailed, the honest workers paid exactly, and the output still identical. A later
/// run replaces the jailed key with a fresh one.
#[test]
fn dev_dishonest_catches_the_liar_on_chain_and_the_output_stays_identical() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (report, text) = dev_with(&data, &["--workers", "3", "--dishonest", "1"]);
    let genesis = Genesis::load(&data.join("genesis.json")).unwrap();
    let min_bond = genesis.params.min_bond;
    assert!(!min_bond.is_zero());
    let liar = &report.workers[2];
    let caught_lines: Vec<&str> = text.lines().filter(|l| l.starts_with("caught:")).collect();
    assert_eq!(caught_lines.len(), 1, "{text}");
    assert!(
        caught_lines[0].contains(&liar.address.to_string())
            && caught_lines[0].contains("jailed until height"),
        "{text}"
    );
    assert!(text.contains("audits: "), "{text}");
    assert_eq!(report.caught.len(), 1, "{report:?}");
    let caught = &report.caught[0];
    assert_eq!(caught.address, liar.address);
    assert!(report.mismatches >= 1 && report.audits >= report.mismatches);
    // Half the bond slashed, the rest still bonded, jailed as the conviction says.
    assert_eq!(
        caught.slashed.base_units,
        genesis.params.slash_fraction.of(min_bond)
    );
    assert_eq!(
        liar.account.bonded.base_units,
        min_bond.checked_sub(caught.slashed.base_units).unwrap()
    );
    assert!(liar.account.jailed, "{:?}", liar.account);
    assert_eq!(liar.account.jailed_until, caught.jailed_until);
    assert!(
        report
            .sessions
            .iter()
            .any(|s| s.session_id == caught.session_id && s.worker == liar.address),
        "{report:?}"
    );
    assert_paid_exactly(&report, &genesis, &data);

    // The next run cannot serve with the jailed key: a fresh one takes its place.
    let (again, text) = dev_with(&data, &["--workers", "3"]);
    assert!(text.contains("is jailed until height"), "{text}");
    assert!(again.caught.is_empty(), "{again:?}");
    assert_ne!(again.workers[2].address, liar.address);
    assert_eq!(again.workers[0].address, report.workers[0].address);
    assert_paid_exactly(&again, &genesis, &data);
}

/// `dev --validators 4`: the same loop over four validator processes, a liar caught by
/// evidence the four decide on, every honest worker paid exactly; each validator's store
/// then verifies, certificates included.
#[test]
fn dev_over_four_validators_runs_the_whole_loop_and_every_store_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (report, _) = dev_with(
        &data,
        &["--validators", "4", "--workers", "3", "--dishonest", "1"],
    );
    let genesis = Genesis::load(&data.join("genesis.json")).unwrap();
    assert_eq!(genesis.authorities.validators.len(), 4);
    assert_eq!(report.caught.len(), 1, "{report:?}");
    assert_eq!(report.caught[0].address, report.workers[2].address);
    assert_paid_exactly(&report, &genesis, &data);
    let models: Vec<String> = ["tiny", "tiny-qwen2", "small", "qwen35-small"]
        .iter()
        .map(|name| path_str(&data.join(format!("model-{name}"))).to_string())
        .collect();
    let models: Vec<&str> = models.iter().flat_map(|m| ["--model", m]).collect();
    for index in 0..4 {
        let store = kvasir_devnet::loopback::ledger_dir(&data, index);
        let genesis = data.join("genesis.json");
        let report = kvasir_tests::network::verify_chain(&store, &genesis, &models);
        assert!(report.contains("chain ok"), "validator {index}: {report}");
    }
}

/// The seed's own family, Qwen3.5-MoE (gated DeltaNet and gated attention layers, a
/// shared expert), served by the whole swarm as a Q4_0 GGUF file in llama.cpp's layout
/// (value heads tiled, norms plus one: what `model quantize` writes): every expert remote,
/// the output identical to the local run bit for bit, a dishonest worker caught, the others
/// paid exactly.
#[test]
fn dev_serves_qwen35_moe_quantized_remote_identical_to_local_and_pays_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (report, text) = dev_preset(
        &data,
        "qwen35-small",
        &["--quantize", "q4_0", "--workers", "3", "--dishonest", "1"],
    );
    assert!(
        text.contains("model qwen35-small quantized as Q4_0"),
        "{text}"
    );
    let genesis = Genesis::load(&data.join("genesis.json")).unwrap();
    assert_eq!(report.caught.len(), 1, "{report:?}");
    assert_paid_exactly(&report, &genesis, &data);
}

/// `dev --model FILE`: a Q4_K_M file made by llama.cpp's converter and `llama-quantize` (Q4_K
/// and Q6_K blocks), linked into the data dir, on a chain of its own that pins the file's
/// quantized blocks; every expert remote and the output identical to the local run bit for
/// bit, a liar convicted by evidence that carries its expert's blocks, the others paid
/// exactly. A model the chain does not pin is refused by name.
#[test]
fn dev_serves_a_llama_cpp_q4_k_m_file_remote_identical_to_local_and_convicts_a_liar() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../inference/tests/data/gguf/tiny-qwen3moe-q4_k_m.gguf"
    );
    let (report, text) = dev_serving(
        &data,
        &["--model", file, "--workers", "3", "--dishonest", "1"],
    );
    assert!(text.contains("tiny-qwen3moe-q4_k_m.gguf in"), "{text}");
    let genesis = Genesis::load(&data.join("genesis.json")).unwrap();
    let pin = genesis
        .models
        .iter()
        .find(|m| m.name == "tiny-qwen3moe-q4-k-m")
        .expect("the file's pin");
    assert_eq!(pin.arithmetic, 1);
    assert_eq!(report.caught.len(), 1, "{report:?}");
    assert_eq!(report.caught[0].address, report.workers[2].address);
    assert_paid_exactly(&report, &genesis, &data);

    let output = run(
        "kvasir-node",
        &["dev", "--data-dir", path_str(&data), "--quantize", "q8_0"],
    );
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("does not pin")
            && stderr(&output).contains("tiny-qwen3moe-q4-k-m"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn dev_runs_the_swarm_credits_exactly_and_verify_chain_catches_one_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first = dev(&data);
    let genesis = Genesis::load(&data.join("genesis.json")).unwrap();
    assert_paid_exactly(&first, &genesis, &data);
    assert_eq!(first.workers.len(), 2);

    // A second run reuses the chain, the keys and the model, and adds sessions.
    let second = dev(&data);
    assert_paid_exactly(&second, &genesis, &data);
    assert!(second.sessions.len() > first.sessions.len());
    assert_eq!(first.workers[0].address, second.workers[0].address);

    let ledger = data.join("ledger");
    let verify = run(
        "kvasir-node",
        &["verify-chain", "--data-dir", path_str(&ledger), "--json"],
    );
    assert!(verify.status.success(), "{}", stderr(&verify));
    let report: VerifyReport = serde_json::from_str(&stdout(&verify)).unwrap();
    assert!(report.ok && report.transactions >= 4, "{report:?}");

    // The worker really holds what dev printed, under the address of its own key file.
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
        second.workers[0].address
    );
    // Tamper with the latest block that carries transactions.
    let (height, original) = {
        let store = SledStore::open(&ledger).unwrap();
        let height = (1..=store.head().unwrap())
            .rev()
            .find(|h| !store.block(*h).unwrap().unwrap().txs.is_empty())
            .expect("a block with transactions");
        (height, store.block_bytes(height).unwrap().unwrap())
    };
    // Flip one byte at several places in that block (header, signature, transactions).
    for at in [
        3,
        original.len() / 3,
        original.len() / 2,
        original.len() - 1,
    ] {
        let mut tampered = original.clone();
        tampered[at] ^= 0x01;
        SledStore::open(&ledger)
            .unwrap()
            .tamper_block_bytes(height, &tampered)
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
        assert!(
            message.contains(&format!("block {height} is bad")),
            "byte {at}: {message}"
        );
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
    let report: AddressReport = serde_json::from_str(&stdout(&created)).unwrap();
    let address = report.address;
    assert_eq!(report.keyfile, keyfile);
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
    let message = stderr(&broken);
    assert!(
        message.starts_with(&format!(
            "error: key file {}: not valid JSON",
            keyfile.display()
        )),
        "{message}"
    );
}

/// With `--backend cuda` the workers either run their experts on a GPU and the output still
/// equals the local CPU run bit for bit, or (no CUDA build, no GPU) `dev` stops with an
/// error that says so, never a panic.
#[test]
fn dev_with_cuda_workers_is_identical_output_or_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let output = run(
        "kvasir-node",
        &[
            "dev",
            "--data-dir",
            path_str(&dir.path().join("data")),
            "--preset",
            "tiny",
            "--tokens",
            "8",
            "--backend",
            "cuda",
        ],
    );
    let (out, err) = (stdout(&output), stderr(&output));
    if output.status.success() {
        assert!(
            out.contains("8/8 tokens identical, logits identical"),
            "{out}"
        );
        return;
    }
    assert!(!err.contains("panicked"), "{err}");
    let first = err.lines().find(|l| l.starts_with("error: ")).unwrap_or("");
    assert!(
        first.contains("CUDA") || first.contains("libcuda") || first.contains("libnvrtc"),
        "{err}"
    );
}

/// `kvasir-node` with `args`, stdin closed and `KVASIR_PASSPHRASE` set to `passphrase` (or
/// unset).
fn node(args: &[&str], passphrase: Option<&str>) -> Command {
    let mut command = Command::new(bin("kvasir-node"));
    command
        .args(args)
        .env_remove(PASSPHRASE_ENV)
        .stdin(Stdio::null());
    if let Some(passphrase) = passphrase {
        command.env(PASSPHRASE_ENV, passphrase);
    }
    command
}

#[test]
fn genesis_init_encrypt_seals_every_key_and_a_role_opens_its_key_with_the_passphrase() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("chain");
    let init = node(
        &["genesis", "init", "--encrypt", "--out", path_str(&out)],
        Some("correct horse"),
    )
    .output()
    .unwrap();
    assert!(init.status.success(), "{}", stderr(&init));
    assert!(
        stdout(&init).contains("(mode 0600, sealed)"),
        "{}",
        stdout(&init)
    );
    for role in ["validator", "gateway", "hub", "faucet"] {
        let key = out.join("keys").join(format!("{role}.key"));
        let text = std::fs::read_to_string(&key).unwrap();
        assert!(
            text.contains("\"sealed\"") && !text.contains("secret_key"),
            "{role}: {text}"
        );
        let unopened = kvasir_keyfile::read(&key, None).unwrap_err();
        assert!(
            matches!(unopened.problem, Problem::NeedsPassphrase),
            "{role}"
        );
        kvasir_keyfile::read(&key, Some("correct horse")).unwrap();
    }
    // With no passphrase to seal with, it says so in one line and writes nothing.
    let other = dir.path().join("other");
    let refused = node(
        &["genesis", "init", "--encrypt", "--out", path_str(&other)],
        None,
    )
    .output()
    .unwrap();
    assert!(!refused.status.success());
    let message = stderr(&refused);
    assert!(message.contains("passphrase is needed"), "{message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    assert!(!other.exists());
    // A role started with the passphrase in its environment opens its sealed key.
    let (genesis, data, key) = (
        out.join("genesis.json"),
        dir.path().join("ledger"),
        out.join("keys/validator.key"),
    );
    let ledger_args = [
        "ledger",
        "--listen",
        "127.0.0.1:0",
        "--genesis",
        path_str(&genesis),
        "--data-dir",
        path_str(&data),
        "--key",
        path_str(&key),
    ];
    let mut ledger = Process::spawn(
        node(&ledger_args, Some("correct horse")),
        "ledger",
        Mode::Test,
    )
    .unwrap();
    ledger.listening("ledger").unwrap();
}

#[test]
fn a_hub_on_an_exposed_address_refuses_the_dev_chain_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Path::new(env!("CARGO_MANIFEST_DIR")).join("../genesis/dev");
    // The published hub key, copied private (as `dev` installs it).
    let key = dir.path().join("hub.key");
    let text = std::fs::read_to_string(dev.join("keys/hub.key")).unwrap();
    let hub_key = kvasir_keyfile::parse(&text, None).unwrap();
    kvasir_keyfile::write(&key, &hub_key, None).unwrap();
    let backbone = hub_key.address().to_string();
    let (genesis, data) = (dev.join("genesis.json"), dir.path().join("hub-data"));
    let hub = |extra: &[&str]| {
        let mut args = vec![
            "hub",
            "--listen",
            "0.0.0.0:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--allow-public",
            "--genesis",
            path_str(&genesis),
            "--key",
            path_str(&key),
            "--backbone",
            &backbone,
            "--data-dir",
            path_str(&data),
        ];
        args.extend_from_slice(extra);
        kvasir_tests::start("kvasir-node", &args)
    };
    let (code, message) = hub(&[]).wait_for_exit(Duration::from_secs(60)).unwrap();
    assert_eq!(code, Some(1), "{message}");
    assert!(
        message.starts_with("error: hub would serve the published dev chain on 0.0.0.0:0")
            && message.contains("--allow-dev-chain"),
        "{message}"
    );
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    let mut allowed = hub(&["--allow-dev-chain"]);
    allowed.listening("hub").unwrap();
}

#[test]
fn verify_chain_refuses_a_store_of_another_genesis_and_warns_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let genesis = |name: &str| {
        let out = dir.path().join(name);
        let init = run("kvasir-node", &["genesis", "init", "--out", path_str(&out)]);
        assert!(init.status.success(), "{}", stderr(&init));
        (
            Genesis::load(&out.join("genesis.json")).unwrap(),
            out.join("genesis.json"),
        )
    };
    let ((ours, our_file), (theirs, their_file)) = (genesis("ours"), genesis("theirs"));
    let data = dir.path().join("ledger");
    drop(SledStore::open_or_create(&data, &ours).unwrap());
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify-chain", "--data-dir", path_str(&data)];
        args.extend_from_slice(extra);
        run("kvasir-node", &args)
    };
    let refused = verify(&["--genesis", path_str(&their_file)]);
    assert!(!refused.status.success());
    let message = stderr(&refused);
    assert!(
        message.starts_with("error: ")
            && message.contains(&ours.hash().to_string())
            && message.contains(&theirs.hash().to_string()),
        "{message}"
    );
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    let checked = verify(&["--genesis", path_str(&our_file)]);
    assert!(checked.status.success(), "{}", stderr(&checked));
    assert!(
        !stderr(&checked).contains("warning"),
        "{}",
        stderr(&checked)
    );
    let trusted = verify(&[]);
    assert!(trusted.status.success(), "{}", stderr(&trusted));
    assert!(
        stderr(&trusted).contains("warning: no --genesis given"),
        "{}",
        stderr(&trusted)
    );
}
