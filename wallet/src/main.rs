//! `kvasir-wallet`: your KVR account from the command line. Keys live in a key file
//! (mode 0600, optionally sealed under a passphrase); `balance`, `transfer`, `bond`, `unbond`,
//! `history` and the market verbs (`offer`, `order`, `market`) talk to the ledger REST API at
//! `--url`: a ledger node, or a gateway over HTTPS. Each node URL's chain is remembered at
//! first use (`chains`), and a node that later serves another is refused.

#![forbid(unsafe_code)]

mod chains;
mod market;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvasir_api::ledger::{Direction, FeesView, HistoryEntry, HistoryEvent};
use kvasir_api::reports::{AddressReport, BondReport, FeeReport, TransferReport, UnbondReport};
use kvasir_api::Client;
use kvasir_ledger::fees::{FeeBid, Lane};
use kvasir_ledger::{Address, Amount, Hash, Keypair, TxKind};
use serde::Serialize;

/// How long a signed transaction may take to be committed before the wallet gives up on it
/// (it may still commit later: `history` shows it then).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Parser)]
#[command(
    name = "kvasir-wallet",
    version,
    about = "Your KVR account: keys, address, earnings, bond."
)]
struct Cli {
    /// Key file (default: $KVASIR_KEYFILE, else ~/.kvasir/wallet.key).
    #[arg(long, global = true, env = "KVASIR_KEYFILE")]
    keyfile: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// The ledger's REST API (a ledger node, or the gateway in front of one). Without a
    /// scheme, https:// unless the host is this machine.
    #[arg(
        long,
        global = true,
        env = "KVASIR_URL",
        default_value = "http://127.0.0.1:7200"
    )]
    url: String,
    /// The genesis hash of the chain the node at --url must serve. Without it, the one the
    /// node reported at first use (kept in known-chains.json beside the key file).
    #[arg(long, global = true, env = "KVASIR_GENESIS")]
    genesis: Option<Hash>,
    /// Trust this PEM certificate for an https:// URL, in place of the web's roots (a gateway
    /// with a self-signed certificate, like the one `kvasir-node dev` starts).
    #[arg(long, global = true, env = "KVASIR_CA")]
    ca: Option<PathBuf>,
    /// The tip a transaction pays its block's proposer, in KVR (`0.0001`), on top of its
    /// price: a higher one gets it in sooner when blocks are full. Default: what the node
    /// suggests (`GET /fees`), zero unless blocks are full.
    #[arg(long, global = true)]
    tip: Option<Amount>,
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
    /// Settled balance, pending rewards, the bond, what is unbonding, and a jail while it lasts.
    ///
    /// Pending rewards with the heights they settle at, unbonding amounts with the heights they
    /// are released at.
    Balance {
        /// Whose (default: the key file's address).
        address: Option<Address>,
    },
    /// Send KVR: `transfer kvr1... 1.5`; waits until the transfer is committed.
    Transfer { to: Address, amount: Amount },
    /// Move KVR from your balance into your bond: `bond 10`; waits until it is committed.
    ///
    /// A worker's key must hold at least the chain's `min_bond` (`GET /params`) for its
    /// credits to be paid; accepted evidence of a wrong answer slashes it.
    Bond {
        /// KVR, exact decimal (`10`, `2.5`).
        amount: Amount,
    },
    /// Start returning bonded KVR to your balance: `unbond 10`; waits until it is committed.
    ///
    /// It stays slashable for the chain's `unbonding_blocks`, then is spendable again from the
    /// release height printed.
    Unbond {
        /// KVR, exact decimal (`10`, `2.5`).
        amount: Amount,
    },
    /// Offer expert capacity as an operator: `offer create|withdraw|list`.
    #[command(subcommand)]
    Offer(market::OfferCommand),
    /// Order expert capacity as a buyer, paid from escrow: `order create|deposit|close|show`.
    #[command(subcommand)]
    Order(market::OrderCommand),
    /// How a model is served: `market coverage MODEL`.
    #[command(subcommand)]
    Market(MarketCommand),
    /// Transfers in and out, credits, bonds, unbonds and evidence, newest first, 100 at a time.
    History {
        /// Whose (default: the key file's address).
        address: Option<Address>,
        /// Only entries before this location (`HEIGHT.INDEX` as the previous page ends, or
        /// `HEIGHT`).
        #[arg(long)]
        before: Option<String>,
    },
}

