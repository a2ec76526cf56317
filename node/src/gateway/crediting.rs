//! The gateway's crediting: it polls the hub's registry and, for every session whose signed
//! cumulative count is above what the ledger has recorded, submits a Credit transaction
//! carrying the hub's receipt. Exactly once by construction: the ledger pays
//! `earned(new) - earned(recorded)` and refuses counts that do not rise, so a receipt
//! submitted twice (after a crash, say) pays once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvasir_api::ledger::FeesView;
use kvasir_api::ledger::PAGE_MAX;
use kvasir_api::registry::ReceiptEntry;
use kvasir_api::Client;
use kvasir_ledger::fees::Lane;
use kvasir_ledger::{Address, Amount, Keypair, SignedReceipt, SignedTx, TxKind};
use rayon::prelude::*;

use super::stats::Stats;

/// How long a round waits for its credits to commit before polling again.
const COMMIT_WAIT: Duration = Duration::from_secs(30);
/// Credits per submission (the ledger API's batch limit).
const BATCH: usize = 10_000;
/// Every this many rounds, one walks every session by id instead of the change listing: it
/// catches a change the hub logged late (it died between counting and logging).
const FULL_WALK_EVERY: u64 = 60;
/// A change listing up to this long has its ledger marks asked session by session.
const ONE_BY_ONE: usize = 256;
/// Rounds a receipt the ledger refused as invalid is passed over at the count it was refused
/// at, and how many such receipts are remembered.
const SKIP_ROUNDS: u64 = FULL_WALK_EVERY;
const MAX_REFUSED: usize = 4096;
/// Rounds a receipt whose pay would not cover a credit's fee is held back at one count
/// before it is credited all the same (its session has gone quiet: the tail it ends on,
/// worth less than the fee, goes to the fee, and the session is closed on the chain).
const HOLD_ROUNDS: u64 = 20;

/// Receipts held back for their fee (`FeeCover`), at the count and since the round they were
/// first held there; as many as `MAX_REFUSED`.
#[derive(Default)]
struct Held {
    held: HashMap<MeterOf, (u64, u64)>,
}

impl Held {
    /// Whether a receipt too small for its fee at `count` has waited long enough at it.
    fn waited(&mut self, meter: MeterOf, count: u64, round: u64) -> bool {
        if self.held.len() >= MAX_REFUSED && !self.held.contains_key(&meter) {
            self.held
                .retain(|_, (_, since)| round < since.saturating_add(HOLD_ROUNDS));
            if self.held.len() >= MAX_REFUSED {
                self.held.clear();
            }
        }
        let (at, since) = *self.held.entry(meter).or_insert((count, round));
        if at != count {
            self.held.insert(meter, (count, round));
            return false;
        }
        if round >= since.saturating_add(HOLD_ROUNDS) {
            self.held.remove(&meter);
            return true;
        }
        false
    }
}

/// What identifies a receipt's count on the ledger: hub, session and order.
type MeterOf = (Address, u64, u64);

/// Receipts the ledger refused as invalid, at the count it refused. One it would refuse
/// again (the ledger has another worker for the session; the pay would overflow) must not be
/// submitted first every round: the credits after it would wait on its nonce gap for good.
/// Each is passed over for `SKIP_ROUNDS` rounds, or until its count changes (then it is a
/// new receipt); a refusal for a passing cause costs that session a delay, never its pay,
/// since counts are cumulative.
#[derive(Default)]
struct Refusals {
    /// The count refused and the round it may be submitted again.
    refused: HashMap<MeterOf, (u64, u64)>,
}

impl Refusals {
    fn passes_over(&self, meter: &MeterOf, count: u64, round: u64) -> bool {
        self.refused
            .get(meter)
            .is_some_and(|&(refused, until)| refused == count && round < until)
    }

    fn refused(&mut self, meter: MeterOf, count: u64, round: u64) {
        if self.refused.len() >= MAX_REFUSED {
            self.refused.retain(|_, (_, until)| round < *until);
        }
        if self.refused.len() >= MAX_REFUSED {
            self.refused.clear();
        }
        self.refused.insert(meter, (count, round + SKIP_ROUNDS));
    }
}

/// Holds back a credit whose pay would not cover its fee: the ledger would take all of it as
/// the fee (and none for bytes worth nothing). It waits instead, counts being cumulative,
/// until its session has relayed enough more to pay for it; a session that never does leaves
/// a tail worth less than a credit's fee. Prices are read once a round: the pool's rate, and
/// each order's placement of the worker (none: the credit pays nothing and costs nothing,
/// and is sent, so that the bytes it counts are not paid later at another price).
struct FeeCover<'a> {
    ledger: &'a Client,
    unit_bytes: u64,
    pool_rate: Amount,
    /// A credit's fee in base units (every credit of a chain has the same size).
    fee: u64,
    placed: HashMap<(u64, Address), Option<Amount>>,
}

