//! `kvasir-node genesis init`: a fresh chain from the template in `genesis/`, with newly
//! generated authority keys.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_api::reports::GenesisReport;
use kvasir_ledger::genesis::{Allocation, Authorities, ChainParams};
use kvasir_ledger::{Amount, Genesis, Keypair};
use serde::Deserialize;

/// A new chain's parameters; `genesis/template.json` is the default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub params: ChainParams,
    /// Initial balance of the faucet account, for transfers on a dev chain.
    pub faucet: Amount,
}

pub const DEFAULT_TEMPLATE: &str = include_str!("../../../genesis/template.json");

/// The published dev chain (`genesis/dev`): its genesis and its publicly known keys.
pub const DEV_GENESIS: &str = include_str!("../../../genesis/dev/genesis.json");
pub const DEV_KEYS: [(&str, &str); 4] = [
    (
        "validator",
        include_str!("../../../genesis/dev/keys/validator.key"),
    ),
    (
        "gateway",
        include_str!("../../../genesis/dev/keys/gateway.key"),
    ),
    ("hub", include_str!("../../../genesis/dev/keys/hub.key")),
    (
        "faucet",
        include_str!("../../../genesis/dev/keys/faucet.key"),
    ),
];

/// The roles whose keys a fresh chain generates, each written to `keys/<role>.key`.
pub const ROLES: [&str; 4] = ["validator", "gateway", "hub", "faucet"];

pub fn key_path(dir: &Path, role: &str) -> PathBuf {
    dir.join("keys").join(format!("{role}.key"))
}

pub fn genesis_path(dir: &Path) -> PathBuf {
    dir.join("genesis.json")
}

/// Writes `keys/<role>.key` under `dir` (mode 0600, never overwriting).
fn write_role_key(dir: &Path, role: &str, keypair: &Keypair) -> Result<()> {
    Ok(kvasir_keyfile::write(&key_path(dir, role), keypair, None)?)
}

/// Writes `genesis.json` and one key file per role into `out`, refusing to overwrite.
pub fn init(out: &Path, template: &Template) -> Result<Genesis> {
    let genesis_file = genesis_path(out);
    if genesis_file.exists() {
        bail!(
            "{} already exists; choose another --out",
            genesis_file.display()
        );
    }
    std::fs::create_dir_all(out.join("keys"))
        .with_context(|| format!("creating {}", out.join("keys").display()))?;
    let keys: [Keypair; ROLES.len()] = std::array::from_fn(|_| Keypair::generate());
    for (role, keypair) in ROLES.iter().zip(&keys) {
        write_role_key(out, role, keypair)?;
    }
    let [validator, gateway, hub, faucet] = keys.map(|k| k.address());
    let genesis_time_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let genesis = Genesis {
        genesis_time_ms,
        params: template.params.clone(),
        allocations: vec![Allocation {
            address: faucet,
            amount: template.faucet,
        }],
        authorities: Authorities {
            validators: vec![validator],
            gateways: vec![gateway],
            hubs: vec![hub],
        },
    };
    genesis.validate()?;
    std::fs::write(&genesis_file, genesis.to_json())
        .with_context(|| format!("writing {}", genesis_file.display()))?;
    Ok(genesis)
}

/// `genesis init`: a fresh chain in `out`, reported as text or one JSON object.
pub fn init_command(out: &Path, template: Option<&Path>, json: bool) -> Result<()> {
    let genesis = init(out, &load_template(template)?)?;
    if json {
        let report = GenesisReport {
            chain_id: genesis.params.chain_id.clone(),
            genesis_hash: genesis.hash(),
            genesis: genesis_path(out),
            keys: ROLES.iter().map(|role| key_path(out, role)).collect(),
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "chain {} genesis {}",
            genesis.params.chain_id,
            genesis.hash()
        );
        println!("wrote {}", genesis_path(out).display());
        for role in ROLES {
            println!("wrote {} (mode 0600)", key_path(out, role).display());
        }
    }
    Ok(())
}

/// Writes the dev chain's genesis and keys into `dir` (keys with mode 0600).
pub fn install_dev_chain(dir: &Path) -> Result<Genesis> {
    let genesis = Genesis::from_json(DEV_GENESIS)?;
    std::fs::create_dir_all(dir.join("keys"))
        .with_context(|| format!("creating {}", dir.join("keys").display()))?;
    for (role, text) in DEV_KEYS {
        write_role_key(dir, role, &kvasir_keyfile::parse(text, None)?)?;
    }
    std::fs::write(genesis_path(dir), DEV_GENESIS)
        .with_context(|| format!("writing {}", genesis_path(dir).display()))?;
    Ok(genesis)
}

pub fn load_template(path: Option<&Path>) -> Result<Template> {
    let text = match path {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading template {}", path.display()))?,
        None => DEFAULT_TEMPLATE.to_string(),
    };
    serde_json::from_str(&text).context("genesis template is not valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dev_genesis_hash_is_the_same_everywhere() {
        let genesis = Genesis::from_json(DEV_GENESIS).unwrap();
        assert_eq!(
            genesis.hash().to_string(),
            "556f12c63ddb562b2f192ca3dd73622133c60feda8e8428147ad0b7a0d70c0bd"
        );
        let roles: Vec<_> = DEV_KEYS.iter().map(|(role, _)| *role).collect();
        assert_eq!(roles, ROLES);
        let address = |role| {
            let text = DEV_KEYS.iter().find(|(r, _)| *r == role).unwrap().1;
            kvasir_keyfile::parse(text, None).unwrap().address()
        };
        assert!(genesis.is_validator(&address("validator")));
        assert!(genesis.is_gateway(&address("gateway")));
        assert!(genesis.is_hub(&address("hub")));
        assert_eq!(genesis.allocations[0].address, address("faucet"));
    }

    #[test]
    fn init_writes_a_valid_chain_with_private_keys_and_refuses_to_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let template = load_template(None).unwrap();
        let genesis = init(dir.path(), &template).unwrap();
        assert_eq!(Genesis::load(&genesis_path(dir.path())).unwrap(), genesis);
        for role in ROLES {
            let path = key_path(dir.path(), role);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&path).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o600, "{role}");
            }
            kvasir_keyfile::read(&path, None).unwrap();
        }
        assert!(init(dir.path(), &template).is_err());
    }

    #[test]
    fn a_bad_template_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        std::fs::write(&path, r#"{"chain_id": "x"}"#).unwrap();
        assert!(load_template(Some(&path)).is_err());
        assert!(load_template(Some(&dir.path().join("missing.json"))).is_err());
    }
}
