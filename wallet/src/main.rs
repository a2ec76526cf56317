//! `kvasir-wallet`: your KVR account from the command line. Keys live in a key file
//! (mode 0600). The verbs that talk to a ledger node (`balance`, `transfer`, `history`)
//! arrive with the ledger service's REST API.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kvasir_ledger::Keypair;

#[derive(Parser)]
#[command(
    name = "kvasir-wallet",
    version,
    about = "Your KVR account: keys, address, earnings."
)]
struct Cli {
    /// Key file (default: $KVASIR_KEYFILE, else ~/.kvasir/wallet.key).
    #[arg(long, global = true, env = "KVASIR_KEYFILE")]
    keyfile: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new key file (mode 0600) and print its address; never overwrites.
    New,
    /// Print the address of the key file.
    Address,
}

fn default_keyfile() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set; pass --keyfile")?;
    Ok(PathBuf::from(home).join(".kvasir").join("wallet.key"))
}

fn run(cli: Cli) -> Result<()> {
    let keyfile = match cli.keyfile {
        Some(path) => path,
        None => default_keyfile()?,
    };
    let keypair = match cli.command {
        Command::New => {
            if let Some(parent) = keyfile.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            let keypair = Keypair::generate();
            keypair.write_key_file(&keyfile)?;
            keypair
        }
        Command::Address => Keypair::read_key_file(&keyfile)?,
    };
    if cli.json {
        let value = serde_json::json!({
            "address": keypair.address().to_string(),
            "keyfile": keyfile,
        });
        println!("{value}");
    } else {
        println!("{}", keypair.address());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