impl<'a> FeeCover<'a> {
    fn new(ledger: &'a Client, fees: &FeesView, draft: &SignedTx) -> Result<FeeCover<'a>> {
        let params = ledger.params()?;
        let bytes = draft.to_bytes().len() as u64;
        Ok(FeeCover {
            ledger,
            unit_bytes: params.unit_bytes.max(1),
            pool_rate: params.reward_per_unit.base_units,
            fee: fees.lane_fee.base_units.base_units().saturating_mul(bytes),
            placed: HashMap::new(),
        })
    }

    /// Whether `receipt`'s bytes above `mark` pay at least a credit's fee (and something).
    fn covers(&mut self, receipt: &kvasir_ledger::Receipt, mark: u64) -> Result<bool> {
        let price = if receipt.order == 0 {
            Some(self.pool_rate)
        } else {
            let key = (receipt.order, receipt.worker);
            if !self.placed.contains_key(&key) {
                let placements = self.ledger.order_placements(receipt.order, false)?;
                let price = placements
                    .iter()
                    .find(|p| p.operator == receipt.worker)
                    .map(|p| p.price.base_units);
                self.placed.insert(key, price);
            }
            self.placed[&key]
        };
        let Some(price) = price else {
            return Ok(true);
        };
        let earned = |bytes: u64| {
            u128::from(bytes) * u128::from(price.base_units()) / u128::from(self.unit_bytes)
        };
        let pay = earned(receipt.cumulative_bytes).saturating_sub(earned(mark));
        Ok(pay > 0 && pay >= u128::from(self.fee))
    }
}

pub struct Crediting {
    ledger: Client,
    registry: Client,
    key: Keypair,
    stats: Arc<Stats>,
    /// Where the next round's change listing starts; `None`: walk every session by id.
    mark: Option<u64>,
    rounds: u64,
    /// Rounds tried, complete or not.
    attempts: u64,
    refusals: Refusals,
    held: Held,
}

/// What one round did.
pub struct Round {
    /// Credits the ledger admitted.
    pub admitted: usize,
    /// Bytes above the ledger's marks when the round read them.
    pub uncredited_bytes: u64,
    /// Whether the ledger admitted every credit the round made (and so the last committed
    /// all of them).
    pub all_admitted: bool,
}

/// Which listing a round walks.
#[derive(Clone, Copy)]
enum Cursor {
    /// Every session, by id, above this one.
    Ids(u64),
    /// Only the sessions whose count rose after this mark.
    Changes(u64),
}

impl Crediting {
    pub fn new(ledger: Client, registry: Client, key: Keypair, stats: Arc<Stats>) -> Crediting {
        Crediting {
            ledger,
            registry,
            key,
            stats,
            mark: None,
            rounds: 0,
            attempts: 0,
            refusals: Refusals::default(),
            held: Held::default(),
        }
    }

