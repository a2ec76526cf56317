//! A chain's files: `genesis.json` and one key file per role under `keys/`, written fresh
//! from the template in `genesis/` (with newly generated authority keys, sealed under a
//! passphrase when one is given), or the published dev chain's. Also the rule that keeps the
//! dev chain, whose keys are public, off public addresses.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::fees::DEFAULT_FEES;
use kvasir_ledger::genesis::{Allocation, Authorities, ChainParams, ModelPin};
use kvasir_ledger::{Address, Amount, Genesis, Hash, Keypair};
use serde::Deserialize;

/// A new chain's parameters; `genesis/template.json` is the default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub params: ChainParams,
    /// Initial balance of the faucet account, for transfers on a dev chain.
    pub faucet: Amount,
}

pub const DEFAULT_TEMPLATE: &str = include_str!("../../genesis/template.json");

/// The published dev chain (`genesis/dev`): its genesis and its publicly known keys.
pub const DEV_GENESIS: &str = include_str!("../../genesis/dev/genesis.json");
pub const DEV_KEYS: [(&str, &str); 4] = [
    (
        "validator",
        include_str!("../../genesis/dev/keys/validator.key"),
    ),
    (
        "gateway",
        include_str!("../../genesis/dev/keys/gateway.key"),
    ),
    ("hub", include_str!("../../genesis/dev/keys/hub.key")),
    ("faucet", include_str!("../../genesis/dev/keys/faucet.key")),
];

/// The published dev chain's name, which no new chain may take.
pub const DEV_CHAIN_ID: &str = "kvasir-dev";

/// The name of a new chain: `requested`, or else `PREFIX-` and eight random hex digits, so
/// that two chains made with the defaults never share a name. The published dev chain's name
/// is refused: its keys are public.
pub fn new_chain_id(requested: Option<&str>, prefix: &str) -> Result<String> {
    let name = match requested {
        Some(name) => name.to_string(),
        None => format!("{prefix}-{:08x}", rand::random::<u32>()),
    };
    if name == DEV_CHAIN_ID {
        bail!("{DEV_CHAIN_ID} is the published dev chain's name, whose keys anyone has; choose another --chain-id");
    }
    // Checked before any key is written, so a bad name leaves nothing behind.
    kvasir_ledger::genesis::check_chain_name(&name)
        .with_context(|| format!("--chain-id {name:?}"))?;
    Ok(name)
}

/// The published dev chain's genesis hash.
pub fn dev_genesis_hash() -> Result<Hash> {
    Ok(Genesis::from_json(DEV_GENESIS)?.hash())
}

/// The address of the dev chain's published `role` key (one of `ROLES`).
pub fn dev_address(role: &str) -> Result<Address> {
    let (_, text) = DEV_KEYS
        .iter()
        .find(|(r, _)| *r == role)
        .with_context(|| format!("the dev chain has no {role} key"))?;
    Ok(kvasir_keyfile::parse(text, None)?.address())
}

/// A role about to serve the published dev chain where other machines can reach it.
#[derive(Debug, thiserror::Error)]
#[error("{role} would serve the published dev chain on {listen}, and anyone can sign with its published keys; start a chain of your own (`genesis init`), listen on loopback, or pass --allow-dev-chain")]
pub struct DevChainExposed {
    pub role: &'static str,
    pub listen: SocketAddr,
}

/// Refuses to serve the dev chain on an address that is not loopback, unless `allowed`:
/// its keys are public, so on such an address anyone could sign as its validator, gateway,
/// hub or faucet. `is_dev_chain` is asked only when some address is exposed and the dev
/// chain is not allowed (it may have to ask the network).
pub fn refuse_exposed_dev_chain(
    role: &'static str,
    listen: &[SocketAddr],
    allowed: bool,
    is_dev_chain: impl FnOnce() -> Result<bool>,
) -> Result<()> {
    let Some(exposed) = listen.iter().find(|a| !a.ip().is_loopback()) else {
        return Ok(());
    };
    if allowed || !is_dev_chain()? {
        return Ok(());
    }
    Err(DevChainExposed {
        role,
        listen: *exposed,
    }
    .into())
}

/// The roles whose keys a fresh chain generates, each written to `keys/<role>.key`; a chain
/// of several validators has more validator keys (`validator_role`).
pub const ROLES: [&str; 4] = ["validator", "gateway", "hub", "faucet"];

/// The most validators `genesis init` writes keys for.
pub const MAX_VALIDATORS: usize = 100;

/// The role name of the chain's validator number `index` (from 0): `validator`, then
/// `validator-1`, `validator-2`, ...
pub fn validator_role(index: usize) -> String {
    match index {
        0 => "validator".into(),
        i => format!("validator-{i}"),
    }
}

pub fn key_path(dir: &Path, role: &str) -> PathBuf {
    dir.join("keys").join(format!("{role}.key"))
}

pub fn genesis_path(dir: &Path) -> PathBuf {
    dir.join("genesis.json")
}

/// Writes `keys/<role>.key` under `dir` (mode 0600, never overwriting), sealed when a
/// passphrase is given.
fn write_role_key(
    dir: &Path,
    role: &str,
    keypair: &Keypair,
    passphrase: Option<&str>,
) -> Result<()> {
    Ok(kvasir_keyfile::write(
        &key_path(dir, role),
        keypair,
        passphrase,
    )?)
}

