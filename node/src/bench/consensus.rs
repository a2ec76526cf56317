//! `kvasir-node bench consensus`: transfers committed through four validators agreeing by
//! BFT consensus, next to one validator alone, in the same run and the way the product runs:
//! each validator a `ledger` process on loopback at the genesis block interval, clients
//! submitting to the nodes' REST APIs (spread over the validators, forwarded to the next
//! proposers). Figures: committed transactions per second and submission-to-commit latency
//! (p50, p99, also in block intervals), and the ratio four validators / one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::fees::FeeBid;
use kvasir_ledger::genesis::Allocation;
use kvasir_ledger::mempool::Limits;
use kvasir_ledger::{Amount, Genesis, Keypair, TxKind};

use kvasir_devnet::chain::{genesis_path, init_sealed, load_template};
use kvasir_devnet::loopback::start_validators;
use kvasir_devnet::{current_exe, Process};

#[derive(clap::Args)]
pub struct Args {
    /// Seconds of load on each network.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Keys sending transfers, each keeping its window of nonces in flight.
    #[arg(long, default_value_t = 64)]
    senders: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What one network did under the load.
struct Figures {
    validators: usize,
    committed_per_s: f64,
    /// Submission to commit, sorted.
    latencies: Vec<Duration>,
    blocks: u64,
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted
        .get((sorted.len() * p / 100).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

/// A chain of `validators` validators (the template's parameters) funding `senders`.
fn chain(dir: &std::path::Path, validators: usize, senders: &[Keypair]) -> Result<Genesis> {
    let mut genesis = init_sealed(dir, &load_template(None)?, None, Vec::new(), validators)?;
    genesis
        .allocations
        .extend(senders.iter().map(|k| Allocation {
            address: k.address(),
            amount: Amount::parse("1000").unwrap_or_default(),
        }));
    genesis.validate()?;
    std::fs::write(genesis_path(dir), genesis.to_json())?;
    Ok(genesis)
}

/// Each sender in its own thread, until `stop`: its window of transfers submitted to its
/// node, then the account's nonce polled until all of them are committed; one latency per
/// transfer.
fn load(
    urls: &[String],
    chain_id: &str,
    bid: Option<FeeBid>,
    senders: Vec<Keypair>,
    stop: &AtomicBool,
) -> Result<Vec<Duration>> {
    let latencies = Mutex::new(Vec::new());
    let window = Limits::default().per_sender as u64;
    std::thread::scope(|scope| {
        let workers: Vec<_> = senders
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let (client, latencies) = (Client::new(&urls[i % urls.len()]), &latencies);
                // Another sender: an account that exists, whatever the chain's minimum for
                // creating one.
                let sink = senders[(i + 1) % senders.len()].address();
                scope.spawn(move || -> Result<()> {
                    let mut nonce = client.account(&key.address())?.nonce;
                    while !stop.load(Ordering::Relaxed) {
                        let amount = Amount::from_base_units(1);
                        let txs: Vec<_> = (nonce..nonce + window)
                            .map(|n| {
                                TxKind::Transfer { to: sink, amount }
                                    .signed_paying(chain_id, bid, key, n)
                            })
                            .collect();
                        let submitted = Instant::now();
                        for verdict in client.submit_batch(&txs)? {
                            if let Err(refused) = verdict {
                                bail!("a transfer was refused: {}", refused.message);
                            }
                        }
                        let mut committed = nonce;
                        while committed < nonce + window {
                            std::thread::sleep(Duration::from_millis(10));
                            let now = client.account(&key.address())?.nonce;
                            let mut all = latencies.lock().unwrap_or_else(|p| p.into_inner());
                            all.extend((committed..now).map(|_| submitted.elapsed()));
                            committed = now;
                            if submitted.elapsed() > Duration::from_secs(120) {
                                bail!("transfers not committed within two minutes");
                            }
                        }
                        nonce = committed;
                    }
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker
                .join()
                .map_err(|_| anyhow::anyhow!("a sender panicked"))??;
        }
        anyhow::Ok(())
    })?;
    let mut latencies = latencies.into_inner().unwrap_or_else(|p| p.into_inner());
    latencies.sort();
    Ok(latencies)
}

fn measure(validators: usize, args: &Args) -> Result<Figures> {
    let scratch = tempfile::tempdir()?;
    let dir = scratch.path().join("chain");
    let senders: Vec<Keypair> = (0..args.senders).map(|_| Keypair::generate()).collect();
    let genesis = chain(&dir, validators, &senders)?;
    let mut roles: Vec<Process> = Vec::new();
    let addrs = start_validators(&current_exe()?, &dir, &[], &mut roles)?;
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    let first = Client::new(&urls[0]);
    let ready = Instant::now();
    while first.head().map_or(0, |h| h.height) < 2 {
        if ready.elapsed() > Duration::from_secs(120) {
            bail!("{validators} validators made no block within two minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let start_height = first.head()?.height;
    let stop = Arc::new(AtomicBool::new(false));
    let timer = {
        let stop = stop.clone();
        let seconds = args.seconds;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(seconds));
            stop.store(true, Ordering::Relaxed);
        })
    };
    let started = Instant::now();
    let bid = super::ledger::bench_bid(&genesis);
    let latencies = load(&urls, &genesis.chain_id(), bid, senders, &stop)?;
    let elapsed = started.elapsed();
    let _ = timer.join();
    let blocks = first.head()?.height.saturating_sub(start_height);
    Ok(Figures {
        validators,
        committed_per_s: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
        blocks,
    })
}

pub fn run(args: Args) -> Result<()> {
    if args.senders == 0 || args.seconds == 0 {
        bail!("--senders and --seconds must be positive");
    }
    let interval = load_template(None)?.params.block_interval_ms;
    let four = measure(4, &args).context("four validators")?;
    let one = measure(1, &args).context("one validator")?;
    let four_vs_one = four.committed_per_s / one.committed_per_s.max(f64::MIN_POSITIVE);
    let intervals = |d: Duration| d.as_secs_f64() * 1e3 / interval as f64;
    let p50 = percentile(&four.latencies, 50);
    if args.json {
        let figures = |f: &Figures| {
            serde_json::json!({
                "validators": f.validators,
                "committed_per_s": f.committed_per_s,
                "latency_p50_s": percentile(&f.latencies, 50).as_secs_f64(),
                "latency_p99_s": percentile(&f.latencies, 99).as_secs_f64(),
                "committed": f.latencies.len(),
                "blocks": f.blocks,
            })
        };
        let value = serde_json::json!({
            "block_interval_ms": interval, "senders": args.senders, "seconds": args.seconds,
            "four": figures(&four), "one": figures(&one),
            "four_vs_one": four_vs_one,
            "latency_p50_intervals": intervals(p50),
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench consensus: transfers from {} keys for {} s, a block every {interval} ms",
        args.senders, args.seconds
    );
    for f in [&four, &one] {
        let (p50, p99) = (percentile(&f.latencies, 50), percentile(&f.latencies, 99));
        println!(
            "{} validator(s): {:>8.0} committed/s ({} in {} blocks); submit -> commit p50 {:.3} s ({:.2} intervals), p99 {:.3} s",
            f.validators,
            f.committed_per_s,
            f.latencies.len(),
            f.blocks,
            p50.as_secs_f64(),
            intervals(p50),
            p99.as_secs_f64()
        );
    }
    println!("four_vs_one {four_vs_one:.2} (target >= 0.5)");
    println!(
        "latency_p50_intervals {:.2} (four validators; target <= 2)",
        intervals(p50)
    );
    Ok(())
}
