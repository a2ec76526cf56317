//! The chain each node URL serves, as this wallet first saw it (trust on first use), kept in
//! `known-chains.json` beside the key file. A node that later reports another genesis (a
//! node of another chain at the same address, or an impostor) is refused before anything is
//! read from it or signed for it; `--genesis HASH` names the chain instead of the file.
//! Signatures commit to the chain id the node reports, which on a format-2 chain carries the
//! genesis hash (`NAME:HASH`), so it is checked to carry the expected one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::Hash;

/// The file's name, in the key file's directory.
const FILE: &str = "known-chains.json";

/// Where the wallet of `keyfile` remembers chains.
pub fn known_chains_path(keyfile: &Path) -> PathBuf {
    keyfile
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .join(FILE)
}

/// The node's chain, as checked.
pub struct Checked {
    /// What to sign with.
    pub chain_id: String,
    /// When `url` was seen for the first time, a line that says which chain was remembered
    /// (said once the command succeeds, so that an error stays one line).
    pub first_use: Option<String>,
}

/// The chain id to sign with at the node `client` serves at `url`, once its genesis hash is
/// `expected` (`--genesis`), or else the one remembered for `url` in `known` (remembered now
/// when none is).
pub fn check(client: &Client, url: &str, known: &Path, expected: Option<Hash>) -> Result<Checked> {
    let params = client.params()?;
    let reported = params.genesis_hash;
    let mut chains = read(known)?;
    let mut first_use = None;
    let (want, from) = match (expected, chains.get(url)) {
        (Some(hash), _) => (hash, "--genesis".to_string()),
        (None, Some(hash)) => (*hash, format!("{} remembers for it", known.display())),
        (None, None) => {
            chains.insert(url.to_string(), reported);
            write(known, &chains)?;
            first_use = Some(format!(
                "first use of {url}: its chain (genesis {reported}) is remembered in {}",
                known.display()
            ));
            (reported, String::new())
        }
    };
    if reported != want {
        bail!("{url} serves the chain of genesis {reported}, not {want} as {from}; if that chain was really replaced, pass --genesis {reported}");
    }
    if params.format >= 2 && !params.chain_id.ends_with(&format!(":{reported}")) {
        bail!(
            "{url} names its chain {:?}, which does not carry its genesis hash {reported}",
            params.chain_id
        );
    }
    Ok(Checked {
        chain_id: params.chain_id,
        first_use,
    })
}

fn read(path: &Path) -> Result<BTreeMap<String, Hash>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a map of node URLs to genesis hashes",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Written whole to a temporary file, then renamed over the old one: never half written.
fn write(path: &Path, chains: &BTreeMap<String, Hash>) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let temporary = path.with_extension("json.new");
    let mut text = serde_json::to_string_pretty(chains)?;
    text.push('\n');
    std::fs::write(&temporary, text).with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))
}

/// The URL of a node given as `text` (or of each, in a comma-separated list): as it is with a
/// scheme; without one, `https://` unless its host is this machine (`localhost`, 127.0.0.0/8,
/// ::1), where `http://` is what a ledger node serves.
pub fn node_url(text: &str) -> String {
    text.split(',').map(one_url).collect::<Vec<_>>().join(",")
}

fn one_url(text: &str) -> String {
    if text.contains("://") {
        return text.to_string();
    }
    let authority = text.split('/').next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    };
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let scheme = if loopback { "http" } else { "https" };
    format!("{scheme}://{text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_scheme_is_https_unless_it_is_this_machine() {
        assert_eq!(node_url("ledger.example:443"), "https://ledger.example:443");
        assert_eq!(node_url("203.0.113.9:7200/x"), "https://203.0.113.9:7200/x");
        assert_eq!(node_url("127.0.0.1:7200"), "http://127.0.0.1:7200");
        assert_eq!(node_url("localhost:7200"), "http://localhost:7200");
        assert_eq!(node_url("[::1]:7200"), "http://[::1]:7200");
        assert_eq!(node_url("[2001:db8::1]:7200"), "https://[2001:db8::1]:7200");
        assert_eq!(node_url("http://ledger.example"), "http://ledger.example");
        assert_eq!(
            node_url("127.0.0.1:1,ledger.example"),
            "http://127.0.0.1:1,https://ledger.example"
        );
    }

    #[test]
    fn the_known_chains_file_is_beside_the_key_file_and_a_bad_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let known = known_chains_path(&dir.path().join("wallet.key"));
        assert_eq!(known, dir.path().join(FILE));
        assert!(read(&known).unwrap().is_empty());
        let chains = BTreeMap::from([("https://a".to_string(), Hash([7; 32]))]);
        write(&known, &chains).unwrap();
        assert_eq!(read(&known).unwrap(), chains);
        std::fs::write(&known, "[1, 2]").unwrap();
        assert!(read(&known).is_err());
        assert_eq!(
            known_chains_path(Path::new("wallet.key")),
            Path::new(".").join(FILE)
        );
    }
}