/// Writes `genesis.json` and one key file per role into `out`, refusing to overwrite.
pub fn init(out: &Path, template: &Template) -> Result<Genesis> {
    init_sealed(out, template, None, Vec::new(), 1)
}

/// `init`, with every key file sealed under `passphrase` when one is given, pinning `models`
/// (the checkpoints evidence will be recomputed with), with `validators` validator keys. The
/// chain takes the template's name (see `new_chain_id`), never the dev chain's, and the
/// newest format.
pub fn init_sealed(
    out: &Path,
    template: &Template,
    passphrase: Option<&str>,
    models: Vec<ModelPin>,
    validators: usize,
) -> Result<Genesis> {
    if !(1..=MAX_VALIDATORS).contains(&validators) {
        bail!("a chain has 1 to {MAX_VALIDATORS} validators, not {validators}");
    }
    let name = new_chain_id(Some(&template.params.chain_id), "")?;
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
        write_role_key(out, role, keypair, passphrase)?;
    }
    let [validator, gateway, hub, faucet] = keys.map(|k| k.address());
    let mut validator_set = vec![validator];
    for index in 1..validators {
        let keypair = Keypair::generate();
        write_role_key(out, &validator_role(index), &keypair, passphrase)?;
        validator_set.push(keypair.address());
    }
    let genesis_time_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let genesis = Genesis {
        genesis_time_ms,
        params: ChainParams {
            chain_id: name,
            format: kvasir_ledger::genesis::FORMAT,
            fees: template.params.fees.or(Some(DEFAULT_FEES)),
            ..template.params.clone()
        },
        allocations: vec![Allocation {
            address: faucet,
            amount: template.faucet,
        }],
        authorities: Authorities {
            validators: validator_set,
            gateways: vec![gateway],
            hubs: vec![hub],
        },
        models,
    };
    genesis.validate()?;
    std::fs::write(&genesis_file, genesis.to_json())
        .with_context(|| format!("writing {}", genesis_file.display()))?;
    Ok(genesis)
}

/// Writes the dev chain's genesis and keys into `dir` (keys with mode 0600).
pub fn install_dev_chain(dir: &Path) -> Result<Genesis> {
    let genesis = Genesis::from_json(DEV_GENESIS)?;
    std::fs::create_dir_all(dir.join("keys"))
        .with_context(|| format!("creating {}", dir.join("keys").display()))?;
    for (role, text) in DEV_KEYS {
        write_role_key(dir, role, &kvasir_keyfile::parse(text, None)?, None)?;
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
            "2a6cfaa770e09de424018d21a48e3c5f3838b452a875aae97a0190f7785dd160"
        );
        let roles: Vec<_> = DEV_KEYS.iter().map(|(role, _)| *role).collect();
        assert_eq!(roles, ROLES);
        let address = |role| dev_address(role).unwrap();
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
    fn init_writes_one_key_per_validator_and_names_them_all_in_genesis() {
        let dir = tempfile::tempdir().unwrap();
        let template = load_template(None).unwrap();
        let genesis = init_sealed(dir.path(), &template, None, Vec::new(), 4).unwrap();
        assert_eq!(genesis.authorities.validators.len(), 4);
        for index in 0..4 {
            let path = key_path(dir.path(), &validator_role(index));
            let key = kvasir_keyfile::read(&path, None).unwrap();
            assert!(genesis.is_validator(&key.address()), "{}", path.display());
        }
        let other = dir.path().join("none");
        assert!(init_sealed(&other, &template, None, Vec::new(), 0).is_err());
        assert!(!other.exists());
    }

    #[test]
    fn the_dev_chain_is_refused_on_an_exposed_address_unless_allowed() {
        let loopback: SocketAddr = "127.0.0.1:7101".parse().unwrap();
        let v6_loopback: SocketAddr = "[::1]:443".parse().unwrap();
        let lan: SocketAddr = "10.0.0.2:7101".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:443".parse().unwrap();
        let asked = std::cell::Cell::new(0);
        let dev = |answer: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                Ok(answer)
            }
        };
        // Loopback only, or allowed: the chain is not even looked at.
        assert!(
            refuse_exposed_dev_chain("hub", &[loopback, v6_loopback], false, dev(true)).is_ok()
        );
        assert!(refuse_exposed_dev_chain("hub", &[loopback, lan], true, dev(true)).is_ok());
        assert_eq!(asked.get(), 0);
        // Exposed: refused for the dev chain, naming the exposed address and the way out.
        for listen in [&[loopback, lan][..], &[any]] {
            let error = refuse_exposed_dev_chain("gateway", listen, false, dev(true)).unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains(&listen[listen.len() - 1].to_string()),
                "{message}"
            );
            assert!(message.contains("--allow-dev-chain"), "{message}");
            assert!(error.downcast_ref::<DevChainExposed>().is_some());
        }
        assert!(refuse_exposed_dev_chain("gateway", &[any], false, dev(false)).is_ok());
        assert_eq!(asked.get(), 3);
        // The dev chain is recognised by its genesis and its keys.
        let genesis = Genesis::from_json(DEV_GENESIS).unwrap();
        assert_eq!(genesis.hash(), dev_genesis_hash().unwrap());
        assert!(genesis.is_gateway(&dev_address("gateway").unwrap()));
        assert!(dev_address("nobody").is_err());
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