#[derive(Subcommand)]
enum MarketCommand {
    /// Per layer and expert of a model: placements, replicas wanted, price range.
    Coverage {
        model: String,
        /// Only this layer.
        #[arg(long)]
        layer: Option<u16>,
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
    let url = chains::node_url(&cli.url);
    let client = Client::with_ca(&url, cli.ca.as_deref())?;
    // Every command but these two talks to the node, which must serve the expected chain.
    let checked = match cli.command {
        Command::New { .. } | Command::Address => None,
        _ => Some(chains::check(
            &client,
            &url,
            &chains::known_chains_path(&keyfile),
            cli.genesis,
        )?),
    };
    let chain_id = checked.as_ref().map_or("", |c| &c.chain_id);
    let signer = Signer {
        client: &client,
        keyfile: &keyfile,
        chain_id,
        tip: cli.tip,
        quiet: cli.json,
    };
    match cli.command {
        Command::New { encrypt } => {
            if let Some(parent) = keyfile.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            let passphrase = if encrypt {
                Some(kvasir_keyfile::new_passphrase()?)
            } else {
                None
            };
            let keypair = Keypair::generate();
            kvasir_keyfile::write(
                &keyfile,
                &keypair,
                passphrase.as_deref().map(String::as_str),
            )?;
            print_address(keypair.address(), &keyfile, cli.json)?;
        }
        Command::Address => print_address(address_or_own(None, &keyfile)?, &keyfile, cli.json)?,
        Command::History { address, before } => {
            let address = address_or_own(address, &keyfile)?;
            if let Some(before) = &before {
                if !before.chars().all(|c| c.is_ascii_digit() || c == '.') {
                    bail!("--before {before:?} is not HEIGHT or HEIGHT.INDEX");
                }
            }
            let history = client.history(&address, before.as_deref())?;
            if cli.json {
                println!("{}", serde_json::to_string(&history)?);
            } else {
                for entry in &history.entries {
                    println!("{}", history_line(entry));
                }
                if let Some(next) = &history.next_before {
                    println!("older entries: history --before {next}");
                }
            }
        }
        Command::Offer(command) => market::offer(command, &signer, cli.json)?,
        Command::Order(command) => market::order(command, &signer, cli.json)?,
        Command::Market(MarketCommand::Coverage { model, layer }) => {
            market::coverage(&model, layer, &client, cli.json)?
        }
        Command::Balance { address } => {
            let address = address_or_own(address, &keyfile)?;
            let account = client.account(&address)?;
            print_report(cli.json, &account, || account.summary())?;
        }
        Command::Transfer { to, amount } => {
            let Committed { hash, height, fee } = signer.commit(TxKind::Transfer { to, amount })?;
            let report = TransferReport {
                hash,
                height,
                to,
                amount,
                fee,
            };
            print_report(cli.json, &report, || {
                format!("sent {amount} to {to} in transaction {hash}, committed at height {height}")
            })?;
        }
        Command::Bond { amount } => {
            let Committed { hash, height, fee } = signer.commit(TxKind::Bond { amount })?;
            let report = BondReport {
                hash,
                height,
                amount,
                fee,
            };
            print_report(cli.json, &report, || {
                format!("bonded {amount} in transaction {hash}, committed at height {height}")
            })?;
        }
        Command::Unbond { amount } => {
            // Read before signing, so that a failure here leaves nothing submitted.
            let unbonding_blocks = client.params()?.unbonding_blocks;
            let Committed { hash, height, fee } = signer.commit(TxKind::Unbond { amount })?;
            // The ledger releases an unbonding started in block H at H + unbonding_blocks.
            let release_height = height
                .checked_add(unbonding_blocks)
                .context("the release height overflows")?;
            let report = UnbondReport {
                hash,
                height,
                amount,
                release_height,
                fee,
            };
            print_report(cli.json, &report, || {
                format!(
                    "unbonding {amount} in transaction {hash}, committed at height {height}; \
                     spendable again at height {release_height}"
                )
            })?;
        }
    }
    if let Some(line) = checked.and_then(|c| c.remembered) {
        eprintln!("{line}");
    }
    Ok(())
}

/// A transaction as the chain took it: its hash, the height of its block and its fee.
struct Committed {
    hash: Hash,
    height: u64,
    fee: Option<FeeReport>,
}

/// The key file, and the node of the chain it signs for (checked by `chains::check`).
struct Signer<'a> {
    client: &'a Client,
    keyfile: &'a Path,
    chain_id: &'a str,
    /// `--tip`: the whole tip of each transaction; `None`, the node's suggestion.
    tip: Option<Amount>,
    /// Whether the fee line goes unprinted (`--json` carries it instead).
    quiet: bool,
}

