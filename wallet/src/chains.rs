//! The chain each node URL serves, as this wallet first saw it (trust on first use), kept in
//! `known-chains.json` beside the key file. A node that later reports another genesis or
//! chain id (a node of another chain at the same address, or an impostor) is refused before
//! anything is read from it or signed for it; `--genesis HASH` names the chain instead of the
//! file, and is remembered in its place. Signatures commit to the chain id the node reports,
//! which on a format-2 chain carries the genesis hash (`NAME:HASH`), so it is checked to carry
//! the expected one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::Hash;
use serde::{Deserialize, Serialize};

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

/// What the wallet remembers of a node URL: the chain it served the first time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Known {
    genesis: Hash,
    /// What it signed for there: `NAME:GENESIS` on a format-2 chain, a format-1 chain's name.
    chain_id: String,
}

/// The node's chain, as checked.
pub struct Checked {
    /// What to sign with.
    pub chain_id: String,
    /// When `url` was seen for the first time (or `--genesis` moved it to another chain), a
    /// line that says which chain is now remembered (said once the command succeeds, so that
    /// an error stays one line).
    pub remembered: Option<String>,
}

/// The chain id to sign with at the node `client` serves at `url`. Its genesis must be
/// `expected` (`--genesis`), or else the one remembered for `url` in `known`, and its chain id
/// the one remembered with it; the first time (or when `--genesis` names another chain) both
/// are remembered, once checked. A chain id with a genesis hash must carry the node's; one
/// without (a format-1 chain's bare name) is taken only from a node that says its chain is
/// format 1, never with `--genesis`, and, remembered, only from that URL.
pub fn check(client: &Client, url: &str, known: &Path, expected: Option<Hash>) -> Result<Checked> {
    let params = client.params()?;
    let (reported, chain_id) = (params.genesis_hash, params.chain_id);
    let carries_hash = chain_id.ends_with(&format!(":{reported}"));
    // A bare name binds no signature to a genesis, and nothing here can check a node's word
    // that its chain is format 1: with `--genesis`, only an id carrying that hash is taken.
    if !carries_hash && (params.format >= 2 || chain_id.contains(':') || expected.is_some()) {
        bail!(
            "{url} names its chain {chain_id:?}, which does not carry its genesis hash {reported}"
        );
    }
    let mut chains = read(known)?;
    let stored = chains.get(url).cloned();
    let want = expected
        .or(stored.as_ref().map(|k| k.genesis))
        .unwrap_or(reported);
    if reported != want {
        let from = match expected {
            Some(_) => "--genesis names".to_string(),
            None => format!("{} remembers for it", known.display()),
        };
        bail!("{url} serves the chain of genesis {reported}, not {want} as {from}; if that chain was really replaced, pass --genesis {reported}");
    }
    let now = Known {
        genesis: reported,
        chain_id: chain_id.clone(),
    };
    let remembered = match stored {
        Some(stored) if stored == now => None,
        Some(stored) if stored.genesis == now.genesis => bail!(
            "{url} now names its chain {chain_id:?}, not {:?} as {} remembers",
            stored.chain_id,
            known.display()
        ),
        _ => {
            chains.insert(url.to_string(), now);
            write(known, &chains)?;
            Some(format!(
                "{url} serves chain {chain_id} (genesis {reported}), now remembered in {}",
                known.display()
            ))
        }
    };
    Ok(Checked {
        chain_id,
        remembered,
    })
}

fn read(path: &Path) -> Result<BTreeMap<String, Known>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a map of node URLs to the chain each served",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Written whole to a temporary file of its own, then renamed over the old one: a reader
/// never sees it half written. (Two wallets remembering two new URLs at the same instant may
/// keep only one; the other is remembered again at its next use.)
fn write(path: &Path, chains: &BTreeMap<String, Known>) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut text = serde_json::to_string_pretty(chains)?;
    text.push('\n');
    let mut temporary = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("writing in {}", dir.display()))?;
    std::io::Write::write_all(&mut temporary, text.as_bytes())
        .with_context(|| format!("writing in {}", dir.display()))?;
    temporary
        .persist(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The URL of a node given as `text` (or of each, in a comma-separated list): as it is with a
/// scheme; without one, `https://` unless its host is this machine (`localhost`, 127.0.0.0/8,
/// ::1), where `http://` is what a ledger node serves.
pub fn node_url(text: &str) -> String {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(one_url)
        .collect::<Vec<_>>()
        .join(",")
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
            node_url("127.0.0.1:1, ledger.example,,"),
            "http://127.0.0.1:1,https://ledger.example"
        );
    }

    #[test]
    fn the_known_chains_file_is_beside_the_key_file_and_a_bad_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let known = known_chains_path(&dir.path().join("wallet.key"));
        assert_eq!(known, dir.path().join(FILE));
        assert!(read(&known).unwrap().is_empty());
        let chains = BTreeMap::from([(
            "https://a".to_string(),
            Known {
                genesis: Hash([7; 32]),
                chain_id: format!("x:{}", Hash([7; 32])),
            },
        )]);
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
