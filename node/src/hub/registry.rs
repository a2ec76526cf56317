//! The hub's contribution registry: per session, the worker it belongs to and the cumulative
//! bytes of well-formed dispatch traffic it moved. Kept in sled so counts survive a restart;
//! session ids come from sled's persistent id generator, so they are never reused.
//!
//! A record that does not decode is an error naming its session, and is left as found: a
//! count the hub has signed receipts for is never silently dropped or reset.

use std::path::Path;

use anyhow::{Context, Result};
use borsh::{BorshDeserialize, BorshSerialize};
use kvasir_ledger::keys::Address;

#[derive(Clone, Copy, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct SessionRecord {
    pub worker: Address,
    pub cumulative_bytes: u64,
}

pub struct Registry {
    db: sled::Db,
}

/// A registry record that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("the registry record of session {session} is corrupt ({reason}); left as found")]
    Corrupt { session: u64, reason: String },
    #[error("the registry has no record of session {0}")]
    Missing(u64),
}

fn decode(session: u64, bytes: &[u8]) -> Result<SessionRecord, RecordError> {
    SessionRecord::try_from_slice(bytes).map_err(|e| RecordError::Corrupt {
        session,
        reason: e.to_string(),
    })
}

impl Registry {
    pub fn open(dir: &Path) -> Result<Registry> {
        let db = sled::open(dir)
            .with_context(|| format!("opening the registry in {}", dir.display()))?;
        Ok(Registry { db })
    }

    /// A new session for `worker`, with nothing metered yet.
    pub fn open_session(&self, worker: Address) -> Result<u64> {
        // Ids start at 1: 0 is the backbone's session in `Welcome`.
        let session = self.db.generate_id()? + 1;
        let record = SessionRecord {
            worker,
            cumulative_bytes: 0,
        };
        self.db
            .insert(session.to_be_bytes(), borsh::to_vec(&record)?)?;
        Ok(session)
    }

    /// Adds `bytes` to `session`'s count and returns the new cumulative count. A missing or
    /// corrupt record is an error and stays as it is.
    pub fn meter(&self, session: u64, bytes: u64) -> Result<u64> {
        let mut outcome = Ok(0);
        // The closure may run again if the record changed meanwhile; the last run decides.
        self.db.update_and_fetch(session.to_be_bytes(), |old| {
            outcome = Err(RecordError::Missing(session).into());
            let old = old?;
            let updated =
                decode(session, old)
                    .map_err(anyhow::Error::from)
                    .and_then(|mut record| {
                        record.cumulative_bytes = record.cumulative_bytes.saturating_add(bytes);
                        Ok((record.cumulative_bytes, borsh::to_vec(&record)?))
                    });
            let (result, value) = match updated {
                Ok((total, value)) => (Ok(total), value),
                Err(e) => (Err(e), old.to_vec()),
            };
            outcome = result;
            Some(value)
        })?;
        outcome
    }

    /// Every session, in id order, after making the counts durable: a receipt served from
    /// here never claims more than a restarted hub remembers.
    pub fn sessions(&self) -> Result<Vec<(u64, SessionRecord)>> {
        self.db.flush()?;
        self.db
            .iter()
            .map(|entry| {
                let (key, value) = entry?;
                let id: [u8; 8] = key.as_ref().try_into().context("registry key")?;
                let session = u64::from_be_bytes(id);
                Ok((session, decode(session, &value)?))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::keys::Keypair;

    #[test]
    fn counts_and_session_ids_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[5; 32]).address();
        let first = {
            let registry = Registry::open(dir.path()).unwrap();
            let session = registry.open_session(worker).unwrap();
            assert_eq!(registry.meter(session, 100).unwrap(), 100);
            assert_eq!(registry.meter(session, 23).unwrap(), 123);
            registry.sessions().unwrap();
            session
        };
        let registry = Registry::open(dir.path()).unwrap();
        assert_eq!(
            registry.sessions().unwrap(),
            vec![(
                first,
                SessionRecord {
                    worker,
                    cumulative_bytes: 123
                }
            )]
        );
        assert!(registry.open_session(worker).unwrap() > first);
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_its_session_and_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[6; 32]).address();
        let (good, bad) = {
            let registry = Registry::open(dir.path()).unwrap();
            let good = registry.open_session(worker).unwrap();
            let bad = registry.open_session(worker).unwrap();
            registry.meter(bad, 10).unwrap();
            registry.sessions().unwrap();
            (good, bad)
        };
        {
            let db = sled::open(dir.path()).unwrap();
            db.insert(bad.to_be_bytes(), &b"garbage"[..]).unwrap();
            db.flush().unwrap();
        }
        let registry = Registry::open(dir.path()).unwrap();
        let named = format!("session {bad} is corrupt");
        let metering = registry.meter(bad, 5).unwrap_err().to_string();
        assert!(metering.contains(&named), "{metering}");
        let listing = format!("{:#}", registry.sessions().unwrap_err());
        assert!(listing.contains(&named), "{listing}");
        // Nothing was deleted: the bytes are as found, the other session still meters.
        assert_eq!(
            registry.db.get(bad.to_be_bytes()).unwrap().as_deref(),
            Some(&b"garbage"[..])
        );
        assert_eq!(registry.meter(good, 7).unwrap(), 7);
        let missing = registry.meter(bad + 100, 1).unwrap_err().to_string();
        assert!(missing.contains(&format!("no record of session {}", bad + 100)));
    }
}
