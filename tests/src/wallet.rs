//! The wallet as a user runs it, against a ledger node started for the scenario.

use std::path::Path;
use std::process::Output;

use kvasir_devnet::Process;

use crate::swarm::start_ledger;
use crate::{path_str, stderr, stdout};

/// Runs `kvasir-wallet` with `args`, with `passphrase` as `KVASIR_PASSPHRASE` if given.
pub fn wallet(args: &[&str], passphrase: Option<&str>) -> Output {
    let mut command = crate::command("kvasir-wallet");
    command.args(args).env_remove("KVASIR_PASSPHRASE");
    if let Some(passphrase) = passphrase {
        command.env("KVASIR_PASSPHRASE", passphrase);
    }
    command.output().expect("running kvasir-wallet")
}

/// What a failed command printed on stderr, less the fee line a command that signs prints
/// first.
pub fn error_text(output: &Output) -> String {
    let printed = stderr(output);
    match printed.split_once('\n') {
        Some((fee, rest)) if fee.starts_with("fee: ") => rest.to_string(),
        _ => printed,
    }
}

/// `output` is a failure that says `says` (any case) in one `error: ` line (after the fee
/// line).
pub fn one_line_error(output: &Output, says: &str) {
    assert!(!output.status.success(), "{}", stdout(output));
    let message = error_text(output);
    assert!(message.starts_with("error: "), "{message}");
    assert!(message.to_lowercase().contains(says), "{says}: {message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
}

/// A ledger node on `chain` (a directory with `genesis.json` and `keys/`), and a way to run
/// the wallet against it with a key file.
pub struct Node {
    _ledger: Process,
    pub url: String,
}

impl Node {
    pub fn start(chain: &Path, data: &Path) -> Node {
        Node::of(start_ledger(chain, data))
    }

    fn of((ledger, addr): (Process, String)) -> Node {
        Node {
            _ledger: ledger,
            url: format!("http://{addr}"),
        }
    }

    pub fn wallet(&self, key: &Path, args: &[&str]) -> Output {
        let mut all = vec!["--url", &self.url, "--keyfile", path_str(key)];
        all.extend(args);
        wallet(&all, None)
    }

    /// The report `args` with `--json` prints; it must succeed.
    pub fn json(&self, key: &Path, args: &[&str]) -> String {
        let mut all = args.to_vec();
        all.push("--json");
        let output = self.wallet(key, &all);
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        stdout(&output)
    }

    /// A new key file at `key`, paid `amount` KVR by the chain's faucet; its address.
    pub fn funded_key(&self, chain: &Path, key: &Path, amount: &str) -> String {
        let created = wallet(&["new", "--keyfile", path_str(key)], None);
        assert!(created.status.success(), "{}", stderr(&created));
        let address = stdout(&created).trim().to_string();
        let faucet = chain.join("keys/faucet.key");
        let paid = self.wallet(&faucet, &["transfer", &address, amount]);
        assert!(paid.status.success(), "{}", stderr(&paid));
        address
    }
}
