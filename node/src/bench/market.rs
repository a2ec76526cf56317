//! The market benchmark: `apply_block` (what every validator runs on every proposal) with
//! matching at the block boundary, on a market of 1,000 offers and 100 orders and on one ten
//! times larger, next to the same block of plain transfers on the larger market (the
//! reference: what a block costs without market work). Each timed block carries new offers,
//! new orders and withdrawals, so orders lose placements and short orders see new offers:
//! matching runs every block. Target: at most 50 ms per block at 10,000 offers and 1,000
//! orders, growing no worse than linearly with the market.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_ledger::market::{Rect, Selection};
use kvasir_ledger::tx::{NewOffer, NewOrder};
use kvasir_ledger::{
    apply_block, check_stateless, produce_block, Amount, Keypair, SignedTx, State, TxKind,
    VerifiedTx,
};

use super::ledger::{bench_genesis, seeded_key, CHAIN_NAME};

#[derive(clap::Args)]
pub struct Args {
    /// Timed blocks per market size (the median is reported).
    #[arg(long, default_value_t = 9)]
    blocks: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const MODEL: &str = "bench-moe";
const LAYERS: u16 = 48;
const EXPERTS: u16 = 128;
const OFFERS_PER_OPERATOR: usize = 50;
const ORDERS_PER_BUYER: usize = 50;
/// Buyers beyond those of the standing orders, who place the timed blocks' new orders.
const SPARE_BUYERS: usize = 30;

/// A deterministic stream of numbers, so every run builds the same market.
struct Draw(u64);

impl Draw {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below.max(1)
    }
}

/// Keys of one market size, with their nonces as the chain will expect them.
#[derive(Clone)]
struct Keys {
    validator: Keypair,
    operators: Vec<Keypair>,
    buyers: Vec<Keypair>,
    /// The next of the buyers kept for the timed blocks' orders.
    spare: usize,
    nonces: std::collections::HashMap<kvasir_ledger::Address, u64>,
}

impl Keys {
    fn signed(&mut self, who: &Keypair, kind: TxKind) -> SignedTx {
        let nonce = self.nonces.entry(who.address()).or_insert(0);
        let tx = kind.signed(CHAIN_NAME, who, *nonce);
        *nonce += 1;
        tx
    }
}

fn offer(draw: &mut Draw) -> TxKind {
    let layer = draw.next(u64::from(LAYERS)) as u16;
    let first = draw.next(u64::from(EXPERTS - 16)) as u16;
    TxKind::OfferCreate(NewOffer {
        model: MODEL.into(),
        experts: Selection(vec![Rect {
            layers: (layer, (layer + 1).min(LAYERS - 1)),
            experts: (first, first + 15),
        }]),
        price: Amount::from_base_units(1_000_000 + draw.next(9_000_000)),
        expiry_height: 1_000_000,
    })
}

fn order(draw: &mut Draw) -> TxKind {
    let layer = draw.next(u64::from(LAYERS)) as u16;
    let first = draw.next(u64::from(EXPERTS - 8)) as u16;
    TxKind::OrderCreate(NewOrder {
        model: MODEL.into(),
        experts: Selection(vec![Rect {
            layers: (layer, layer),
            experts: (first, first + 7),
        }]),
        replicas: 2,
        // Below the dearest offers: some orders stay short and are matched again whenever
        // a new offer of the model arrives.
        max_price: Amount::from_base_units(6_000_000),
        deposit: Amount::parse("10").unwrap_or_default(),
        end_height: 1_000_000,
        delegate: None,
    })
}

/// Produces one block of `txs` on `state`, refusing any rejection.
fn block(state: &State, keys: &Keys, txs: Vec<SignedTx>) -> Result<(State, kvasir_ledger::Block)> {
    let checked: Vec<VerifiedTx> = check_stateless(state.genesis(), txs)
        .into_iter()
        .collect::<Result<_, _>>()?;
    let produced = produce_block(
        state,
        &checked,
        &keys.validator,
        state.timestamp_ms() + 1000,
    )?;
    if let Some((_, error)) = produced.rejected.first() {
        bail!("benchmark transaction rejected: {error}");
    }
    Ok((produced.state, produced.block))
}

