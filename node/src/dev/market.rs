//! The market in `dev`: a buyer (a key kept in the data dir, funded from the faucet once)
//! orders the whole model with an escrow deposit and names this run's backbone key as its
//! delegate; each worker's key offers its slice at the chain's reward rate; the chain places
//! the order on them at the block that takes it. The backbone acts for the order, so the
//! workers are paid from its escrow. Each run closes its order at the end; what is left of
//! the escrow goes back to the buyer a few blocks later (the grace for late credits).

use std::path::Path;

use anyhow::{bail, Context, Result};
use kvasir_api::market::{MarketQuery, OrderView};
use kvasir_api::reports::DevMarket;
use kvasir_api::Client;
use kvasir_inference::config::Config;
use kvasir_ledger::market::{Rect, Selection};
use kvasir_ledger::tx::{NewOffer, NewOrder};
use kvasir_ledger::{Address, Amount, Keypair, TxKind};

use kvasir_devnet::funding::{commit_all, faucet_pays, COMMIT_TIMEOUT};

/// What the buyer deposits in each run's order.
const DEPOSIT_KVR: &str = "5";
/// What the buyer holds beyond the deposit for its order's fees (creating and closing it
/// costs about 0.0005 KVR at the dev chain's lowest base fee).
const FEE_ROOM_KVR: &str = "0.01";
/// Blocks an order or offer of dev lasts; a run closes its order itself.
const LIFETIME_BLOCKS: u64 = 100_000;

/// The experts `first..=last` of every MoE layer of `config`, as the chain writes them.
fn slice(config: &Config, first: usize, last: usize) -> Result<Selection> {
    let layers: Vec<usize> = config.moe_layers().collect();
    let (Some(low), Some(high)) = (layers.first(), layers.last()) else {
        bail!("the model has no MoE layer to place");
    };
    let narrow = |v: usize| u16::try_from(v).context("the model is too large to place");
    Ok(Selection(vec![Rect {
        layers: (narrow(*low)?, narrow(*high)?),
        experts: (narrow(first)?, narrow(last)?),
    }]))
}

/// An order of `model` placed on the workers' offers, ready for the backbone. Dropped
/// before `close`, on a run that fails midway, it still closes the order (best effort), so
/// no failed run leaves the buyer's escrow locked until the order's end height.
pub struct Placed {
    pub order: u64,
    pub buyer: Keypair,
    pub escrow_before: Amount,
    ledger: String,
    closed: bool,
}

impl Drop for Placed {
    fn drop(&mut self) {
        if !self.closed {
            let ledger = Client::new(&self.ledger);
            if let Err(e) = close(&ledger, self) {
                eprintln!("market: order {} was left open: {e:#}", self.order);
            }
        }
    }
}