impl Signer<'_> {
    /// Signs `kind` with the key file for the checked chain (the next nonce from the
    /// account), bidding the fee the node quotes now (`GET /fees`), with room for the base
    /// fee to double; prints what it pays before it is submitted; submits it and waits until
    /// it is committed: what every command that moves money does. A refusal is the ledger's
    /// own reason, in one line.
    fn commit(&self, kind: TxKind) -> Result<Committed> {
        let key = kvasir_keyfile::open(self.keyfile)?;
        let nonce = self.client.account(&key.address())?.nonce;
        let quote = self.client.fees()?;
        let lane = Lane::of(&kind);
        // A bid's numbers are fixed-width: a draft has the signed transaction's size.
        let draft =
            kind.clone()
                .signed_paying(self.chain_id, quote.bid(lane, Amount::ZERO), &key, nonce);
        let bytes = draft.to_bytes().len() as u64;
        let tip_per_byte = match self.tip {
            Some(total) => Amount::from_base_units(total.base_units().div_ceil(bytes)),
            None => suggested_tip(&quote, bytes)?,
        };
        let bid = quote.bid(lane, tip_per_byte);
        let fee = bid
            .map(|bid| fee_report(&quote, lane, &bid, bytes))
            .transpose()?;
        if let (Some(fee), false) = (&fee, self.quiet) {
            eprintln!(
                "fee: {} now ({} burned, {} tip), at most {} if the base fee rises first",
                fee.burned.checked_add(fee.tip).unwrap_or(Amount::MAX),
                fee.burned,
                fee.tip,
                fee.at_most
            );
        }
        let hash = self
            .client
            .submit(&kind.signed_paying(self.chain_id, bid, &key, nonce))?;
        let height = self.client.wait_committed(&hash, COMMIT_TIMEOUT)?;
        Ok(Committed { hash, height, fee })
    }
}

/// The most tip, for a whole transaction, the wallet pays on a node's suggestion: a node
/// (which may be a validator, paid the tips) could otherwise name any tip, and any base fee
/// to measure it against. Past it the user says what to tip (`--tip`).
const MAX_SUGGESTED_TIP: Amount = Amount::from_base_units(10_000_000);

/// The tip per byte the node suggests for a transaction of `bytes` bytes, unless it comes to
/// more than `MAX_SUGGESTED_TIP`.
fn suggested_tip(quote: &FeesView, bytes: u64) -> Result<Amount> {
    let tip = quote.suggested_tip.base_units;
    if tip.base_units().saturating_mul(bytes) > MAX_SUGGESTED_TIP.base_units() {
        bail!(
            "the node suggests a tip of {tip} a byte, over {MAX_SUGGESTED_TIP} for this transaction: say what to tip with --tip KVR"
        );
    }
    Ok(tip)
}

