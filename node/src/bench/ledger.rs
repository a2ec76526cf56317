//! The ledger benchmark. The reference is ed25519 batch verification of the same
//! signatures on all cores: the least work any node must do per transaction, so
//! `ratio = committed_tx_per_s / verify_per_s` says how much the rest of the pipeline
//! (stateful checks, execution, state root, sled commit with fsync) costs on top.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_ledger::genesis::{Allocation, Authorities};
use kvasir_ledger::intent::{signing_message, Intent};
use kvasir_ledger::tx::check_stateless;
use kvasir_ledger::{
    produce_block, Address, Amount, Genesis, Keypair, SignedTx, State, Store, Tx, TxKind,
};
use rayon::prelude::*;

#[derive(clap::Args)]
pub struct Args {
    /// Transfers to push through the pipeline.
    #[arg(long, default_value_t = 20_000)]
    txs: usize,
    /// Transactions per block.
    #[arg(long, default_value_t = 2_000)]
    block_txs: usize,
    /// Account count of the large state for the commit-time comparison.
    #[arg(long, default_value_t = 1_000_000)]
    large_accounts: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const CHAIN_ID: &str = "kvasir-bench";
const SENDERS: usize = 500;

fn seeded_key(role: &str, i: usize) -> Keypair {
    let mut hasher = blake3::Hasher::new_derive_key(role);
    hasher.update(&(i as u64).to_le_bytes());
    Keypair::from_seed(hasher.finalize().as_bytes())
}

fn filler_address(i: usize) -> Address {
    Address::from_bytes(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes())
}

/// A chain with `SENDERS` funded keys and `filler` further accounts.
fn bench_genesis(validator: &Keypair, senders: &[Keypair], filler: usize) -> Genesis {
    let funded = Amount::parse("1000").unwrap_or_default();
    let mut allocations: Vec<Allocation> = senders
        .iter()
        .map(|k| Allocation {
            address: k.address(),
            amount: funded,
        })
        .collect();
    allocations.extend((0..filler).map(|i| Allocation {
        address: filler_address(i),
        amount: Amount::from_base_units(1),
    }));
    Genesis {
        chain_id: CHAIN_ID.into(),
        genesis_time_ms: 0,
        unit_bytes: 1_000_000,
        reward_per_unit: Amount::from_base_units(7_000_000),
        challenge_window: 10,
        block_interval_ms: 1000,
        max_block_txs: 100_000,
        max_block_bytes: 256 << 20,
        rewards_pool: Amount::parse("1000").unwrap_or_default(),
        allocations,
        authorities: Authorities {
            validators: vec![validator.address()],
            gateways: vec![],
            hubs: vec![],
        },
    }
}

/// `count` signed transfers, round-robin over the senders, with consecutive nonces.
fn transfers(
    senders: &[Keypair],
    first_nonce: u64,
    count: usize,
    to: impl Fn(usize) -> Address + Sync,
) -> Vec<SignedTx> {
    (0..count)
        .into_par_iter()
        .map(|i| {
            let sender = &senders[i % senders.len()];
            Tx {
                chain_id: CHAIN_ID.into(),
                sender: sender.address(),
                nonce: first_nonce + (i / senders.len()) as u64,
                kind: TxKind::Transfer {
                    to: to(i),
                    amount: Amount::from_base_units(1),
                },
            }
            .sign(sender)
        })
        .collect()
}

/// Raw ed25519 batch verification of the transactions' signatures on all cores.
fn verify_rate(txs: &[SignedTx]) -> Result<f64> {
    let items: Vec<_> = txs
        .iter()
        .map(|tx| {
            let message = signing_message(Intent::Transaction, CHAIN_ID, &tx.tx);
            let signature = ed25519_dalek::Signature::from_bytes(&tx.signature.0);
            let key = ed25519_dalek::VerifyingKey::from_bytes(tx.tx.sender.as_bytes());
            key.map(|k| (message, signature, k))
        })
        .collect::<Result<_, _>>()?;
    let start = Instant::now();
    let ok = items.par_chunks(64).all(|chunk| {
        let messages: Vec<&[u8]> = chunk.iter().map(|(m, _, _)| m.as_slice()).collect();
        let signatures: Vec<_> = chunk.iter().map(|(_, s, _)| *s).collect();
        let keys: Vec<_> = chunk.iter().map(|(_, _, k)| *k).collect();
        ed25519_dalek::verify_batch(&messages, &signatures, &keys).is_ok()
    });
    let elapsed = start.elapsed();
    if !ok {
        bail!("a benchmark signature failed to verify");
    }
    Ok(txs.len() as f64 / elapsed.as_secs_f64())
}

/// Produces and commits blocks of `block_txs` from `txs`; returns the time of each block.
fn commit_all(
    store: &Store,
    state: &mut State,
    validator: &Keypair,
    txs: &[SignedTx],
    block_txs: usize,
) -> Result<Vec<Duration>> {
    let mut times = Vec::new();
    for chunk in txs.chunks(block_txs.max(1)) {
        let start = Instant::now();
        let produced = produce_block(state, chunk, validator, state.timestamp_ms() + 1000)?;
        if let Some((_, error)) = produced.rejected.first() {
            bail!("benchmark transaction rejected: {error}");
        }
        store.commit(&produced.block, &produced.changes)?;
        times.push(start.elapsed());
        *state = produced.state;
    }
    Ok(times)
}

/// Median time to produce and commit a block of `block_txs` transfers to random existing
/// accounts, on a chain holding `accounts` accounts.
fn commit_time_at(
    accounts: usize,
    block_txs: usize,
    validator: &Keypair,
    senders: &[Keypair],
) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let genesis = bench_genesis(
        validator,
        senders,
        accounts.saturating_sub(senders.len() + 1),
    );
    let store = Store::create(dir.path(), &genesis)?;
    let mut state = store.load_state()?;
    let filler = accounts.saturating_sub(senders.len() + 1).max(1);
    let blocks = 5;
    let txs = transfers(senders, 0, block_txs * blocks, |i| {
        filler_address((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) as usize % filler)
    });
    let mut times = commit_all(&store, &mut state, validator, &txs, block_txs)?;
    times.sort();
    Ok(times[times.len() / 2])
}

