//! The ledger benchmark. The reference is ed25519 batch verification of the same
//! signatures on all cores: the least work any node must do per transaction, so
//! `ratio = committed_tx_per_s / verify_per_s` says how much the rest of the pipeline
//! (stateful checks, execution, state root, sled commit with fsync) costs on top.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_ledger::fees::{FeeBid, DEFAULT_FEES, MAX_BASE_FEE};
use kvasir_ledger::fraction::Fraction;
use kvasir_ledger::genesis::{Allocation, Authorities, ChainParams, FORMAT};
use kvasir_ledger::intent::{signing_message, Intent};
use kvasir_ledger::{
    check_stateless, produce_block, Address, Amount, Certificate, Genesis, Keypair, SignedTx,
    SledStore, State, Storage, TxKind, VerifiedTx,
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

pub(super) const CHAIN_NAME: &str = "kvasir-bench";

/// What a bench transaction bids on `genesis`'s chain: no tip, and a most no base fee
/// reaches (`fees::MAX_BASE_FEE`), so that a rising price never makes one wait; it pays the
/// price of its block all the same. None on a chain without fees.
pub(super) fn bench_bid(genesis: &Genesis) -> Option<FeeBid> {
    genesis.params.fees.map(|_| FeeBid {
        max_per_byte: MAX_BASE_FEE,
        tip_per_byte: Amount::ZERO,
    })
}
const SENDERS: usize = 500;

pub(super) fn seeded_key(role: &str, i: usize) -> Keypair {
    let mut hasher = blake3::Hasher::new_derive_key(role);
    hasher.update(&(i as u64).to_le_bytes());
    Keypair::from_seed(hasher.finalize().as_bytes())
}

fn filler_address(i: usize) -> Address {
    Address::from_bytes(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes())
}

/// A chain with `SENDERS` funded keys and `filler` further accounts.
pub(super) fn bench_genesis(validator: &Keypair, senders: &[Keypair], filler: usize) -> Genesis {
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
        genesis_time_ms: 0,
        params: ChainParams {
            chain_id: CHAIN_NAME.into(),
            // Format 2, as every new chain: every transaction pays its fee, which the
            // figures include. Its market trades an unpinned model, which only format 1
            // allows: the market bench makes its own format-1 chain (`market`).
            format: FORMAT,
            unit_bytes: 1_000_000,
            reward_per_unit: Amount::from_base_units(7_000_000),
            challenge_window: 10,
            block_interval_ms: 1000,
            max_block_txs: 100_000,
            max_block_bytes: 256 << 20,
            rewards_pool: Amount::parse("1000").unwrap_or_default(),
            min_new_account: Amount::ZERO,
            min_bond: Amount::ZERO,
            unbonding_blocks: 0,
            slash_fraction: Fraction::ZERO,
            reporter_share: Fraction::ZERO,
            jail_blocks: 0,
            fees: Some(DEFAULT_FEES),
        },
        allocations,
        authorities: Authorities {
            validators: vec![validator.address()],
            gateways: vec![],
            hubs: vec![],
        },
        models: Vec::new(),
    }
}

/// `count` signed transfers on `genesis`'s chain, round-robin over the senders, with
/// consecutive nonces.
fn transfers(
    genesis: &Genesis,
    senders: &[Keypair],
    first_nonce: u64,
    count: usize,
    to: impl Fn(usize) -> Address + Sync,
) -> Vec<SignedTx> {
    let (chain_id, bid) = (genesis.chain_id(), bench_bid(genesis));
    (0..count)
        .into_par_iter()
        .map(|i| {
            let sender = &senders[i % senders.len()];
            let nonce = first_nonce + (i / senders.len()) as u64;
            TxKind::Transfer {
                to: to(i),
                amount: Amount::from_base_units(1),
            }
            .signed_paying(&chain_id, bid, sender, nonce)
        })
        .collect()
}

