//! `kvasir-node bench credit`: many sessions' receipts through the gateway's crediting code
//! into a ledger process, committed. Figures: credits per second for a backlog of
//! `--sessions` receipts, and the seconds from a byte being metered (its receipt appearing
//! in the registry) to its credit being visible as pending (p50, p99). The references printed
//! beside them, measured in the same run: the ledger's stateless check alone (both
//! signatures of each credit, batch-verified on every core), which bounds the throughput,
//! and the chain's block interval, which bounds the latency of a lone credit from below.
//!
//! The registry is played by this harness (an HTTP endpoint serving hub-signed receipts, as
//! the hub does), so that ten thousand sessions need no ten thousand worker connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use kvasir_ledger::{check_stateless, Address, Keypair, Receipt, SignedReceipt, TxKind};
use kvasir_wallet::client::Client;

use crate::crediting::Crediting;
use crate::genesis::{genesis_path, init, key_path, load_template};
use crate::launch::Child;

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
    sessions: Mutex<Vec<serde_json::Value>>,
}

impl Registry {
    fn receipt(&self, session_id: u64, worker: Address, cumulative_bytes: u64) -> SignedReceipt {
        Receipt {
            chain_id: self.chain_id.clone(),
            hub: self.hub.address(),
            session_id,
            worker,
            cumulative_bytes,
        }
        .sign(&self.hub)
    }

    fn entry(&self, session_id: u64, worker: Address, cumulative_bytes: u64) -> serde_json::Value {
        let signed = self.receipt(session_id, worker, cumulative_bytes);
        serde_json::json!({
            "session_id": session_id, "worker": worker, "cumulative_bytes": cumulative_bytes,
            "signed": hex::encode(borsh::to_vec(&signed).unwrap_or_default()),
        })
    }
}

async fn receipts(State(registry): State<Arc<Registry>>) -> Json<serde_json::Value> {
    let sessions = registry
        .sessions
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    Json(serde_json::json!({
        "chain_id": registry.chain_id, "hub": registry.hub.address(), "receipts": sessions,
    }))
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

pub fn run(args: Args) -> Result<()> {
    if args.sessions == 0 || args.samples == 0 {
        bail!("--sessions and --samples must be positive");
    }
    let scratch = tempfile::tempdir()?;
    let chain = scratch.path().join("chain");
    let genesis = init(&chain, &load_template(None)?)?;
    let key = |role: &str| Keypair::read_key_file(&key_path(&chain, role), None);
    let text = |p: std::path::PathBuf| p.display().to_string();
    let mut ledger = Child::spawn(
        &[
            "ledger",
            "--genesis",
            &text(genesis_path(&chain)),
            "--data-dir",
            &text(scratch.path().join("ledger")),
            "--listen",
            "127.0.0.1:0",
            "--key",
            &text(key_path(&chain, "validator")),
        ]
        .map(String::from),
    )?;
    let ledger_addr = ledger.listening("ledger")?;

    let registry = Arc::new(Registry {
        hub: key("hub")?,
        chain_id: genesis.params.chain_id.clone(),
        sessions: Mutex::new(Vec::new()),
    });
    let workers: Vec<Address> = (0..100).map(|_| Keypair::generate().address()).collect();
    let backlog: Vec<serde_json::Value> = (0..args.sessions)
        .map(|i| registry.entry(i as u64 + 1, workers[i % workers.len()], 1_000 + i as u64))
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
        let marks = ledger_client.get(&format!("/sessions/{hub}"))?;
        let list = marks["sessions"].as_array().cloned().unwrap_or_default();
        let bytes = list
            .iter()
            .filter_map(|m| m["cumulative_bytes"].as_u64())
            .sum();
        Ok((list.len(), bytes))
    };
    let expected: u64 = (0..args.sessions as u64).map(|i| 1_000 + i).sum();
    let crediting = Crediting {
        ledger: Client::new(&format!("http://{ledger_addr}")),
        registry: Client::new(&format!("http://{registry_addr}")),
        key: key("gateway")?,
    };
    *registry
        .sessions
        .lock()
        .map_err(|_| anyhow::anyhow!("registry lock"))? = backlog;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let crediting = {
        let stop = stop.clone();
        std::thread::spawn(move || crediting.run(Duration::from_millis(20), &stop))
    };
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

    let mut latencies = Vec::with_capacity(args.samples);
    for sample in 0..args.samples {
        let session = sample as u64 % args.sessions as u64 + 1;
        let index = session as usize - 1;
        let bytes = 1_000 + index as u64 + (sample as u64 + 1) * 1_000_000;
        let entry = registry.entry(session, workers[index % workers.len()], bytes);
        let metered = Instant::now();
        registry
            .sessions
            .lock()
            .map_err(|_| anyhow::anyhow!("registry lock"))?[index] = entry;
        loop {
            let mark = ledger_client.get(&format!("/sessions/{hub}/{session}"))?;
            if mark["cumulative_bytes"].as_u64() == Some(bytes) {
                break;
            }
            if metered.elapsed() > Duration::from_secs(60) {
                bail!("a credit took over a minute to appear");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        latencies.push(metered.elapsed());
    }
    latencies.sort();
    let (p50, p99) = (percentile(&latencies, 50), percentile(&latencies, 99));
    let interval = genesis.params.block_interval_ms;

    stop.store(true, Ordering::Relaxed);
    let _ = crediting.join();

    // The reference: the same number of credits through the ledger's stateless check alone.
    let gateway = key("gateway")?;
    let credits: Vec<_> = (0..args.sessions)
        .map(|i| {
            let receipt =
                registry.receipt(i as u64 + 1, workers[i % workers.len()], 1_000 + i as u64);
            TxKind::Credit(receipt).signed(&genesis.params.chain_id, &gateway, i as u64)
        })
        .collect();
    let start = Instant::now();
    let verified = check_stateless(&genesis, credits);
    let verify_per_s = args.sessions as f64 / start.elapsed().as_secs_f64();
    if !verified.iter().all(Result::is_ok) {
        bail!("the reference credits did not verify");
    }
    if args.json {
        let value = serde_json::json!({
            "sessions": args.sessions, "backlog_s": backlog_time.as_secs_f64(),
            "credits_per_s": credits_per_s, "metered_to_pending_p50_s": p50.as_secs_f64(),
            "metered_to_pending_p99_s": p99.as_secs_f64(), "block_interval_ms": interval,
            "stateless_check_credits_per_s": verify_per_s,
            "vs_stateless_check": credits_per_s / verify_per_s,
        });
        println!("{value}");
        return Ok(());
    }
    println!("kvasir-node bench credit: registry -> gateway crediting -> ledger (a block every {interval} ms, or sooner when full)");
    println!(
        "{:<36} {:>10.0}  {} receipts committed in {:.2} s; target >= 10,000",
        "credits_per_s",
        credits_per_s,
        args.sessions,
        backlog_time.as_secs_f64()
    );
    println!(
        "{:<36} {:>10.0}  both signatures of each credit batch-verified, all cores: {:.2} of it",
        "stateless check alone (credits/s)",
        verify_per_s,
        credits_per_s / verify_per_s
    );
    for (name, value) in [
        ("metered -> pending p50", p50),
        ("metered -> pending p99", p99),
    ] {
        println!(
            "{:<36} {:>8.3} s  block interval {:.3} s ({} samples)",
            name,
            value.as_secs_f64(),
            interval as f64 / 1e3,
            args.samples
        );
    }
    Ok(())
}
