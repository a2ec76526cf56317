//! The hub's contribution registry: per session, the worker it belongs to and the cumulative
//! bytes of well-formed dispatch traffic it moved. Kept in sled so counts survive a restart;
//! session ids come from sled's persistent id generator, so they are never reused.

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

    /// Adds `bytes` to `session`'s count and returns the new cumulative count.
    pub fn meter(&self, session: u64, bytes: u64) -> Result<u64> {
        let mut total = 0;
        self.db.update_and_fetch(session.to_be_bytes(), |old| {
            let mut record = SessionRecord::try_from_slice(old?).ok()?;
            record.cumulative_bytes = record.cumulative_bytes.saturating_add(bytes);
            total = record.cumulative_bytes;
            borsh::to_vec(&record).ok()
        })?;
        Ok(total)
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
                Ok((
                    u64::from_be_bytes(id),
                    SessionRecord::try_from_slice(&value)?,
                ))
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
}
