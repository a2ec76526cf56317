//! `kvasir-node genesis init`: a fresh chain (see `kvasir_devnet::chain`) pinning the
//! checkpoints given, reported as text or JSON.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kvasir_api::reports::GenesisReport;
use kvasir_devnet::chain::{
    genesis_path, init_sealed, key_path, load_template, new_chain_id, validator_role, ROLES,
};

use crate::engine::model_pin;

/// `genesis init`: a fresh chain named `chain_id` (else a random name on the template's) in
/// `out` pinning the checkpoints in `models`, its keys
/// sealed under a passphrase with `encrypt` (`KVASIR_PASSPHRASE`, or typed twice),
/// reported as text or one JSON object.
pub fn init_command(
    out: &Path,
    template: Option<&Path>,
    chain_id: Option<&str>,
    models: &[PathBuf],
    encrypt: bool,
    validators: usize,
    json: bool,
) -> Result<()> {
    let mut template = load_template(template)?;
    template.params.chain_id = new_chain_id(chain_id, &template.params.chain_id)?;
    let pins = models
        .iter()
        .map(|dir| {
            model_pin(dir).with_context(|| format!("pinning the checkpoint in {}", dir.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    // Asked before anything is written, so a mistyped passphrase leaves nothing behind.
    let passphrase = encrypt.then(kvasir_keyfile::new_passphrase).transpose()?;
    let genesis = init_sealed(
        out,
        &template,
        passphrase.as_deref().map(String::as_str),
        pins,
        validators,
    )?;
    let roles = ROLES
        .iter()
        .map(|role| role.to_string())
        .chain((1..validators).map(validator_role));
    let keys: Vec<PathBuf> = roles.map(|role| key_path(out, &role)).collect();
    if json {
        let report = GenesisReport {
            chain_id: genesis.chain_id(),
            genesis_hash: genesis.hash(),
            genesis: genesis_path(out),
            keys,
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "chain {} genesis {}",
            genesis.params.chain_id,
            genesis.hash()
        );
        println!("wrote {}", genesis_path(out).display());
        let sealed = if encrypt { ", sealed" } else { "" };
        for key in keys {
            println!("wrote {} (mode 0600{sealed})", key.display());
        }
    }
    Ok(())
}
