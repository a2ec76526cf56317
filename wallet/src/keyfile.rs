//! Opening key files for every Kvasir command: a sealed key file's passphrase comes from
//! `KVASIR_PASSPHRASE` when set (services, scripts), else from a prompt on the terminal.

use std::io::IsTerminal;
use std::path::Path;

use anyhow::{bail, Context, Result};
use kvasir_ledger::{KeyFileError, Keypair};

/// The environment variable that holds a sealed key file's passphrase.
pub const PASSPHRASE_ENV: &str = "KVASIR_PASSPHRASE";

/// The key in `path`, asking for its passphrase only when it is sealed.
pub fn open(path: &Path) -> Result<Keypair> {
    let context = || format!("key file {}", path.display());
    match Keypair::read_key_file(path, None) {
        Err(KeyFileError::NeedsPassphrase) => {
            let passphrase = passphrase(&format!("passphrase for {}: ", path.display()))
                .with_context(context)?;
            Keypair::read_key_file(path, Some(&passphrase)).with_context(context)
        }
        other => other.with_context(context),
    }
}

/// A passphrase for sealing a new key file: from the environment, else typed twice.
pub fn new_passphrase() -> Result<String> {
    let first = passphrase("passphrase for the new key file: ")?;
    let again = passphrase("the same passphrase again: ")?;
    if first != again {
        bail!("the two passphrases differ");
    }
    if first.is_empty() {
        bail!("an empty passphrase seals nothing; leave out --encrypt instead");
    }
    Ok(first)
}

fn passphrase(prompt: &str) -> Result<String> {
    if let Ok(passphrase) = std::env::var(PASSPHRASE_ENV) {
        return Ok(passphrase);
    }
    if !std::io::stdin().is_terminal() {
        bail!("a passphrase is needed: set {PASSPHRASE_ENV} or run in a terminal");
    }
    rpassword::prompt_password(prompt).context("reading the passphrase")
}
