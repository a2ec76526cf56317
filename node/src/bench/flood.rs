//! `kvasir-node bench flood`: the fee market under attack, with real processes. `kvasir-node
//! dev --serve` runs the swarm (ledger, hub, crediting gateway, workers); backbones generate
//! one after another for dev's market order; and `--keys` funded keys submit minimum-fee
//! transfers as fast as the ledger's API takes them. One of dev's workers lies on one answer
//! in two hundred, too rarely to be caught in dev's own short run: the backbones' audits
//! catch it during the flood, so that its evidence must land while the flood goes on. An
//! honest key sends a transfer with the suggested tip every few seconds.
//!
//! Figures, each next to its target: the share of the gateway's crediting rounds that
//! committed every credit (all of them), the blocks the evidence waited (at most 3), the
//! blocks the honest transfers waited (at most 2), and what the flood cost its keys per
//! minute, window by window (rising: the base fee climbs while blocks are full).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvasir_api::generation::GenerationReport;
use kvasir_api::reports::{DevReport, DevSwarm, FloodReport};
use kvasir_api::Client;
use kvasir_devnet::funding::top_up;
use kvasir_devnet::{current_exe, Mode, Process};
use kvasir_ledger::fees::Lane;
use kvasir_ledger::mempool::Limits;
use kvasir_ledger::{Address, Amount, Keypair, SignedTx, TxKind};
use rayon::prelude::*;

