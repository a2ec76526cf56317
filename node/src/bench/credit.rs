//! `kvasir-node bench credit`: many sessions' receipts through the gateway's crediting code
//! into a ledger process, committed. Figures: credits per second for a backlog of
//! `--sessions` receipts, and the seconds from a byte being metered (its receipt appearing
//! in the registry) to its credit being visible as pending (p50, p99). The latency is
//! measured twice: with the gateway's real registry poll (its `--credit-interval-ms`
//! default), which is what a worker sees, and with the fast poll the throughput run uses,
//! which leaves the ledger's share. The references printed beside them, measured in the same
//! run: the ledger's stateless check alone (both signatures of each credit, batch-verified on
//! every core), which bounds the throughput, and the chain's block interval, which bounds the
//! latency of a lone credit from below.
//!
//! The registry is played by this harness (an HTTP endpoint serving hub-signed receipts, as
//! the hub does), so that ten thousand sessions need no ten thousand worker connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use kvasir_api::registry::{ReceiptEntry, ReceiptListing, ReceiptQuery};
use kvasir_api::Client;
use kvasir_ledger::{check_stateless, Address, Keypair, Receipt, SignedReceipt, TxKind};

use kvasir_devnet::chain::{init, key_path, load_template};
use kvasir_devnet::{current_exe, roles, Mode, Process};
use kvasir_node::gateway::Crediting;
use kvasir_node::gateway::DEFAULT_CREDIT_INTERVAL_MS;

#[derive(clap::Args)]
pub struct Args {
    /// Sessions whose receipts are credited in the throughput run.
    #[arg(long, default_value_t = 10_000)]
    sessions: usize,
    /// Latency samples.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The registry as the hub serves it: per session the worker, the count and the signed receipt.
struct Registry {
    hub: Keypair,
    chain_id: String,
    /// Per session, the number of its latest change (as the hub's change log keeps it) and
    /// its entry.
    sessions: Mutex<Vec<(u64, ReceiptEntry)>>,
}

impl Registry {
    fn receipt(&self, session_id: u64, worker: Address, cumulative_bytes: u64) -> SignedReceipt {
        Receipt {
            chain_id: self.chain_id.clone(),
            hub: self.hub.address(),
            session_id,
            worker,
            order: 0,
            cumulative_bytes,
        }
        .sign(&self.hub)
    }

    fn entry(&self, session_id: u64, worker: Address, cumulative_bytes: u64) -> ReceiptEntry {
        ReceiptEntry::new(&self.receipt(session_id, worker, cumulative_bytes))
    }