    /// One pass over the registry, page by page: credits every session that rose. The first
    /// round, and every `FULL_WALK_EVERY`th, walks every session by id; the others list only
    /// the sessions whose count rose since the last complete round (the hub signs and the
    /// gateway checks only those). A malformed receipt is logged and skipped, not a stall, and
    /// one the ledger refused as invalid is passed over for a while (`Refusals`).
    pub fn round(&mut self) -> Result<Round> {
        self.attempts += 1;
        let mut cursor = match self.mark {
            Some(mark) if !self.rounds.is_multiple_of(FULL_WALK_EVERY) => Cursor::Changes(mark),
            _ => Cursor::Ids(0),
        };
        // Every credit admitted: only then may the mark move past what this round listed.
        let mut all_admitted = true;
        let chain_id = self.ledger.head()?.chain_id;
        // Credits travel in the reserved lane, whose price does not move: one quote serves
        // the round. Each pays its fee out of the pay it brings.
        let fees = self.ledger.fees()?;
        let fee = fees.bid(Lane::Reserved, Amount::ZERO);
        let mut cover: Option<FeeCover> = None;
        let mut nonce = self.ledger.account(&self.key.address())?.nonce;
        let mut admitted = 0;
        let mut uncredited_bytes = 0u64;
        let mut last = None;
        // Where the next change listing starts: for a walk by id, the mark its first page
        // was read at (whatever rose during the walk is after it); else the last page's.
        let mut next_mark = None;
        loop {
            let listing = match cursor {
                Cursor::Ids(after) => self.registry.receipts(after, PAGE_MAX),
                Cursor::Changes(since) => self.registry.receipts_since(since, PAGE_MAX),
            }
            .context("reading the hub registry")?;
            next_mark = match (cursor, listing.mark) {
                // A registry that serves no marks (an older hub) is walked by id every round.
                (_, None) => None,
                (Cursor::Ids(_), Some(mark)) => next_mark.or(Some(mark)),
                // Marks only move forward; a registry whose changes went back (its data was
                // lost or restored) is walked by id next round.
                (Cursor::Changes(since), Some(mark)) if mark < since => {
                    tracing::warn!("the registry's changes went back from {since} to {mark}");
                    self.mark = None;
                    return Err(anyhow::anyhow!("the registry's change marks went back"));
                }
                (Cursor::Changes(_), Some(mark)) => Some(mark),
            };
            let credited = match cursor {
                Cursor::Ids(after) => {
                    let end = listing.receipts.last().map_or(after, |r| r.session_id);
                    self.credited(&listing.hub, after, end)?
                }
                Cursor::Changes(_) => self.marks_of(&listing.hub, &listing.receipts)?,
            };
            let mut rose = Vec::new();
            for receipt in &listing.receipts {
                let mark = credited.get(&receipt.session_id).copied().unwrap_or(0);
                if receipt.cumulative_bytes <= mark {
                    continue;
                }
                match receipt.signed_receipt() {
                    Ok(signed) => {
                        let above = receipt.cumulative_bytes - mark;
                        uncredited_bytes = uncredited_bytes.saturating_add(above);
                        let count = signed.receipt.cumulative_bytes;
                        let cover = match &mut cover {
                            Some(cover) => cover,
                            None => {
                                let draft = TxKind::Credit(signed.clone())
                                    .signed_paying(&chain_id, fee, &self.key, 0);
                                cover.insert(FeeCover::new(&self.ledger, &fees, &draft)?)
                            }
                        };
                        let passed_over =
                            self.refusals
                                .passes_over(&meter_of(&signed), count, self.attempts);
                        let meter = meter_of(&signed);
                        let worth_it = cover.covers(&signed.receipt, mark)?
                            || self.held.waited(meter, count, self.attempts);
                        if !passed_over && worth_it {
                            rose.push(signed)
                        }
                    }
                    Err(e) => tracing::warn!(
                        "skipping session {}: the registry served a malformed receipt: {e}",
                        receipt.session_id
                    ),
                }
            }
            let meters: Vec<(MeterOf, u64)> = rose
                .iter()
                .map(|signed| (meter_of(signed), signed.receipt.cumulative_bytes))
                .collect();
            // Signing is most of the gateway's work per credit: both cores share it.
            let credits: Vec<_> = rose
                .into_par_iter()
                .enumerate()
                .map(|(i, signed)| {
                    let nonce = nonce + i as u64;
                    TxKind::Credit(signed).signed_paying(&chain_id, fee, &self.key, nonce)
                })
                .collect();
            nonce += credits.len() as u64;
            for (at, batch) in credits.chunks(BATCH).enumerate() {
                let verdicts = self.ledger.submit_batch(batch)?;
                for (i, verdict) in verdicts.into_iter().enumerate() {
                    match verdict {
                        Ok(hash) => {
                            admitted += 1;
                            self.stats.admitted(1);
                            last = Some(hash);
                        }
                        // A later nonce now waits on a gap; the ledger drops it in production
                        // and the next round submits afresh from the recorded counts, which
                        // a mark past this session would skip.
                        Err(refused) => {
                            all_admitted = false;
                            tracing::info!("credit not admitted: {}", refused.message);
                            if let Some((meter, count)) = meters.get(at * BATCH + i) {
                                if refused.error == "invalid_tx" {
                                    self.refusals.refused(*meter, *count, self.attempts);
                                }
                            }
                        }
                    }
                }
            }
            // A cursor must move forward: a registry that says otherwise ends the round.
            cursor = match (cursor, listing.next_after, listing.next_since) {
                (Cursor::Ids(after), Some(next), _) if next > after => Cursor::Ids(next),
                (Cursor::Changes(since), _, Some(next)) if next > since => Cursor::Changes(next),
                (_, None, None) => break,
                _ => {
                    tracing::warn!("the registry's next page does not move forward");
                    break;
                }
            };
        }
        // The gateway's credits commit in nonce order: the last one committed, all did.
        if let Some(hash) = last {
            self.ledger.wait_committed(&hash, COMMIT_WAIT)?;
        }
        // Only a round that got this far with every credit admitted moves the mark (and
        // counts towards the next full walk): anything else is listed again.
        if all_admitted {
            self.mark = next_mark;
            self.rounds += 1;
        }
        Ok(Round {
            admitted,
            uncredited_bytes,
            all_admitted,
        })
    }