pub fn run(args: Args) -> Result<()> {
    let validator = seeded_key("kvasir bench validator", 0);
    let senders: Vec<Keypair> = (0..SENDERS)
        .into_par_iter()
        .map(|i| seeded_key("kvasir bench sender", i))
        .collect();
    let genesis = bench_genesis(&validator, &senders, 0);
    let txs = transfers(&senders, 0, args.txs, |i| {
        senders[(i + 1) % SENDERS].address()
    });

    let verify_per_s = verify_rate(&txs)?;

    let start = Instant::now();
    let checked = check_stateless(&genesis, &txs);
    let checked_tx_per_s = txs.len() as f64 / start.elapsed().as_secs_f64();
    if checked.iter().any(Result::is_err) {
        bail!("a benchmark transaction failed the stateless check");
    }

    let dir = tempfile::tempdir()?;
    let store = Store::create(dir.path(), &genesis)?;
    let mut state = store.load_state()?;
    let start = Instant::now();
    commit_all(&store, &mut state, &validator, &txs, args.block_txs)?;
    let committed_tx_per_s = txs.len() as f64 / start.elapsed().as_secs_f64();
    let ratio = committed_tx_per_s / verify_per_s;

    let commit_block_txs = 1_000;
    let small = commit_time_at(10_000, commit_block_txs, &validator, &senders)?;
    let large = commit_time_at(args.large_accounts, commit_block_txs, &validator, &senders)?;
    let growth = large.as_secs_f64() / small.as_secs_f64();
    let cores = rayon::current_num_threads();

    if args.json {
        let value = serde_json::json!({
            "cores": cores,
            "txs": args.txs,
            "block_txs": args.block_txs,
            "verify_per_s": verify_per_s.round(),
            "checked_tx_per_s": checked_tx_per_s.round(),
            "committed_tx_per_s": committed_tx_per_s.round(),
            "ratio": (ratio * 1000.0).round() / 1000.0,
            "commit_block_txs": commit_block_txs,
            "commit_ms_10k_accounts": small.as_secs_f64() * 1e3,
            "commit_ms_large_accounts": large.as_secs_f64() * 1e3,
            "large_accounts": args.large_accounts,
            "commit_growth": (growth * 1000.0).round() / 1000.0,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench ledger: {} transfers in blocks of {}, {cores} cores",
        args.txs, args.block_txs
    );
    println!("{:<44} {:>14}  {}", "figure", "value", "reference");
    println!(
        "{:<44} {:>12.0}/s  ed25519 batch verify, all cores",
        "verify_per_s", verify_per_s
    );
    println!(
        "{:<44} {:>12.0}/s  format + signatures, batched",
        "checked_tx_per_s (stateless only)", checked_tx_per_s
    );
    println!(
        "{:<44} {:>12.0}/s  checked, applied, committed to sled",
        "committed_tx_per_s", committed_tx_per_s
    );
    println!(
        "{:<44} {:>14.3}  target >= 0.5",
        "ratio = committed / verify", ratio
    );
    println!(
        "{:<44} {:>12.2}ms",
        format!("block commit ({commit_block_txs} txs), 10k accounts"),
        small.as_secs_f64() * 1e3
    );
    println!(
        "{:<44} {:>12.2}ms",
        format!(
            "block commit ({commit_block_txs} txs), {} accounts",
            args.large_accounts
        ),
        large.as_secs_f64() * 1e3
    );
    println!(
        "{:<44} {:>14.3}  flat = 1.0",
        "commit_growth = large / 10k", growth
    );
    Ok(())
}