/// Offers each worker key's experts `first..=last` (an open offer of the same experts and
/// price from an earlier run is reused; the faucet pays the fee), funds the buyer, and orders every expert of
/// `model` with `backbone` as the delegate; returns once the chain has placed it.
pub fn place(
    ledger_url: &str,
    dir: &Path,
    faucet: &Keypair,
    workers: &[(&Keypair, (usize, usize))],
    config: &Config,
    model: &str,
    backbone: Address,
) -> Result<Placed> {
    let ledger = &Client::new(ledger_url);
    let params = ledger.params()?;
    let chain = params.chain_id.as_str();
    let price = params.reward_per_unit.base_units;
    let head = ledger.head()?.height;
    let mut offers = Vec::new();
    for (key, (first, last)) in workers {
        let experts = slice(config, *first, *last)?;
        let query = MarketQuery {
            model: Some(model.into()),
            operator: Some(key.address().to_string()),
            state: Some("open".into()),
            ..MarketQuery::default()
        };
        let open = ledger.offers(&query)?.offers;
        let reusable = open.iter().any(|o| {
            o.experts == experts.to_string()
                && o.price.base_units == price
                && o.expiry_height > head + 1_000
        });
        if !reusable {
            let new = NewOffer {
                model: model.into(),
                experts,
                price,
                expiry_height: head + LIFETIME_BLOCKS,
            };
            offers.push((*key, TxKind::OfferCreate(new), Amount::ZERO));
        }
    }
    // The faucet pays each offer's fee, so that a worker's balance is what it earned.
    faucet_pays(ledger, faucet, offers).context("offering the workers' experts")?;

    let buyer = buyer_key(dir)?;
    let deposit = Amount::parse(DEPOSIT_KVR)?;
    let balance = ledger.account(&buyer.address())?.balance.base_units;
    // The deposit, and what the order's transactions pay in fees (`FEE_ROOM_KVR`).
    let needed = deposit
        .checked_add(Amount::parse(FEE_ROOM_KVR)?)
        .unwrap_or(deposit);
    if balance < needed {
        let amount = needed.checked_sub(balance).unwrap_or(needed);
        let fund = TxKind::Transfer {
            to: buyer.address(),
            amount,
        };
        commit_all(
            ledger,
            vec![ledger.sign_next(chain, fund, faucet, Amount::ZERO)?],
        )
        .context("funding the buyer from the faucet")?;
    }
    let last_expert = config.num_experts.saturating_sub(1);
    let new = NewOrder {
        model: model.into(),
        experts: slice(config, 0, last_expert)?,
        replicas: 1,
        max_price: price,
        deposit,
        end_height: ledger.head()?.height + LIFETIME_BLOCKS,
        delegate: Some(backbone),
    };
    let tx = ledger.sign_next(chain, TxKind::OrderCreate(new), &buyer, Amount::ZERO)?;
    let hash = ledger.submit(&tx)?;
    let height = ledger.wait_committed(&hash, COMMIT_TIMEOUT)?;
    // The node that answers the listing may not have applied that block yet (over several
    // validators the client moves between them): look again until it has.
    let deadline = std::time::Instant::now() + COMMIT_TIMEOUT;
    let order = loop {
        if let Some(order) = order_created_at(ledger, &buyer.address(), height)? {
            break order;
        }
        if std::time::Instant::now() >= deadline {
            bail!("the order committed at height {height} is not listed");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    Ok(Placed {
        order: order.id,
        buyer,
        escrow_before: order.escrow.base_units,
        ledger: ledger_url.to_string(),
        closed: false,
    })
}

/// The order `buyer` created at `height`, if the node answering lists it.
fn order_created_at(ledger: &Client, buyer: &Address, height: u64) -> Result<Option<OrderView>> {
    let mut query = MarketQuery {
        buyer: Some(buyer.to_string()),
        ..MarketQuery::default()
    };
    loop {
        let page = ledger.orders(&query)?;
        if let Some(order) = page.orders.iter().find(|o| o.created_height == height) {
            return Ok(Some(order.clone()));
        }
        match page.next_after {
            Some(next) => query.after = Some(next),
            None => return Ok(None),
        }
    }
}

/// The buyer's key, `DIR/keys/buyer.key`, made on first use.
fn buyer_key(dir: &Path) -> Result<Keypair> {
    let keyfile = dir.join("keys").join("buyer.key");
    if keyfile.exists() {
        return Ok(kvasir_keyfile::open(&keyfile)?);
    }
    let key = Keypair::generate();
    kvasir_keyfile::write(&keyfile, &key, None)?;
    Ok(key)
}

/// Prints the order, its placements and its escrow before and after.
pub fn report(ledger: &Client, placed: &Placed) -> Result<DevMarket> {
    let order: OrderView = ledger.order(placed.order)?;
    let placements = ledger.order_placements(placed.order, false)?;
    println!(
        "market: order {} ({}) of {} {} at most {} per unit, escrow {} before, {} after ({} paid to workers)",
        order.id,
        order.state,
        order.model,
        order.experts,
        order.max_price.kvr,
        placed.escrow_before,
        order.escrow.kvr,
        order.paid.kvr
    );
    for p in &placements {
        println!(
            "  placement {}: {} by {} at {} per unit ({})",
            p.id, p.experts, p.operator, p.price.kvr, p.state
        );
    }
    Ok(DevMarket {
        escrow_before: placed.escrow_before.into(),
        order,
        placements,
    })
}

/// Closes the order: what is left of the escrow goes back to the buyer after the grace.
pub fn close(ledger: &Client, placed: &mut Placed) -> Result<()> {
    placed.closed = true;
    let chain = ledger.head()?.chain_id;
    let close = TxKind::OrderClose {
        order: placed.order,
    };
    let tx = ledger.sign_next(&chain, close, &placed.buyer, Amount::ZERO)?;
    commit_all(ledger, vec![tx]).context("closing the order")?;
    let order = ledger.order(placed.order)?;
    println!(
        "market: order {} closed; its escrow left, {}, goes back to the buyer {} at height {}",
        order.id,
        order.escrow.kvr,
        placed.buyer.address(),
        order.refund_height.unwrap_or(0)
    );
    Ok(())
}