    /// The ledger's marks of the sessions a change listing holds: asked one by one (on the
    /// client's pooled connections, both cores at a time) when the listing is short, as it
    /// is between busy rounds; else by pages over the ids it spans.
    fn marks_of(&self, hub: &Address, receipts: &[ReceiptEntry]) -> Result<HashMap<u64, u64>> {
        let ids = receipts.iter().map(|r| r.session_id);
        let (Some(lowest), Some(highest)) = (ids.clone().min(), ids.max()) else {
            return Ok(HashMap::new());
        };
        if receipts.len() > ONE_BY_ONE {
            return self.credited(hub, lowest.saturating_sub(1), highest);
        }
        receipts
            .par_iter()
            .map(|r| {
                let mark = self.ledger.session(hub, r.session_id, r.order)?;
                Ok((r.session_id, mark.cumulative_bytes))
            })
            .collect()
    }

    /// The ledger's marks of `hub`'s sessions with ids in `(after, end]`.
    fn credited(&self, hub: &Address, after: u64, end: u64) -> Result<HashMap<u64, u64>> {
        let mut marks = HashMap::new();
        let mut from = after;
        loop {
            let page = self.ledger.sessions(hub, from, PAGE_MAX)?;
            marks.extend(
                page.sessions
                    .iter()
                    .filter(|m| m.session_id <= end)
                    .map(|m| (m.session_id, m.cumulative_bytes)),
            );
            match page.next_after {
                Some(next) if next < end && next > from => from = next,
                _ => return Ok(marks),
            }
        }
    }

    /// Rounds `interval` apart until `stop` is set.
    pub fn run(mut self, interval: Duration, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match self.round() {
                Ok(round) => {
                    if round.admitted > 0 {
                        tracing::info!("{} credits committed", round.admitted);
                    }
                    self.stats.round(round.uncredited_bytes, round.all_admitted);
                }
                Err(e) => {
                    self.stats.failed_round();
                    tracing::warn!("crediting: {e:#}")
                }
            }
            std::thread::sleep(interval);
        }
    }
}

fn meter_of(signed: &SignedReceipt) -> MeterOf {
    let r = &signed.receipt;
    (r.hub, r.session_id, r.order)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused receipt is passed over at its count for `SKIP_ROUNDS` rounds, not at
    /// another count, and not after; the memory stays bounded.
    #[test]
    fn a_refused_receipt_is_passed_over_for_a_while_at_its_count() {
        let hub = Keypair::from_seed(&[1; 32]).address();
        let mut refusals = Refusals::default();
        let meter = (hub, 7, 0);
        refusals.refused(meter, 100, 3);
        assert!(refusals.passes_over(&meter, 100, 3));
        assert!(refusals.passes_over(&meter, 100, 3 + SKIP_ROUNDS - 1));
        assert!(
            !refusals.passes_over(&meter, 100, 3 + SKIP_ROUNDS),
            "tried again"
        );
        assert!(
            !refusals.passes_over(&meter, 101, 4),
            "a new count is a new receipt"
        );
        assert!(
            !refusals.passes_over(&(hub, 7, 1), 100, 4),
            "another order's count"
        );
        assert!(
            !refusals.passes_over(&(hub, 8, 0), 100, 4),
            "another session"
        );
        for session in 0..(MAX_REFUSED as u64 * 2) {
            refusals.refused((hub, session, 0), 1, 10);
        }
        assert!(refusals.refused.len() <= MAX_REFUSED);
    }

    /// A receipt too small for its fee waits while its count moves, and is credited once it
    /// has stayed at one count for `HOLD_ROUNDS`; the list of them stays bounded.
    #[test]
    fn a_receipt_too_small_for_its_fee_waits_until_its_session_goes_quiet() {
        let hub = Keypair::from_seed(&[1; 32]).address();
        let mut held = Held::default();
        let meter = (hub, 7, 0);
        assert!(!held.waited(meter, 100, 1));
        assert!(!held.waited(meter, 120, 5), "it moved: held afresh");
        assert!(!held.waited(meter, 120, 5 + HOLD_ROUNDS - 1));
        assert!(
            held.waited(meter, 120, 5 + HOLD_ROUNDS),
            "quiet long enough"
        );
        assert!(!held.waited(meter, 130, 100), "a new count waits again");
        for session in 0..(MAX_REFUSED as u64 * 2) {
            held.waited((hub, session, 0), 1, 200);
        }
        assert!(held.held.len() <= MAX_REFUSED);
    }
}
