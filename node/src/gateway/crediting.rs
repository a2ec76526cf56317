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
use kvasir_api::ledger::PAGE_MAX;
use kvasir_api::Client;
use kvasir_ledger::{Address, Keypair, TxKind};
use rayon::prelude::*;

use super::stats::Stats;

/// How long a round waits for its credits to commit before polling again.
const COMMIT_WAIT: Duration = Duration::from_secs(30);
/// Credits per submission (the ledger API's batch limit).
const BATCH: usize = 10_000;

pub struct Crediting {
    pub ledger: Client,
    pub registry: Client,
    pub key: Keypair,
    pub stats: Arc<Stats>,
}

/// What one round did.
pub struct Round {
    /// Credits the ledger admitted.
    pub admitted: usize,
    /// Bytes above the ledger's marks when the round read them.
    pub uncredited_bytes: u64,
}

impl Crediting {
    /// One pass over the registry, page by page: credits every session that rose. A
    /// malformed receipt is logged and skipped, not a stall.
    pub fn round(&self) -> Result<Round> {
        let chain_id = self.ledger.head()?.chain_id;
        let mut nonce = self.ledger.account(&self.key.address())?.nonce;
        let mut admitted = 0;
        let mut uncredited_bytes = 0u64;
        let mut last = None;
        let mut after = 0;
        loop {
            let listing = self
                .registry
                .receipts(after, PAGE_MAX)
                .context("reading the hub registry")?;
            let Some(end) = listing.receipts.last().map(|r| r.session_id) else {
                break;
            };
            let credited = self.credited(&listing.hub, after, end)?;
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
                        rose.push(signed)
                    }
                    Err(e) => tracing::warn!(
                        "skipping session {}: the registry served a malformed receipt: {e}",
                        receipt.session_id
                    ),
                }
            }
            // Signing is most of the gateway's work per credit: both cores share it.
            let credits: Vec<_> = rose
                .into_par_iter()
                .enumerate()
                .map(|(i, signed)| {
                    TxKind::Credit(signed).signed(&chain_id, &self.key, nonce + i as u64)
                })
                .collect();
            nonce += credits.len() as u64;
            for batch in credits.chunks(BATCH) {
                for verdict in self.ledger.submit_batch(batch)? {
                    match verdict {
                        Ok(hash) => {
                            admitted += 1;
                            last = Some(hash);
                        }
                        // A later nonce now waits on a gap; the ledger drops it in production
                        // and the next round submits afresh from the recorded counts.
                        Err(refused) => {
                            tracing::info!("credit not admitted: {}", refused.message)
                        }
                    }
                }
            }
            match listing.next_after {
                // A cursor must move forward: a registry that says otherwise ends the round.
                Some(next) if next > after => after = next,
                Some(next) => {
                    tracing::warn!("the registry's next page starts at {next}, not after {after}");
                    break;
                }
                None => break,
            }
        }
        // The gateway's credits commit in nonce order: the last one committed, all did.
        if let Some(hash) = last {
            self.ledger.wait_committed(&hash, COMMIT_WAIT)?;
        }
        Ok(Round {
            admitted,
            uncredited_bytes,
        })
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
    pub fn run(self, interval: Duration, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match self.round() {
                Ok(round) => {
                    if round.admitted > 0 {
                        tracing::info!("{} credits committed", round.admitted);
                    }
                    self.stats.round(round.admitted, round.uncredited_bytes);
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