/// The reference: ed25519 batch verification (the same ZIP-215 verifier the ledger uses)
/// of the transactions' signatures on all cores, from message, key and signature bytes.
fn verify_rate(txs: &[SignedTx]) -> Result<f64> {
    let messages: Vec<Vec<u8>> = txs
        .iter()
        .map(|tx| signing_message(Intent::Transaction, &tx.tx.chain_id, &tx.tx))
        .collect();
    let start = Instant::now();
    let ok = txs
        .par_chunks(64)
        .zip(messages.par_chunks(64))
        .all(|(txs, messages)| {
            let mut batch = ed25519_consensus::batch::Verifier::new();
            for (tx, message) in txs.iter().zip(messages) {
                let key = ed25519_consensus::VerificationKeyBytes::from(*tx.tx.sender.as_bytes());
                batch.queue((
                    key,
                    ed25519_consensus::Signature::from(tx.signature.0),
                    message,
                ));
            }
            batch.verify(rand::thread_rng()).is_ok()
        });
    let elapsed = start.elapsed();
    if !ok {
        bail!("a benchmark signature failed to verify");
    }
    Ok(txs.len() as f64 / elapsed.as_secs_f64())
}

/// Runs the whole pipeline over `txs` in blocks of `block_txs`: a checker thread runs the
/// stateless stage (on all cores) one block ahead, as mempool admission does in the ledger
/// service, while this thread produces and commits. Returns the time of each block's
/// produce + commit.
fn commit_all(
    store: &SledStore,
    state: &mut State,
    validator: &Keypair,
    txs: Vec<SignedTx>,
    block_txs: usize,
) -> Result<Vec<Duration>> {
    let genesis = state.genesis().clone();
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut txs = txs.into_iter().peekable();
            while txs.peek().is_some() {
                let chunk: Vec<SignedTx> = txs.by_ref().take(block_txs.max(1)).collect();
                let checked: Result<Vec<VerifiedTx>, _> =
                    check_stateless(&genesis, chunk).into_iter().collect();
                if sender.send(checked).is_err() {
                    return;
                }
            }
        });
        let mut times = Vec::new();
        for chunk in receiver {
            let chunk = chunk?;
            let start = Instant::now();
            let produced = produce_block(state, &chunk, validator, state.timestamp_ms() + 1000)?;
            if let Some((_, error)) = produced.rejected.first() {
                bail!("benchmark transaction rejected: {error}");
            }
            let certificate = Certificate::for_block(&produced.block, 0, &[validator]);
            store.commit(&produced.block, &produced.changes, &certificate)?;
            times.push(start.elapsed());
            *state = produced.state;
        }
        Ok(times)
    })
}

/// What one chain size costs: median time to apply a block of transfers to random
/// existing accounts (execution and state root, in memory), median time to commit such a
/// block to sled, and the plain alternative to an incremental root: building the state and
/// its root over every account from scratch.
struct CommitTimes {
    apply: Duration,
    sled_commit: Duration,
    full_rebuild: Duration,
}

/// Blocks are produced first, on a state with no store open, so sled's background threads
/// cannot disturb the apply timing; the same blocks are then committed to a fresh store.
/// Signatures are checked beforehand and warm-up blocks are not timed.
fn commit_times_at(
    accounts: usize,
    block_txs: usize,
    validator: &Keypair,
    senders: &[Keypair],
) -> Result<CommitTimes> {
    const WARM_UP: usize = 3;
    const TIMED: usize = 9;
    let filler = accounts.saturating_sub(senders.len()).max(1);
    let genesis = bench_genesis(validator, senders, filler);
    let start = Instant::now();
    let mut state = State::from_genesis(genesis.clone());
    let full_rebuild = start.elapsed();
    let txs = transfers(&genesis, senders, 0, block_txs * (WARM_UP + TIMED), |i| {
        filler_address((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) as usize % filler)
    });
    let checked: Vec<VerifiedTx> = check_stateless(&genesis, txs)
        .into_iter()
        .collect::<Result<_, _>>()?;
    let mut produced = Vec::new();
    let mut apply = Vec::new();
    for chunk in checked.chunks(block_txs) {
        let start = Instant::now();
        let block = produce_block(&state, chunk, validator, state.timestamp_ms() + 1000)?;
        apply.push(start.elapsed());
        if let Some((_, error)) = block.rejected.first() {
            bail!("benchmark transaction rejected: {error}");
        }
        state = block.state;
        let certificate = Certificate::for_block(&block.block, 0, &[validator]);
        produced.push((block.block, block.changes, certificate));
    }
    let dir = tempfile::tempdir()?;
    let store = SledStore::create(dir.path(), &genesis)?;
    let mut sled_commit = Vec::new();
    for (block, changes, certificate) in &produced {
        let start = Instant::now();
        store.commit(block, changes, certificate)?;
        sled_commit.push(start.elapsed());
    }
    let median = |mut times: Vec<Duration>| {
        let mut timed = times.split_off(WARM_UP);
        timed.sort();
        timed[timed.len() / 2]
    };
    Ok(CommitTimes {
        apply: median(apply),
        sled_commit: median(sled_commit),
        full_rebuild,
    })
}