#[derive(clap::Args)]
pub struct Args {
    /// How long the flood lasts, in seconds.
    #[arg(long, default_value_t = 300)]
    seconds: u64,
    /// Funded keys flooding.
    #[arg(long, default_value_t = 2000)]
    keys: usize,
    /// What each flooding key is funded with, in KVR: enough that the flood goes on for
    /// minutes while its price climbs.
    #[arg(long, default_value = "100")]
    funds: Amount,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Seconds between the honest key's transfers.
const HONEST_EVERY: Duration = Duration::from_secs(5);
/// Transactions per submission of a flooding thread.
const BATCH: usize = 1000;
/// Threads flooding.
const FLOODERS: usize = 4;
/// Submissions a key may be refused for its window before its nonce is read again (a
/// transaction of its that a block dropped, its price having risen, left a gap).
const STALLED: u32 = 20;

pub fn run(args: Args) -> Result<()> {
    if args.seconds < 4 || args.keys == 0 {
        bail!("--seconds must be at least 4 and --keys positive");
    }
    let scratch = tempfile::tempdir()?;
    let data = scratch.path().join("dev");
    let exe = current_exe()?;
    let data_arg = data.to_string_lossy().to_string();
    let dev_args = [
        "dev",
        "--serve",
        "--data-dir",
        &data_arg,
        "--preset",
        "tiny",
        "--tokens",
        "4",
        "--workers",
        "3",
        "--dishonest",
        "1",
        "--dishonest-fraction",
        "0.005",
        "--json",
    ];
    let mut dev = Process::start(&exe, &dev_args, Mode::Product)?;
    let report: DevReport = serde_json::from_str(&format!("{{{}", dev.line("{")?))
        .context("dev's report is not a dev report")?;
    dev.line("the swarm is running")?;
    let swarm = report.swarm.context("dev's report names no swarm")?;
    if !report.caught.is_empty() {
        bail!("dev's own run caught its liar already: nothing is left to catch in the flood");
    }
    let order = report.market.order.id;
    let ledger = Client::new(&report.ledger);
    let chain = ledger.head()?.chain_id;
    let faucet = kvasir_keyfile::open(&swarm.chain.join("keys/faucet.key"))?;

    let flooders = fan_out(&ledger, &faucet, args.keys, args.funds)?;
    let honest = Keypair::generate();
    top_up(&ledger, &faucet, honest.address(), Amount::parse("10")?)?;
    let gateway = Client::with_ca(
        &format!("https://localhost:{}", port_of(&swarm.gateway)?),
        Some(&swarm.ca),
    )?;
    let rounds_before = crediting_rounds(&gateway)?;
    let base_fee_start = ledger.fees()?.base_fee.base_units;

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let window = Duration::from_secs((args.seconds / 4).clamp(1, 60));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    let addresses: Vec<Address> = flooders.iter().map(|f| f.key.address()).collect();
    let mut spent_before = held(&ledger, &addresses)?;
    let mut costs = Vec::new();
    let (honest_blocks, caught, peak) = std::thread::scope(|scope| -> Result<_> {
        let mut chunks: Vec<Vec<Flooder>> = vec![Vec::new(); FLOODERS];
        for (i, flooder) in flooders.into_iter().enumerate() {
            chunks[i % FLOODERS].push(flooder);
        }
        let payee = honest.address();
        for mut chunk in chunks {
            let (ledger, chain, stop, tally) = (&ledger, &chain, &stop, &tally);
            scope.spawn(move || flood(ledger, chain, &mut chunk, payee, stop, tally));
        }
        let traffic = scope.spawn(|| generate(&exe, &swarm, &report.ledger, order, &stop));
        let probe = scope.spawn(|| probe(&ledger, &chain, &honest, &stop));
        while Instant::now() < deadline {
            let next = (Instant::now() + window).min(deadline);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            let now = held(&ledger, &addresses)?;
            let seconds = window.as_secs().max(1);
            let spent = spent_before.saturating_sub(now) * 60 / u128::from(seconds);
            costs.push(Amount::from_base_units(
                u64::try_from(spent).unwrap_or(u64::MAX),
            ));
            spent_before = now;
        }
        stop.store(true, Ordering::Relaxed);
        let caught = traffic
            .join()
            .map_err(|_| anyhow::anyhow!("the traffic thread panicked"))??;
        let (blocks, peak) = probe
            .join()
            .map_err(|_| anyhow::anyhow!("the probe panicked"))??;
        Ok((blocks, caught, peak))
    })?;
    let rounds_after = crediting_rounds(&gateway)?;
    let report = FloodReport {
        seconds: args.seconds,
        keys: args.keys,
        flood_admitted: tally.admitted.load(Ordering::Relaxed),
        flood_refused: tally.refused.load(Ordering::Relaxed),
        credit_rounds: rounds_after.total() - rounds_before.total(),
        credit_rounds_committed: share(
            rounds_after.committed - rounds_before.committed,
            rounds_after.total() - rounds_before.total(),
        ),
        evidence_blocks: caught,
        honest_transfer_blocks: honest_blocks,
        attacker_cost_kvr_per_min: costs,
        base_fee_start,
        base_fee_peak: peak,
    };
    drop(dev);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    print(&report);
    Ok(())
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    part as f64 / whole as f64
}

fn port_of(addr: &str) -> Result<u16> {
    let addr: std::net::SocketAddr = addr.parse().context("dev's gateway address")?;
    Ok(addr.port())
}

fn print(report: &FloodReport) {
    let max = |blocks: &[u64]| blocks.iter().max().copied();
    println!(
        "flood: {} keys for {} s: {} transfers admitted, {} refused",
        report.keys, report.seconds, report.flood_admitted, report.flood_refused
    );
    println!(
        "{:<40} {:>8.3}  (target 1, over {} rounds)",
        "crediting rounds committed", report.credit_rounds_committed, report.credit_rounds
    );
    println!(
        "{:<40} {:>8}  (target <= 3)",
        "blocks evidence waited",
        max(&report.evidence_blocks).map_or("none".into(), |b| b.to_string())
    );
    println!(
        "{:<40} {:>8}  (target <= 2, {} transfers)",
        "blocks an honest tipped transfer waited",
        max(&report.honest_transfer_blocks).map_or("none".into(), |b| b.to_string()),
        report.honest_transfer_blocks.len()
    );
    let costs: Vec<String> = report
        .attacker_cost_kvr_per_min
        .iter()
        .map(|c| c.to_decimal())
        .collect();
    println!(
        "{:<40} {}  (rising)",
        "flood's cost, KVR/min by window",
        costs.join(" ")
    );
    println!(
        "{:<40} {} -> {} a byte",
        "base fee",
        report.base_fee_start.to_decimal(),
        report.base_fee_peak.to_decimal()
    );
}

/// A flooding key and its next nonce.
#[derive(Clone)]
struct Flooder {
    key: Keypair,
    nonce: u64,
    /// Submissions in a row refused for its window.
    stalled: u32,
    /// Out of money: it floods no more.
    broke: bool,
}

#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    refused: AtomicU64,
}

