//! `kvasir-wallet`: your KVR account from the command line. Keys live in a key file
//! (mode 0600, optionally sealed under a passphrase); `balance`, `transfer` and `history`
//! talk to the ledger REST API at `--url`: a ledger node, or a gateway over HTTPS.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvasir_ledger::{Address, Amount, Keypair, TxKind};
use kvasir_wallet::client::{balance_text, Client};
use kvasir_wallet::keyfile;

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
    /// The ledger's REST API (a ledger node, or the gateway in front of one).
    #[arg(
        long,
        global = true,
        env = "KVASIR_URL",
        default_value = "http://127.0.0.1:7200"
    )]
    url: String,
    /// Also trust this PEM certificate for an https:// URL (a gateway with a self-signed
    /// certificate, like the one `kvasir-node dev` starts).
    #[arg(long, global = true, env = "KVASIR_CA")]
    ca: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new key file (mode 0600) and print its address; never overwrites.
    New {
        /// Seal the secret key under a passphrase (typed twice, or $KVASIR_PASSPHRASE);
        /// every later use of the key asks for it.
        #[arg(long)]
        encrypt: bool,
    },
    /// Print the address of the key file.
    Address,
    /// Settled balance and pending rewards (with the heights they settle at).
    Balance {
        /// Whose (default: the key file's address).
        address: Option<Address>,
    },
    /// Send KVR: `transfer kvr1... 1.5`; waits until the transfer is committed.
    Transfer { to: Address, amount: Amount },
    /// Transfers in and out and credits, newest first, 100 at a time.
    History {
        /// Whose (default: the key file's address).
        address: Option<Address>,
        /// Only entries before this location (`HEIGHT.INDEX` as the previous page ends, or
        /// `HEIGHT`).
        #[arg(long)]
        before: Option<String>,
    },
}

fn default_keyfile() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set; pass --keyfile")?;
    Ok(PathBuf::from(home).join(".kvasir").join("wallet.key"))
}

fn run(cli: Cli) -> Result<()> {
    let keyfile = match &cli.keyfile {
        Some(path) => path.clone(),
        None => default_keyfile()?,
    };
    let client = Client::with_ca(&cli.url, cli.ca.as_deref())?;
    match cli.command {
        Command::New { encrypt } => {
            if let Some(parent) = keyfile.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            let passphrase = if encrypt {
                Some(keyfile::new_passphrase()?)
            } else {
                None
            };
            let keypair = Keypair::generate();
            keypair
                .write_key_file(&keyfile, passphrase.as_deref())
                .with_context(|| format!("key file {}", keyfile.display()))?;
            print_address(keypair.address(), &keyfile, cli.json);
        }
        Command::Address => print_address(address_or_own(None, &keyfile)?, &keyfile, cli.json),
        Command::History { address, before } => {
            let address = address_or_own(address, &keyfile)?;
            let page = match &before {
                Some(before) if before.chars().all(|c| c.is_ascii_digit() || c == '.') => {
                    format!("?before={before}")
                }
                Some(before) => bail!("--before {before:?} is not HEIGHT or HEIGHT.INDEX"),
                None => String::new(),
            };
            let history = client.get(&format!("/accounts/{address}/history{page}"))?;
            if cli.json {
                println!("{history}");
            } else {
                for entry in history["entries"].as_array().into_iter().flatten() {
                    println!("{}", history_line(entry));
                }
                if let Some(next) = history["next_before"].as_str() {
                    println!("older entries: history --before {next}");
                }
            }
        }
        Command::Balance { address } => {
            let address = address_or_own(address, &keyfile)?;
            let account = client.get(&format!("/accounts/{address}"))?;
            if cli.json {
                println!("{account}");
            } else {
                println!("{}", balance_text(&account));
            }
        }
        Command::Transfer { to, amount } => {
            let key = keyfile::open(&keyfile)?;
            let head = client.get("/head")?;
            let chain_id = head["chain_id"]
                .as_str()
                .context("the node did not name its chain")?;
            let account = client.get(&format!("/accounts/{}", key.address()))?;
            let nonce = account["nonce"]
                .as_u64()
                .context("the node did not give a nonce")?;
            let tx = TxKind::Transfer { to, amount }.signed(chain_id, &key, nonce);
            let hash = client.submit(&tx)?;
            let height = client.wait_committed(&hash, std::time::Duration::from_secs(60))?;
            if cli.json {
                let value = serde_json::json!({"hash": hash, "height": height, "to": to, "amount": amount.to_decimal()});
                println!("{value}");
            } else {
                println!(
                    "sent {amount} to {to} in transaction {hash}, committed at height {height}"
                );
            }
        }
    }
    Ok(())
}

fn address_or_own(address: Option<Address>, keyfile: &std::path::Path) -> Result<Address> {
    match address {
        Some(address) => Ok(address),
        None => Keypair::key_file_address(keyfile)
            .with_context(|| format!("key file {}", keyfile.display())),
    }
}

/// `height 12  in  2.5 KVR from kvr1...`, or
/// `height 5  credit to kvr1...: session 3 of hub kvr1... at 1277952 bytes`.
fn history_line(entry: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_string();
    let head = format!("height {} ", entry["height"]);
    match entry["kind"].as_str() {
        Some("transfer") if entry["direction"] == "out" => {
            format!(
                "{head} out {} KVR to {}",
                text(&entry["amount"]["kvr"]),
                text(&entry["to"])
            )
        }
        Some("transfer") => {
            format!(
                "{head} in  {} KVR from {}",
                text(&entry["amount"]["kvr"]),
                text(&entry["from"])
            )
        }
        _ => format!(
            "{head} credit to {}: session {} of hub {} at {} bytes",
            text(&entry["worker"]),
            entry["session_id"],
            text(&entry["hub"]),
            entry["cumulative_bytes"]
        ),
    }
}

fn print_address(address: Address, keyfile: &std::path::Path, json: bool) {
    if json {
        let value = serde_json::json!({
            "address": address.to_string(),
            "keyfile": keyfile,
        });
        println!("{value}");
    } else {
        println!("{address}");
    }
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
