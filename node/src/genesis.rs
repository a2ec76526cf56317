//! `kvasir-node genesis init`: a fresh chain from the template in `genesis/`, with newly
//! generated authority keys.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvasir_ledger::genesis::{Allocation, Authorities};
use kvasir_ledger::{Amount, Genesis, Keypair};
use serde::Deserialize;

/// The parameters of a new chain; `genesis/template.json` is the default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub chain_id: String,
    pub unit_bytes: u64,
    pub reward_per_unit: Amount,
    pub challenge_window: u64,
    pub block_interval_ms: u64,
    pub max_block_txs: u32,
    pub max_block_bytes: u64,
    pub rewards_pool: Amount,
    /// Initial balance of the faucet account, for transfers on a dev chain.
    pub faucet: Amount,
}

pub const DEFAULT_TEMPLATE: &str = include_str!("../../genesis/template.json");

/// The roles whose keys a fresh chain generates, each written to `keys/<role>.key`.
pub const ROLES: [&str; 4] = ["validator", "gateway", "hub", "faucet"];

pub fn key_path(dir: &Path, role: &str) -> PathBuf {
    dir.join("keys").join(format!("{role}.key"))
}

pub fn genesis_path(dir: &Path) -> PathBuf {
    dir.join("genesis.json")
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
    let mut keys = Vec::new();
    for role in ROLES {
        let keypair = Keypair::generate();
        keypair.write_key_file(&key_path(out, role))?;
        keys.push(keypair.address());
    }
    let [validator, gateway, hub, faucet] = keys[..] else {
        unreachable!("one key per role")
    };
    let genesis_time_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let genesis = Genesis {
        chain_id: template.chain_id.clone(),
        genesis_time_ms,
        unit_bytes: template.unit_bytes,
        reward_per_unit: template.reward_per_unit,
        challenge_window: template.challenge_window,
        block_interval_ms: template.block_interval_ms,
        max_block_txs: template.max_block_txs,
        max_block_bytes: template.max_block_bytes,
        rewards_pool: template.rewards_pool,
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

pub fn load_template(path: Option<&Path>) -> Result<Template> {
    let text = match path {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading template {}", path.display()))?,
        None => DEFAULT_TEMPLATE.to_string(),
    };
    serde_json::from_str(&text).context("genesis template is not valid")
}
