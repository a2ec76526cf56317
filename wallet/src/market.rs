//! The market verbs: an operator offers expert capacity (`offer create|withdraw|list`), a
//! buyer orders it with an escrow deposit (`order create|deposit|close|show`), and anyone
//! sees how a model is served (`market coverage`). Amounts and prices are exact KVR
//! decimals; prices are per reward unit (the chain's `unit_bytes` of metered traffic).

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use kvasir_api::market::{MarketQuery, OfferView, OrderView, PlacementView};
use kvasir_api::reports::{MarketTxReport, OrderReport};
use kvasir_api::Client;
use kvasir_ledger::market::selection::Pattern;
use kvasir_ledger::market::Selection;
use kvasir_ledger::tx::{NewOffer, NewOrder};
use kvasir_ledger::{Address, Amount, TxKind};

use crate::{address_or_own, print_report, Committed, Signer};

/// Blocks an offer or order lasts unless told otherwise (about a day at one block a second).
const DEFAULT_BLOCKS: u64 = 86_400;

#[derive(Subcommand)]
pub enum OfferCommand {
    /// Offer experts of a model at a price per reward unit; the key must hold the chain's
    /// `min_bond` bonded. Prints the offer's id.
    Create {
        /// The model's id or short name, as the chain pins it (`GET /params`).
        #[arg(long)]
        model: String,
        /// `LAYERS:EXPERTS` items, each side a number, a range `a-b` or `*` for all the
        /// model has (`0-3:0-7,5:9`, `*:0-63`).
        #[arg(long)]
        experts: Pattern,
        /// KVR per reward unit, exact decimal (`0.007`).
        #[arg(long)]
        price: Amount,
        /// The offer expires this many blocks after the head.
        #[arg(long, default_value_t = DEFAULT_BLOCKS)]
        blocks: u64,
    },
    /// End your offer; every placement on it closes and its orders are placed elsewhere.
    Withdraw { id: u64 },
    /// Offers, oldest first (a page of up to 1,000).
    List {
        #[arg(long)]
        model: Option<String>,
        /// Only this operator's (`--mine` for the key file's).
        #[arg(long)]
        operator: Option<Address>,
        #[arg(long, conflicts_with = "operator")]
        mine: bool,
        /// `open`, `withdrawn` or `expired`.
        #[arg(long)]
        state: Option<String>,
        /// Only ids above this (the previous page's last).
        #[arg(long)]
        after: Option<u64>,
    },
}

#[derive(Subcommand)]
pub enum OrderCommand {
    /// Order replicas of experts of a model, paid from an escrow funded now from your
    /// balance. Prints the order's id; the chain places it at the next block.
    Create {
        /// The model's id or short name, as the chain pins it (`GET /params`).
        #[arg(long)]
        model: String,
        /// `LAYERS:EXPERTS` items, `*` for all the model has (`0-3:0-7,5:9`, `*:0-63`).
        #[arg(long)]
        experts: Pattern,
        /// Placements of each expert, from distinct operators.
        #[arg(long, default_value_t = 1)]
        replicas: u8,
        /// The most you pay per reward unit, KVR.
        #[arg(long)]
        max_price: Amount,
        /// Moved into the escrow now, KVR.
        #[arg(long)]
        deposit: Amount,
        /// The order ends this many blocks after the head.
        #[arg(long, default_value_t = DEFAULT_BLOCKS)]
        blocks: u64,
        /// A key that may run the backbone for the order besides yours.
        #[arg(long)]
        delegate: Option<Address>,
    },
    /// Add KVR to an order's escrow (a paused order resumes).
    Deposit { id: u64, amount: Amount },
    /// Close your order: its placements end, and the escrow left comes back to you 60
    /// blocks later (credits for work already done are paid first).
    Close { id: u64 },
    /// An order, its escrow and every placement it has had.
    Show { id: u64 },
}