/// A chain whose market holds `offers` open offers and `orders` orders.
fn market(offers: usize, orders: usize, draw: &mut Draw) -> Result<(State, Keys)> {
    let operators: Vec<Keypair> = (0..offers.div_ceil(OFFERS_PER_OPERATOR))
        .map(|i| seeded_key("kvasir bench operator", i))
        .collect();
    let standing = orders.div_ceil(ORDERS_PER_BUYER);
    let buyers: Vec<Keypair> = (0..standing + SPARE_BUYERS)
        .map(|i| seeded_key("kvasir bench buyer", i))
        .collect();
    let validator = seeded_key("kvasir bench validator", 0);
    let funded: Vec<Keypair> = operators.iter().chain(&buyers).cloned().collect();
    let mut genesis = bench_genesis(&validator, &funded, 0);
    // Format 1: this market trades a model the chain does not pin, which format 2 refuses;
    // what is measured is matching, not fees.
    genesis.params.format = 1;
    genesis.params.fees = None;
    genesis.params.min_bond = Amount::parse("10").unwrap_or_default();
    genesis.params.unbonding_blocks = genesis.params.challenge_window + 1;
    let mut keys = Keys {
        validator,
        operators,
        buyers,
        spare: standing,
        nonces: Default::default(),
    };
    let mut state = State::from_genesis(genesis);
    let bonds: Vec<SignedTx> = keys
        .operators
        .clone()
        .iter()
        .map(|op| {
            keys.signed(
                op,
                TxKind::Bond {
                    amount: Amount::parse("10").unwrap_or_default(),
                },
            )
        })
        .collect();
    state = block(&state, &keys, bonds)?.0;
    let offer_txs: Vec<SignedTx> = (0..offers)
        .map(|i| {
            let op = keys.operators[i / OFFERS_PER_OPERATOR].clone();
            let kind = offer(draw);
            keys.signed(&op, kind)
        })
        .collect();
    for chunk in offer_txs.chunks(5_000) {
        state = block(&state, &keys, chunk.to_vec())?.0;
    }
    let order_txs: Vec<SignedTx> = (0..orders)
        .map(|i| {
            let buyer = keys.buyers[i / ORDERS_PER_BUYER].clone();
            let kind = order(draw);
            keys.signed(&buyer, kind)
        })
        .collect();
    // Orders arrive a few hundred a block, as they would, so matching budgets hold.
    for chunk in order_txs.chunks(200) {
        state = block(&state, &keys, chunk.to_vec())?.0;
    }
    Ok((state, keys))
}

