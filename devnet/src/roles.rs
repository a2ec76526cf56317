//! The roles' command lines, written once: `dev`, the benches and the test scenarios start
//! hub, gateway, ledger nodes and workers through these, adding what their case needs.

use std::ffi::OsStr;
use std::path::Path;

use crate::chain::{genesis_path, key_path};

/// A `kvasir-node` command line being built.
#[derive(Clone, Debug, Default)]
pub struct Args(Vec<String>);

impl Args {
    pub fn role(role: &str) -> Args {
        Args(vec![role.to_string()])
    }

    /// `--flag value`.
    pub fn flag(mut self, flag: &str, value: impl AsRef<OsStr>) -> Args {
        self.0.push(flag.to_string());
        self.0.push(value.as_ref().to_string_lossy().into_owned());
        self
    }

    /// A flag without a value (`--json`).
    pub fn switch(mut self, flag: &str) -> Args {
        self.0.push(flag.to_string());
        self
    }

    /// More arguments as they are.
    pub fn extend<S: AsRef<str>>(mut self, more: &[S]) -> Args {
        self.0.extend(more.iter().map(|a| a.as_ref().to_string()));
        self
    }

    pub fn into_vec(self) -> Vec<String> {
        self.0
    }
}

/// A hub of the chain in `chain` (its `keys/hub.key`), keeping its receipts in `data`,
/// taking the backbone whose address is `backbone`.
pub fn hub(chain: &Path, data: &Path, listen: &str, registry_listen: &str, backbone: &str) -> Args {
    Args::role("hub")
        .flag("--listen", listen)
        .flag("--registry-listen", registry_listen)
        .flag("--key", key_path(chain, "hub"))
        .flag("--genesis", genesis_path(chain))
        .flag("--backbone", backbone)
        .flag("--data-dir", data)
}

/// A gateway in front of `hub`, its self-signed certificate written to `cert`.
pub fn gateway(cert: &Path, listen: &str, hub: &str) -> Args {
    Args::role("gateway")
        .flag("--listen", listen)
        .switch("--self-signed")
        .flag("--cert-out", cert)
        .flag("--hub", hub)
}

/// What a crediting gateway adds: the ledger it credits to, the hub registry it polls
/// (`host:port`), the chain's gateway key (in `chain`), and how often it credits.
pub fn crediting(
    gateway: Args,
    ledger: &str,
    registry: &str,
    chain: &Path,
    interval_ms: u64,
) -> Args {
    gateway
        .flag("--ledger", ledger)
        .flag("--registry", format!("http://{registry}"))
        .flag("--key", key_path(chain, "gateway"))
        .flag("--credit-interval-ms", interval_ms.to_string())
}

/// A ledger node of the chain in `chain`, storing in `data`, its REST API on `listen`.
pub fn ledger(chain: &Path, data: &Path, listen: &str) -> Args {
    Args::role("ledger")
        .flag("--genesis", genesis_path(chain))
        .flag("--data-dir", data)
        .flag("--listen", listen)
}

/// A worker dialling `url` with the wallet key in `keyfile`, holding `experts` of `model`,
/// trusting the gateway certificate in `ca`.
pub fn worker(url: &str, keyfile: &Path, model: &Path, experts: &str, ca: &Path) -> Args {
    Args::role("worker")
        .flag("--gateway", url)
        .flag("--keyfile", keyfile)
        .flag("--model", model)
        .flag("--experts", experts)
        .flag("--ca", ca)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_name_the_chain_files() {
        let chain = Path::new("/c");
        let args = hub(chain, Path::new("/d"), "a:1", "b:2", "kvsr1x").into_vec();
        assert_eq!(
            args,
            [
                "hub",
                "--listen",
                "a:1",
                "--registry-listen",
                "b:2",
                "--key",
                "/c/keys/hub.key",
                "--genesis",
                "/c/genesis.json",
                "--backbone",
                "kvsr1x",
                "--data-dir",
                "/d"
            ]
        );
        let gateway = crediting(gateway(Path::new("/cert"), "l", "h"), "u", "r:3", chain, 9);
        assert_eq!(
            gateway.into_vec()[1..],
            [
                "--listen",
                "l",
                "--self-signed",
                "--cert-out",
                "/cert",
                "--hub",
                "h",
                "--ledger",
                "u",
                "--registry",
                "http://r:3",
                "--key",
                "/c/keys/gateway.key",
                "--credit-interval-ms",
                "9"
            ]
        );
    }
}