    /// Sets session `index` to `entry` as its newest change.
    fn set(&self, index: usize, entry: ReceiptEntry) -> Result<()> {
        let mut sessions = self
            .sessions
            .lock()
            .map_err(|_| anyhow::anyhow!("registry lock"))?;
        let change = sessions.iter().map(|(c, _)| *c).max().unwrap_or(0) + 1;
        sessions[index] = (change, entry);
        Ok(())
    }
}

/// One page, as the hub serves it: every session, or those changed after `since`.
async fn receipts(
    State(registry): State<Arc<Registry>>,
    Query(query): Query<ReceiptQuery>,
) -> Json<ReceiptListing> {
    let mut sessions = registry
        .sessions
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    let mark = sessions.iter().map(|(c, _)| *c).max().unwrap_or(0);
    if let Some(since) = query.since {
        sessions.retain(|(change, _)| *change > since);
        sessions.sort_by_key(|(change, _)| *change);
    }
    Json(ReceiptListing {
        chain_id: registry.chain_id.clone(),
        hub: registry.hub.address(),
        receipts: sessions.into_iter().map(|(_, entry)| entry).collect(),
        // One page: the benchmark's listing is the backlog as a whole.
        next_after: None,
        next_since: None,
        mark: Some(mark),
    })
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// The registry poll of the throughput run (and of the fast latency figure).
const FAST_POLL: Duration = Duration::from_millis(20);

/// The gateway's crediting loop on its own thread, polling every `interval`; dropping it
/// stops the loop and waits for it.
struct Running {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    fn start(crediting: Crediting, interval: Duration) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || crediting.run(interval, &flag));
        Running {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Metered-to-pending latency under one polling interval, sorted.
struct Latency {
    poll: Duration,
    sorted: Vec<Duration>,
}

pub fn run(args: Args) -> Result<()> {
    if args.sessions == 0 || args.samples == 0 {
        bail!("--sessions and --samples must be positive");
    }
    let scratch = tempfile::tempdir()?;
    let chain = scratch.path().join("chain");
    let genesis = init(&chain, &load_template(None)?)?;
    let key = |role: &str| kvasir_keyfile::read(&key_path(&chain, role), None);
    let ledger_args = roles::ledger(&chain, &scratch.path().join("ledger"), "127.0.0.1:0")
        .flag("--key", key_path(&chain, "validator"));
    let mut ledger = Process::start(&current_exe()?, &ledger_args.into_vec(), Mode::Product)?;
    let ledger_addr = ledger.listening("ledger")?;

    let registry = Arc::new(Registry {
        hub: key("hub")?,
        chain_id: genesis.chain_id(),
        sessions: Mutex::new(Vec::new()),
    });
    let workers: Vec<Address> = (0..100).map(|_| Keypair::generate().address()).collect();
    let backlog: Vec<(u64, ReceiptEntry)> = (0..args.sessions)
        .map(|i| {
            let entry = registry.entry(i as u64 + 1, workers[i % workers.len()], 1_000 + i as u64);
            (i as u64 + 1, entry)
        })
        .collect();
    let runtime = tokio::runtime::Runtime::new()?;
    let registry_addr: SocketAddr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/receipts", get(receipts))
            .with_state(registry.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        anyhow::Ok(addr)
    })?;

    let ledger_client = Client::new(&format!("http://{ledger_addr}"));
    let hub = registry.hub.address();
    let credited_total = || -> Result<(usize, u64)> {
        let marks = ledger_client.all_sessions(&hub)?;
        let bytes = marks.iter().map(|m| m.cumulative_bytes).sum();
        Ok((marks.len(), bytes))
    };
    let expected: u64 = (0..args.sessions as u64).map(|i| 1_000 + i).sum();
    let crediting = || -> Result<Crediting> {
        Ok(Crediting::new(
            Client::new(&format!("http://{ledger_addr}")),
            Client::new(&format!("http://{registry_addr}")),
            key("gateway")?,
            Default::default(),
        ))
    };
    *registry
        .sessions
        .lock()
        .map_err(|_| anyhow::anyhow!("registry lock"))? = backlog;
    let start = Instant::now();
    let backlog_run = Running::start(crediting()?, FAST_POLL);
    loop {
        let (sessions, bytes) = credited_total()?;
        if sessions == args.sessions && bytes == expected {
            break;
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!(
                "only {sessions} of {} sessions credited after ten minutes",
                args.sessions
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let backlog_time = start.elapsed();
    let credits_per_s = args.sessions as f64 / backlog_time.as_secs_f64();
    drop(backlog_run);

    // Each sample raises one session's count and waits for the ledger to record it.
    let mut sample = 0u64;
    let mut measure = |poll: Duration| -> Result<Latency> {
        let _crediting = Running::start(crediting()?, poll);
        let mut sorted = Vec::with_capacity(args.samples);
        for _ in 0..args.samples {
            sample += 1;
            let session = sample % args.sessions as u64 + 1;
            let index = session as usize - 1;
            let bytes = 1_000 + index as u64 + sample * 1_000_000;
            let entry = registry.entry(session, workers[index % workers.len()], bytes);
            let metered = Instant::now();
            registry.set(index, entry)?;
            loop {
                if ledger_client.session(&hub, session, 0)?.cumulative_bytes == bytes {
                    break;
                }
                if metered.elapsed() > Duration::from_secs(60) {
                    bail!("a credit took over a minute to appear");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            sorted.push(metered.elapsed());
        }
        sorted.sort();
        Ok(Latency { poll, sorted })
    };
    let real = measure(Duration::from_millis(DEFAULT_CREDIT_INTERVAL_MS))?;
    let fast = measure(FAST_POLL)?;
    let interval = genesis.params.block_interval_ms;

    // The reference: the same number of credits through the ledger's stateless check alone.
    let gateway = key("gateway")?;
    let credits: Vec<_> = (0..args.sessions)
        .map(|i| {
            let receipt =
                registry.receipt(i as u64 + 1, workers[i % workers.len()], 1_000 + i as u64);
            let bid = super::ledger::bench_bid(&genesis);
            TxKind::Credit(receipt).signed_paying(&genesis.chain_id(), bid, &gateway, i as u64)
        })
        .collect();
    let start = Instant::now();
    let verified = check_stateless(&genesis, credits);
    let verify_per_s = args.sessions as f64 / start.elapsed().as_secs_f64();
    if !verified.iter().all(Result::is_ok) {
        bail!("the reference credits did not verify");
    }
    let poll_ms = |l: &Latency| l.poll.as_millis() as u64;
    if args.json {
        let latency = |l: &Latency| {
            serde_json::json!({
                "poll_ms": poll_ms(l),
                "p50_s": percentile(&l.sorted, 50).as_secs_f64(),
                "p99_s": percentile(&l.sorted, 99).as_secs_f64(),
            })
        };
        let value = serde_json::json!({
            "sessions": args.sessions, "backlog_s": backlog_time.as_secs_f64(),
            "credits_per_s": credits_per_s,
            "metered_to_pending_p50_s": percentile(&real.sorted, 50).as_secs_f64(),
            "metered_to_pending_p99_s": percentile(&real.sorted, 99).as_secs_f64(),
            "metered_to_pending_poll_ms": poll_ms(&real),
            "metered_to_pending_fast_poll": latency(&fast),
            "samples": args.samples, "block_interval_ms": interval,
            "stateless_check_credits_per_s": verify_per_s,
            "vs_stateless_check": credits_per_s / verify_per_s,
        });
        println!("{value}");
        return Ok(());
    }
    println!("kvasir-node bench credit: registry -> gateway crediting -> ledger (a block every {interval} ms, or sooner when full)");
    println!(
        "{:<36} {:>10.0}  {} receipts committed in {:.2} s ({} ms poll); target >= 10,000",
        "credits_per_s",
        credits_per_s,
        args.sessions,
        backlog_time.as_secs_f64(),
        FAST_POLL.as_millis()
    );
    println!(
        "{:<36} {:>10.0}  both signatures of each credit batch-verified, all cores: {:.2} of it",
        "stateless check alone (credits/s)",
        verify_per_s,
        credits_per_s / verify_per_s
    );
    for (latency, what) in [(&real, "the gateway's default poll"), (&fast, "fast poll")] {
        for p in [50, 99] {
            println!(
                "{:<36} {:>8.3} s  {what}; block interval {:.3} s ({} samples)",
                format!("metered -> pending p{p}, {} ms poll", poll_ms(latency)),
                percentile(&latency.sorted, p).as_secs_f64(),
                interval as f64 / 1e3,
                args.samples
            );
        }
    }
    Ok(())
}