/// `count` fresh keys holding `funds` each, funded from `faucet` through a tree (the faucet
/// funds 16 keys a block, as a sender's mempool window allows; each of those funds 16 more
/// in the next, and so on), so that two thousand keys cost three blocks, not a hundred.
fn fan_out(ledger: &Client, faucet: &Keypair, count: usize, funds: Amount) -> Result<Vec<Flooder>> {
    let window = Limits::default().per_sender;
    // What a transfer's fee may come to while blocks are quiet, with room.
    let fee = Amount::parse("0.001")?;
    let leaves: Vec<Keypair> = (0..count).map(|_| Keypair::generate()).collect();
    // Levels from the leaves up: each key above funds up to `window` below it.
    let mut levels: Vec<Vec<(Keypair, Amount)>> =
        vec![leaves.iter().map(|k| (k.clone(), funds)).collect()];
    while levels.last().map_or(0, Vec::len) > window {
        let below = levels.last().map(Vec::as_slice).unwrap_or_default();
        let above = below
            .chunks(window)
            .map(|children| {
                let need = children.iter().try_fold(Amount::ZERO, |sum, (_, amount)| {
                    sum.checked_add(*amount)?.checked_add(fee)
                });
                need.map(|need| (Keypair::generate(), need))
            })
            .collect::<Option<Vec<_>>>()
            .context("the flood's funds overflow")?;
        levels.push(above);
    }
    let chain = ledger.head()?.chain_id;
    let mut funders: Vec<(Keypair, u64)> =
        vec![(faucet.clone(), ledger.account(&faucet.address())?.nonce)];
    for level in levels.iter().rev() {
        let quote = ledger.fees()?;
        let bid = quote.bid(Lane::Open, Amount::ZERO);
        let mut txs = Vec::with_capacity(level.len());
        for (funder, children) in funders.iter_mut().zip(level.chunks(window)) {
            for (child, amount) in children {
                let kind = TxKind::Transfer {
                    to: child.address(),
                    amount: *amount,
                };
                txs.push(kind.signed_paying(&chain, bid, &funder.0, funder.1));
                funder.1 += 1;
            }
        }
        submit_all(ledger, txs)?;
        funders = level.iter().map(|(key, _)| (key.clone(), 0)).collect();
    }
    Ok(leaves
        .into_iter()
        .map(|key| Flooder {
            key,
            nonce: 0,
            stalled: 0,
            broke: false,
        })
        .collect())
}

/// Submits `txs` in batches and waits until each sender's last is committed.
fn submit_all(ledger: &Client, txs: Vec<SignedTx>) -> Result<()> {
    let mut last = std::collections::HashMap::new();
    for batch in txs.chunks(10_000) {
        for (tx, verdict) in batch.iter().zip(ledger.submit_batch(batch)?) {
            let hash = verdict.map_err(|e| anyhow::anyhow!("funding refused: {}", e.message))?;
            last.insert(tx.tx.sender, hash);
        }
    }
    for hash in last.values() {
        ledger.wait_committed(hash, Duration::from_secs(120))?;
    }
    Ok(())
}

