//! The gateway's crediting: it polls the hub's registry and, for every session whose signed
//! cumulative count is above what the ledger has recorded, submits a Credit transaction
//! carrying the hub's receipt. Exactly once by construction: the ledger pays
//! `earned(new) - earned(recorded)` and refuses counts that do not rise, so a receipt
//! submitted twice (after a crash, say) pays once.

use std::time::Duration;

use anyhow::{Context, Result};
use borsh::BorshDeserialize;
use kvasir_ledger::{Keypair, SignedReceipt, TxKind};
use kvasir_wallet::client::{Client, ClientError};

/// How long a round waits for its credits to commit before polling again.
const COMMIT_WAIT: Duration = Duration::from_secs(30);

pub struct Crediting {
    pub ledger: Client,
    pub registry: Client,
    pub key: Keypair,
}

impl Crediting {
    /// One pass: credits every session that rose; how many credits committed.
    pub fn round(&self) -> Result<usize> {
        let listing = self
            .registry
            .get("/receipts")
            .context("reading the hub registry")?;
        let hub = listing["hub"].as_str().context("registry names no hub")?;
        let receipts = listing["receipts"]
            .as_array()
            .context("registry lists no receipts")?;
        let head = self.ledger.get("/head")?;
        let chain_id = head["chain_id"].as_str().context("ledger names no chain")?;
        let me = self
            .ledger
            .get(&format!("/accounts/{}", self.key.address()))?;
        let mut nonce = me["nonce"].as_u64().context("ledger gave no nonce")?;
        let mut submitted = Vec::new();
        for receipt in receipts {
            let session = receipt["session_id"]
                .as_u64()
                .context("receipt without session")?;
            let bytes = receipt["cumulative_bytes"]
                .as_u64()
                .context("receipt without count")?;
            let mark = self.ledger.get(&format!("/sessions/{hub}/{session}"))?;
            if bytes <= mark["cumulative_bytes"].as_u64().unwrap_or(0) {
                continue;
            }
            let signed = hex::decode(receipt["signed"].as_str().unwrap_or_default())
                .ok()
                .and_then(|b| SignedReceipt::try_from_slice(&b).ok())
                .context("the registry served a malformed receipt")?;
            let tx = TxKind::Credit(signed).signed(chain_id, &self.key, nonce);
            match self.ledger.submit(&tx) {
                Ok(hash) => {
                    submitted.push(hash);
                    nonce += 1;
                }
                // Refused now (stale count, a predecessor still pending): next round.
                Err(ClientError::Api { message, .. }) => {
                    tracing::info!(session, "credit not admitted: {message}");
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut committed = 0;
        for hash in submitted {
            match self.ledger.wait_committed(&hash, COMMIT_WAIT) {
                Ok(_) => committed += 1,
                Err(e) => tracing::warn!("credit {hash}: {e}"),
            }
        }
        Ok(committed)
    }

    /// Rounds forever, `interval` apart.
    pub fn run(self, interval: Duration) {
        loop {
            match self.round() {
                Ok(0) => {}
                Ok(n) => tracing::info!("{n} credits committed"),
                Err(e) => tracing::warn!("crediting: {e:#}"),
            }
            std::thread::sleep(interval);
        }
    }
}