/// Median `apply_block` time over `count` blocks that `next` makes on the market.
fn timed_blocks(
    mut state: State,
    keys: &mut Keys,
    count: usize,
    mut next: impl FnMut(&State, &mut Keys) -> Vec<SignedTx>,
) -> Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..count {
        let txs = next(&state, keys);
        let (after, produced) = block(&state, keys, txs)?;
        let start = Instant::now();
        let (applied, _) = apply_block(&state, &produced)?;
        times.push(start.elapsed());
        if applied.root() != after.root() {
            bail!("a block applied to another root than it was produced with");
        }
        state = after;
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// A block of market work: 20 new offers, 10 new orders, 10 withdrawals of the oldest open
/// offers that hold placements, and 100 transfers.
fn market_block(state: &State, keys: &mut Keys, draw: &mut Draw) -> Vec<SignedTx> {
    let mut txs = Vec::new();
    let market = state.market();
    let withdrawn: Vec<(u64, kvasir_ledger::Address)> = market
        .offers()
        .filter(|o| market.live_placements_of_offer(o.id).next().is_some())
        .take(10)
        .map(|o| (o.id, o.operator))
        .collect();
    for (id, operator) in withdrawn {
        if let Some(op) = keys
            .operators
            .iter()
            .find(|k| k.address() == operator)
            .cloned()
        {
            txs.push(keys.signed(&op, TxKind::OfferWithdraw { offer: id }));
        }
    }
    for i in 0..20 {
        let op = keys.operators[draw.next(keys.operators.len() as u64) as usize].clone();
        if market.open_offer_count(&op.address()) + i
            < kvasir_ledger::market::MAX_OPEN_OFFERS_PER_OPERATOR - 20
        {
            let kind = offer(draw);
            txs.push(keys.signed(&op, kind));
        }
    }
    for _ in 0..10 {
        let buyer = keys.buyers[keys.spare % keys.buyers.len()].clone();
        keys.spare += 1;
        let kind = order(draw);
        txs.push(keys.signed(&buyer, kind));
    }
    txs.extend(transfers(keys, 100));
    txs
}

/// `count` transfers between buyers.
fn transfers(keys: &mut Keys, count: usize) -> Vec<SignedTx> {
    (0..count)
        .map(|i| {
            let from = keys.buyers[i % keys.buyers.len()].clone();
            let to = keys.buyers[(i + 1) % keys.buyers.len()].address();
            keys.signed(
                &from,
                TxKind::Transfer {
                    to,
                    amount: Amount::from_base_units(1),
                },
            )
        })
        .collect()
}

pub fn run(args: Args) -> Result<()> {
    let blocks = args.blocks.max(1);
    let mut draw = Draw(7);
    let (small, mut small_keys) = market(1_000, 100, &mut draw)?;
    let small_ms = timed_blocks(small, &mut small_keys, blocks, |s, k| {
        market_block(s, k, &mut draw)
    })?;
    let mut draw = Draw(7);
    let (large, mut large_keys) = market(10_000, 1_000, &mut draw)?;
    let placements = large.market().placements().filter(|p| p.is_live()).count();
    let short = large
        .market()
        .live_orders()
        .filter(|o| o.state != kvasir_ledger::market::OrderState::Active)
        .count();
    // The reference starts from the same market, with the nonces it had then.
    let mut plain_keys = large_keys.clone();
    let large_ms = timed_blocks(large.clone(), &mut large_keys, blocks, |s, k| {
        market_block(s, k, &mut draw)
    })?;
    let plain_ms = timed_blocks(large, &mut plain_keys, blocks, |_, k| transfers(k, 140))?;
    let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    let growth = (large_ms.as_secs_f64() / small_ms.as_secs_f64() * 1e3).round() / 1e3;
    let vs_plain = (large_ms.as_secs_f64() / plain_ms.as_secs_f64() * 1e3).round() / 1e3;
    let cores = rayon::current_num_threads();
    if args.json {
        let value = serde_json::json!({
            "cores": cores,
            "blocks": blocks,
            "block_ms_1k_offers_100_orders": ms(small_ms),
            "block_ms_10k_offers_1k_orders": ms(large_ms),
            "growth_10x_market": growth,
            "plain_block_ms_10k_offers_1k_orders": ms(plain_ms),
            "market_vs_plain": vs_plain,
            "live_placements_10k": placements,
            "short_orders_10k": short,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench market: apply_block with matching, median of {blocks} blocks, {cores} cores"
    );
    println!(
        "each block: 20 new offers, 10 new orders, 10 withdrawals of placed offers, 100 transfers"
    );
    println!("{:<46} {:>10}  reference", "figure", "value");
    println!(
        "{:<46} {:>8.2}ms",
        "block_ms at 1,000 offers, 100 orders",
        ms(small_ms)
    );
    println!(
        "{:<46} {:>8.2}ms  target <= 50 ms ({placements} live placements, {short} orders short)",
        "block_ms at 10,000 offers, 1,000 orders",
        ms(large_ms)
    );
    println!(
        "{:<46} {:>10.3}  linear would be 10",
        "growth with a 10x market", growth
    );
    println!(
        "{:<46} {:>8.2}ms  140 transfers, no market work",
        "plain block at 10,000 offers, 1,000 orders",
        ms(plain_ms)
    );
    println!("{:<46} {:>10.3}", "market block / plain block", vs_plain);
    Ok(())
}