/// Transfers of one base unit from each of `flooders` to `payee`, bidding the lowest fee,
/// as fast as the ledger takes them, until `stop`.
fn flood(
    ledger: &Client,
    chain: &str,
    flooders: &mut [Flooder],
    payee: Address,
    stop: &AtomicBool,
    tally: &Tally,
) {
    let amount = Amount::from_base_units(1);
    while !stop.load(Ordering::Relaxed) {
        let Ok(quote) = ledger.fees() else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let bid = quote.bid(Lane::Open, Amount::ZERO);
        let ready: Vec<usize> = (0..flooders.len())
            .filter(|&i| !flooders[i].broke)
            .collect();
        if ready.is_empty() {
            return;
        }
        for batch in ready.chunks(BATCH) {
            let txs: Vec<SignedTx> = batch
                .par_iter()
                .map(|&i| {
                    let f = &flooders[i];
                    TxKind::Transfer { to: payee, amount }
                        .signed_paying(chain, bid, &f.key, f.nonce)
                })
                .collect();
            let Ok(verdicts) = ledger.submit_batch(&txs) else {
                continue;
            };
            for (&i, verdict) in batch.iter().zip(verdicts) {
                let f = &mut flooders[i];
                match verdict {
                    Ok(_) => {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                        f.nonce += 1;
                        f.stalled = 0;
                    }
                    Err(refused) => {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                        match refused.error.as_str() {
                            "sender_limit" => f.stalled += 1,
                            // Its nonce is taken by an earlier bid of its own: the next.
                            "conflict" => f.nonce += 1,
                            _ if refused.message.contains("insufficient funds") => f.broke = true,
                            _ => f.stalled = STALLED,
                        }
                    }
                }
                if f.stalled >= STALLED {
                    if let Ok(account) = ledger.account(&f.key.address()) {
                        f.nonce = account.nonce;
                    }
                    f.stalled = 0;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What `keys` hold, balances and pending, in base units.
fn held(ledger: &Client, keys: &[Address]) -> Result<u128> {
    keys.par_iter()
        .map(|key| {
            let account = ledger.account(key)?;
            Ok(u128::from(account.balance.base_units.base_units()))
        })
        .sum()
}

/// Backbones generating one after another over the swarm for `order`, auditing, until
/// `stop`; the blocks each piece of evidence they reported waited.
fn generate(
    exe: &std::path::Path,
    swarm: &DevSwarm,
    ledger: &str,
    order: u64,
    stop: &AtomicBool,
) -> Result<Vec<u64>> {
    let hub = format!("ws://{}", swarm.hub);
    let order = order.to_string();
    let model = swarm.model.to_string_lossy().to_string();
    let key = swarm.backbone_key.to_string_lossy().to_string();
    let mut waited = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let args = [
            "backbone",
            "--model",
            &model,
            "--hub",
            &hub,
            "--key",
            &key,
            "--remote",
            "*:*",
            "--ledger",
            ledger,
            "--order",
            &order,
            "--audit-rate",
            "0.2",
            "--prompt",
            "Once upon a time",
            "--tokens",
            "16",
            "--json",
        ];
        let backbone = Process::start(exe, &args, Mode::Product)?;
        let out = backbone.finish(Duration::from_secs(300))?;
        let json = out
            .lines()
            .find(|l| l.starts_with('{'))
            .context("no backbone report")?;
        let report: GenerationReport = serde_json::from_str(json)?;
        for caught in report.audit.unwrap_or_default().caught {
            if let (Some(submitted), Some(committed)) =
                (caught.submitted_height, caught.committed_height)
            {
                waited.push(committed - submitted);
            }
        }
    }
    Ok(waited)
}

/// Every `HONEST_EVERY`, a transfer from `honest` tipping what the ledger suggests: the
/// blocks each waited from the head it was submitted at; and the highest base fee quoted.
fn probe(
    ledger: &Client,
    chain: &str,
    honest: &Keypair,
    stop: &AtomicBool,
) -> Result<(Vec<u64>, Amount)> {
    let mut waited = Vec::new();
    let mut peak = Amount::ZERO;
    let payee = Keypair::generate().address();
    let mut nonce = ledger.account(&honest.address())?.nonce;
    while !stop.load(Ordering::Relaxed) {
        let quote = ledger.fees()?;
        peak = peak.max(quote.base_fee.base_units);
        let bid = quote.bid(Lane::Open, quote.suggested_tip.base_units);
        let kind = TxKind::Transfer {
            to: payee,
            amount: Amount::parse("0.01")?,
        };
        let tx = kind.signed_paying(chain, bid, honest, nonce);
        let head = ledger.head()?.height;
        let hash = ledger.submit(&tx)?;
        let height = ledger.wait_committed(&hash, Duration::from_secs(120))?;
        waited.push(height - head);
        nonce += 1;
        std::thread::sleep(HONEST_EVERY);
    }
    Ok((waited, peak))
}

/// The gateway's crediting rounds so far, by outcome.
struct Rounds {
    committed: u64,
    other: u64,
}

impl Rounds {
    fn total(&self) -> u64 {
        self.committed + self.other
    }
}

fn crediting_rounds(gateway: &Client) -> Result<Rounds> {
    let text = gateway.metrics()?;
    let value = |prefix: &str| -> u64 {
        text.lines()
            .find_map(|line| line.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    Ok(Rounds {
        committed: value("kvasir_gateway_crediting_rounds_total{outcome=\"committed\"}"),
        other: value("kvasir_gateway_crediting_rounds_total{outcome=\"partial\"}")
            + value("kvasir_gateway_failed_crediting_rounds_total"),
    })
}
