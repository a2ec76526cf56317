//! The gateway's crediting: it polls the hub's registry and, for every session whose signed
//! cumulative count is above what the ledger has recorded, submits a Credit transaction
//! carrying the hub's receipt. Exactly once by construction: the ledger pays
//! `earned(new) - earned(recorded)` and refuses counts that do not rise, so a receipt
//! submitted twice (after a crash, say) pays once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use kvasir_api::Client;
use kvasir_ledger::{Keypair, TxKind};
use rayon::prelude::*;

/// How long a round waits for its credits to commit before polling again.
const COMMIT_WAIT: Duration = Duration::from_secs(30);
/// Credits per submission (the ledger API's batch limit).
const BATCH: usize = 10_000;

pub struct Crediting {
    pub ledger: Client,
    pub registry: Client,
    pub key: Keypair,
}

impl Crediting {
    /// One pass: credits every session that rose; how many credits were admitted.
    pub fn round(&self) -> Result<usize> {
        let listing = self
            .registry
            .receipts()
            .context("reading the hub registry")?;
        let chain_id = self.ledger.head()?.chain_id;
        let nonce = self.ledger.account(&self.key.address())?.nonce;
        let credited: HashMap<u64, u64> = self
            .ledger
            .sessions(&listing.hub)?
            .sessions
            .into_iter()
            .map(|mark| (mark.session_id, mark.cumulative_bytes))
            .collect();
        let mut rose = Vec::new();
        for receipt in &listing.receipts {
            if receipt.cumulative_bytes <= credited.get(&receipt.session_id).copied().unwrap_or(0) {
                continue;
            }
            let signed = receipt
                .signed_receipt()
                .context("the registry served a malformed receipt")?;
            rose.push(signed);
        }
        // Signing is most of the gateway's work per credit: both cores share it.
        let credits: Vec<_> = rose
            .into_par_iter()
            .enumerate()
            .map(|(i, signed)| {
                TxKind::Credit(signed).signed(&chain_id, &self.key, nonce + i as u64)
            })
            .collect();
        let mut admitted = 0;
        let mut last = None;
        for batch in credits.chunks(BATCH) {
            for verdict in self.ledger.submit_batch(batch)? {
                match verdict {
                    Ok(hash) => {
                        admitted += 1;
                        last = Some(hash);
                    }
                    // A later nonce now waits on a gap; the ledger drops it in production and
                    // the next round submits afresh from the recorded counts.
                    Err(refused) => tracing::info!("credit not admitted: {}", refused.message),
                }
            }
        }
        // The gateway's credits commit in nonce order: the last one committed, all did.
        if let Some(hash) = last {
            self.ledger.wait_committed(&hash, COMMIT_WAIT)?;
        }
        Ok(admitted)
    }

    /// Rounds `interval` apart until `stop` is set.
    pub fn run(self, interval: Duration, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match self.round() {
                Ok(0) => {}
                Ok(n) => tracing::info!("{n} credits committed"),
                Err(e) => tracing::warn!("crediting: {e:#}"),
            }
            std::thread::sleep(interval);
        }
    }
}