/// What a transaction of `bytes` bytes in `lane` bidding `bid` pays at `quote`'s base fee.
fn fee_report(quote: &FeesView, lane: Lane, bid: &FeeBid, bytes: u64) -> Result<FeeReport> {
    let charge = quote.charge(lane, bid, bytes as usize)?;
    let at_most = bid
        .max_per_byte
        .base_units()
        .checked_mul(bytes)
        .context("the fee overflows")?;
    Ok(FeeReport {
        bytes,
        burned: charge.burned,
        tip: charge.tip,
        at_most: Amount::from_base_units(at_most),
    })
}

/// `report` as one JSON object with `--json`, else the line `text` makes.
fn print_report<R: Serialize>(json: bool, report: &R, text: impl FnOnce() -> String) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{}", text());
    }
    Ok(())
}

fn address_or_own(address: Option<Address>, keyfile: &Path) -> Result<Address> {
    match address {
        Some(address) => Ok(address),
        None => Ok(kvasir_keyfile::address(keyfile)?),
    }
}

/// `height 12  in  2.5 KVR from kvr1...`, or
/// `height 5  credit to kvr1...: session 3 of hub kvr1... at 1277952 bytes`.
fn history_line(entry: &HistoryEntry) -> String {
    let head = format!("height {} ", entry.height);
    match &entry.event {
        HistoryEvent::Transfer {
            direction: Direction::Out,
            to,
            amount,
            ..
        } => format!("{head} out {} to {to}", amount.kvr),
        HistoryEvent::Transfer { from, amount, .. } => {
            format!("{head} in  {} from {from}", amount.kvr)
        }
        HistoryEvent::Credit {
            worker,
            hub,
            session_id,
            cumulative_bytes,
            ..
        } => format!(
            "{head} credit to {worker}: session {session_id} of hub {hub} at {cumulative_bytes} bytes"
        ),
        HistoryEvent::Bond { amount } => format!("{head} bond {}", amount.kvr),
        HistoryEvent::Unbond { amount } => format!("{head} unbond {}", amount.kvr),
        HistoryEvent::Evidence {
            reporter,
            worker,
            hub,
            session_id,
            request_id,
        } => format!(
            "{head} evidence by {reporter} against {worker}: request {request_id} of session {session_id} of hub {hub}"
        ),
        HistoryEvent::OfferCreate {
            model,
            experts,
            price,
            expiry_height,
        } => format!(
            "{head} offer {model} {experts} at {} per unit until height {expiry_height}",
            price.kvr
        ),
        HistoryEvent::OfferWithdraw { offer } => format!("{head} withdraw offer {offer}"),
        HistoryEvent::OrderCreate {
            model,
            experts,
            replicas,
            max_price,
            deposit,
            end_height,
        } => format!(
            "{head} order {model} {experts} x{replicas} at most {} per unit, escrow {}, until height {end_height}",
            max_price.kvr, deposit.kvr
        ),
        HistoryEvent::OrderDeposit { order, amount } => {
            format!("{head} deposit {} into order {order}", amount.kvr)
        }
        HistoryEvent::OrderClose { order } => format!("{head} close order {order}"),
    }
}

fn print_address(address: Address, keyfile: &Path, json: bool) -> Result<()> {
    let report = AddressReport {
        address,
        keyfile: keyfile.to_path_buf(),
    };
    print_report(json, &report, || address.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::fraction::Fraction;

    fn quote(base: u64, tip: u64) -> FeesView {
        let units = |n| Amount::from_base_units(n).into();
        FeesView {
            height: 1,
            charged: true,
            base_fee: units(base),
            min_base_fee: units(base),
            lane_fee: units(10),
            lane_share: Fraction::ZERO,
            suggested_tip: units(tip),
            evidence_deposit: units(0),
        }
    }

    /// A node's suggested tip is taken up to 0.01 KVR a transaction, whatever base fee it
    /// quotes; past that the user must say.
    #[test]
    fn a_suggested_tip_is_taken_only_up_to_a_hundredth_of_a_kvr() {
        assert_eq!(
            suggested_tip(&quote(1000, 50_000), 200).unwrap(),
            Amount::from_base_units(50_000)
        );
        let refused = suggested_tip(&quote(1_000_000_000, 50_001), 200)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("--tip"), "{refused}");
    }
}