pub fn run(args: Args) -> Result<()> {
    let validator = seeded_key("kvasir bench validator", 0);
    let senders: Vec<Keypair> = (0..SENDERS)
        .into_par_iter()
        .map(|i| seeded_key("kvasir bench sender", i))
        .collect();
    let genesis = bench_genesis(&validator, &senders, 0);
    let txs = transfers(&genesis, &senders, 0, args.txs, |i| {
        senders[(i + 1) % SENDERS].address()
    });

    let verify_per_s = verify_rate(&txs)?;

    let copy = txs.clone();
    let start = Instant::now();
    let checked = check_stateless(&genesis, copy);
    let checked_tx_per_s = txs.len() as f64 / start.elapsed().as_secs_f64();
    if checked.iter().any(Result::is_err) {
        bail!("a benchmark transaction failed the stateless check");
    }
    drop(checked);

    let dir = tempfile::tempdir()?;
    let store = SledStore::create(dir.path(), &genesis)?;
    let mut state = store.load_state()?;
    let count = txs.len();
    let start = Instant::now();
    commit_all(&store, &mut state, &validator, txs, args.block_txs)?;
    let committed_tx_per_s = count as f64 / start.elapsed().as_secs_f64();
    let ratio = committed_tx_per_s / verify_per_s;

    let commit_block_txs = 1_000;
    let small = commit_times_at(10_000, commit_block_txs, &validator, &senders)?;
    let large = commit_times_at(args.large_accounts, commit_block_txs, &validator, &senders)?;
    let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    let ratio_of =
        |a: Duration, b: Duration| (a.as_secs_f64() / b.as_secs_f64() * 1e3).round() / 1e3;
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
            "large_accounts": args.large_accounts,
            "apply_ms_10k_accounts": ms(small.apply),
            "apply_ms_large_accounts": ms(large.apply),
            "apply_growth": ratio_of(large.apply, small.apply),
            "sled_commit_ms_10k_accounts": ms(small.sled_commit),
            "sled_commit_ms_large_accounts": ms(large.sled_commit),
            "sled_commit_growth": ratio_of(large.sled_commit, small.sled_commit),
            "full_rebuild_ms_large_accounts": ms(large.full_rebuild),
            "incremental_vs_rebuild": ratio_of(large.apply, large.full_rebuild),
        });
        println!("{value}");
        return Ok(());
    }
    let n = args.large_accounts;
    println!(
        "kvasir-node bench ledger: {} transfers in blocks of {}, {cores} cores",
        args.txs, args.block_txs
    );
    println!("{:<46} {:>12}  reference", "figure", "value");
    println!(
        "{:<46} {:>10.0}/s  ed25519 batch verify (ZIP-215), all cores",
        "verify_per_s", verify_per_s
    );
    println!(
        "{:<46} {:>10.0}/s  format + signatures, batched",
        "checked_tx_per_s (stateless stage only)", checked_tx_per_s
    );
    println!(
        "{:<46} {:>10.0}/s  checked, applied, committed to sled",
        "committed_tx_per_s", committed_tx_per_s
    );
    println!(
        "{:<46} {:>12.3}  target >= 0.5",
        "ratio = committed / verify", ratio
    );
    println!();
    println!(
        "block of {commit_block_txs} transfers to random accounts   {:>12} {:>12}  growth",
        "10k accounts",
        format!("{n} accounts")
    );
    println!(
        "{:<40} {:>10.2}ms {:>10.2}ms  {:.3}",
        "  apply (execute + state root)",
        ms(small.apply),
        ms(large.apply),
        ratio_of(large.apply, small.apply)
    );
    println!(
        "{:<40} {:>10.2}ms {:>10.2}ms  {:.3}",
        "  commit to sled (atomic batch + flush)",
        ms(small.sled_commit),
        ms(large.sled_commit),
        ratio_of(large.sled_commit, small.sled_commit)
    );
    println!(
        "{:<40} {:>10.2}ms {:>10.2}ms  {:.3}",
        "  root over all accounts from scratch",
        ms(small.full_rebuild),
        ms(large.full_rebuild),
        ratio_of(large.full_rebuild, small.full_rebuild)
    );
    println!(
        "incremental apply / rebuild from scratch at {n} accounts: {:.4}",
        ratio_of(large.apply, large.full_rebuild)
    );
    Ok(())
}