/// `experts` for `model`: its `*` resolved against the shape the chain pins for the model
/// (by id or name), when it pins one. A shape counts every layer, dense ones included, so
/// `*` names a dense layer's experts too, which no worker holds; name the MoE layers to
/// order only what can be placed. (The printed offer or order shows what was signed.)
fn selection(client: &Client, model: &str, experts: &Pattern) -> Result<Selection> {
    let params = client.params()?;
    let shape = params
        .models
        .iter()
        .find(|m| m.id == model || (!m.name.is_empty() && m.name == model))
        .and_then(|m| m.layers.zip(m.experts));
    Ok(experts.selection(shape)?)
}

/// The height `blocks` after the head.
fn height_after(client: &Client, blocks: u64) -> Result<u64> {
    let head = client.head()?.height;
    head.checked_add(blocks).context("the end height overflows")
}

/// The newest item of `pages` that was created at `height`: what a create transaction
/// committed at that height made.
fn created_at<T>(
    mut next: impl FnMut(Option<u64>) -> Result<(Vec<T>, Option<u64>)>,
    height: u64,
    created: impl Fn(&T) -> u64,
) -> Result<T> {
    let mut after = None;
    let mut found = None;
    loop {
        let (items, next_after) = next(after)?;
        found = items
            .into_iter()
            .filter(|i| created(i) == height)
            .last()
            .or(found);
        match next_after {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    found.context("the transaction was committed but what it created is not listed")
}

fn offer_line(o: &OfferView) -> String {
    format!(
        "offer {} {} {} {} at {} per unit, {} until height {}, {} placement(s)",
        o.id, o.state, o.model, o.experts, o.price.kvr, o.operator, o.expiry_height, o.placements
    )
}

fn order_line(o: &OrderView) -> String {
    let reason = o
        .close_reason
        .as_deref()
        .map_or(String::new(), |r| format!(" ({r})"));
    format!(
        "order {} {}{reason}: {} {} x{} at most {} per unit; escrow {}, paid {}, refunded {}, reserve {}; until height {}, {} placement(s)",
        o.id, o.state, o.model, o.experts, o.replicas, o.max_price.kvr, o.escrow.kvr, o.paid.kvr,
        o.refunded.kvr, o.reserve.kvr, o.end_height, o.placements
    )
}

fn placement_line(p: &PlacementView) -> String {
    let reason = p
        .close_reason
        .as_deref()
        .map_or(String::new(), |r| format!(" ({r})"));
    format!(
        "  placement {} {}{reason}: {} of offer {} by {} at {} per unit, from height {}",
        p.id, p.state, p.experts, p.offer, p.operator, p.price.kvr, p.start_height
    )
}

pub fn offer(command: OfferCommand, signer: &Signer, json: bool) -> Result<()> {
    let (client, keyfile) = (signer.client, signer.keyfile);
    let (Committed { hash, height, fee }, id) = match command {
        OfferCommand::Create {
            model,
            experts,
            price,
            blocks,
        } => {
            let operator = address_or_own(None, keyfile)?;
            let experts = selection(client, &model, &experts)?;
            let new = NewOffer {
                model,
                experts,
                price,
                expiry_height: height_after(client, blocks)?,
            };
            let committed = signer.commit(TxKind::OfferCreate(new))?;
            let offer = created_at(
                |after| {
                    let query = MarketQuery {
                        operator: Some(operator.to_string()),
                        state: Some("open".into()),
                        after,
                        ..MarketQuery::default()
                    };
                    let page = client.offers(&query)?;
                    Ok((page.offers, page.next_after))
                },
                committed.height,
                |o| o.created_height,
            )?;
            (committed, offer.id)
        }
        OfferCommand::Withdraw { id } => {
            let committed = signer.commit(TxKind::OfferWithdraw { offer: id })?;
            (committed, id)
        }
        OfferCommand::List {
            model,
            operator,
            mine,
            state,
            after,
        } => {
            let operator = match (operator, mine) {
                (Some(operator), _) => Some(operator),
                (None, true) => Some(address_or_own(None, keyfile)?),
                (None, false) => None,
            };
            let query = MarketQuery {
                model,
                operator: operator.map(|a| a.to_string()),
                state,
                after,
                ..MarketQuery::default()
            };
            let page = client.offers(&query)?;
            return print_report(json, &page, || {
                let mut lines: Vec<String> = page.offers.iter().map(offer_line).collect();
                if let Some(next) = page.next_after {
                    lines.push(format!("more: offer list --after {next}"));
                }
                lines.join("\n")
            });
        }
    };
    let offer = client.offer(id)?;
    let report = MarketTxReport {
        hash,
        height,
        offer: Some(offer.clone()),
        order: None,
        fee,
    };
    print_report(json, &report, || {
        format!(
            "{} (transaction {hash}, height {height})",
            offer_line(&offer)
        )
    })
}

pub fn order(command: OrderCommand, signer: &Signer, json: bool) -> Result<()> {
    let (client, keyfile) = (signer.client, signer.keyfile);
    let (hash, height, fee, id) = match command {
        OrderCommand::Create {
            model,
            experts,
            replicas,
            max_price,
            deposit,
            blocks,
            delegate,
        } => {
            let buyer = address_or_own(None, keyfile)?;
            let end_height = height_after(client, blocks)?;
            let experts = selection(client, &model, &experts)?;
            let new = NewOrder {
                model,
                experts,
                replicas,
                max_price,
                deposit,
                end_height,
                delegate,
            };
            let Committed { hash, height, fee } = signer.commit(TxKind::OrderCreate(new))?;
            let order = created_at(
                |after| {
                    let query = MarketQuery {
                        buyer: Some(buyer.to_string()),
                        after,
                        ..MarketQuery::default()
                    };
                    let page = client.orders(&query)?;
                    Ok((page.orders, page.next_after))
                },
                height,
                |o| o.created_height,
            )?;
            (hash, height, fee, order.id)
        }
        OrderCommand::Deposit { id, amount } => {
            let Committed { hash, height, fee } =
                signer.commit(TxKind::OrderDeposit { order: id, amount })?;
            (hash, height, fee, id)
        }
        OrderCommand::Close { id } => {
            let Committed { hash, height, fee } =
                signer.commit(TxKind::OrderClose { order: id })?;
            (hash, height, fee, id)
        }
        OrderCommand::Show { id } => {
            let order = client.order(id)?;
            let placements = client.order_placements(id, false)?;
            let report = OrderReport { order, placements };
            return print_report(json, &report, || {
                let mut lines = vec![order_line(&report.order)];
                lines.extend(report.placements.iter().map(placement_line));
                lines.join("\n")
            });
        }
    };
    let order = client.order(id)?;
    let report = MarketTxReport {
        hash,
        height,
        offer: None,
        order: Some(order.clone()),
        fee,
    };
    print_report(json, &report, || {
        format!(
            "{} (transaction {hash}, height {height})",
            order_line(&order)
        )
    })
}

pub fn coverage(model: &str, layer: Option<u16>, client: &Client, json: bool) -> Result<()> {
    let coverage = client.coverage(model, layer)?;
    if coverage.experts.is_empty() && !json {
        bail!("nothing of model {model:?} is ordered or placed");
    }
    print_report(json, &coverage, || {
        let mut lines: Vec<String> = coverage
            .experts
            .iter()
            .map(|e| {
                let price = match (&e.min_price, &e.max_price) {
                    (Some(low), Some(high)) if low == high => format!(" at {}", low.kvr),
                    (Some(low), Some(high)) => format!(" at {} to {}", low.kvr, high.kvr),
                    _ => String::new(),
                };
                format!(
                    "layer {} expert {}: {} of {} replica(s) placed{price}",
                    e.layer, e.expert, e.placements, e.replicas_wanted
                )
            })
            .collect();
        if coverage.truncated {
            lines.push("(truncated: narrow it with --layer)".into());
        }
        lines.join("\n")
    })
}
