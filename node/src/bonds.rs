//! Whether a worker's key may serve now, as the ledger says: bonded at least the chain's
//! `min_bond` and not jailed. The hub asks at every hello (and refuses with the reason, which
//! the worker logs) and again every few seconds for every connected key (dropping, with the
//! reason, the sessions of one that no longer may: `hub::standing`); the backbone asks before
//! it first dispatches to a session. A chain without bonds (`min_bond` zero) admits every
//! key; a key whose standing cannot be read (the ledger unreachable) is not admitted, so an
//! outage never lets an unbonded key in.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvasir_api::{Client, ClientError};
use kvasir_ledger::{Address, Amount};

/// Reads standings from one ledger.
pub struct BondCheck {
    ledger: Client,
    min_bond: Amount,
}

/// A key's standing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{key} has {bonded} bonded, this chain asks at least {min_bond} (kvasir-wallet bond AMOUNT)")]
    Unbonded {
        key: Address,
        bonded: Amount,
        min_bond: Amount,
    },
    #[error("{key} is jailed until height {until} for a wrong answer")]
    Jailed { key: Address, until: u64 },
    #[error("the ledger could not say whether {key} is bonded: {reason}")]
    Unknown { key: Address, reason: String },
}

/// How long a role starting up waits for its ledger to answer: roles start in any order, and
/// a ledger may be restarting.
const LEDGER_WAIT: Duration = Duration::from_secs(30);

impl BondCheck {
    /// Checks against the ledger at `url`, whose bond parameters are read now (waiting up to
    /// `LEDGER_WAIT` for one that cannot be reached yet).
    pub fn new(url: &str) -> Result<BondCheck> {
        let ledger = Client::new(url);
        let deadline = Instant::now() + LEDGER_WAIT;
        let params = loop {
            match ledger.params() {
                Ok(params) => break params,
                // Only a ledger not (yet) listening is waited for; any other answer is final.
                Err(e @ ClientError::Unreachable { .. }) if Instant::now() < deadline => {
                    tracing::warn!("waiting for the ledger at {url}: {e}");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("reading the chain's bond parameters from {url}"))
                }
            }
        };
        Ok(BondCheck {
            ledger,
            min_bond: params.min_bond.base_units,
        })
    }

    /// Whether `key` may serve now. Blocking (one HTTP request).
    pub fn standing(&self, key: &Address) -> Result<(), Refused> {
        if self.min_bond.is_zero() {
            return Ok(());
        }
        let account = self.ledger.account(key).map_err(|e| Refused::Unknown {
            key: *key,
            reason: e.to_string(),
        })?;
        if account.jailed {
            return Err(Refused::Jailed {
                key: *key,
                until: account.jailed_until,
            });
        }
        let bonded = account.bonded.base_units;
        if bonded < self.min_bond {
            return Err(Refused::Unbonded {
                key: *key,
                bonded,
                min_bond: self.min_bond,
            });
        }
        Ok(())
    }
}
