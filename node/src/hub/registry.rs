//! The hub's contribution registry: per session, the worker it belongs to and the cumulative
//! bytes of well-formed dispatch traffic it moved. Kept in sled so counts survive a restart.
//! Session ids are a random base, drawn when the registry is created, plus sled's persistent
//! id counter: never reused while the data directory lives, and not reused in practice after
//! it is lost either (a new base is drawn), so a new session cannot collide with the ledger's
//! marks of an old one.
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
    /// Added to every session id (see the module comment).
    id_base: u64,
}

/// One page of the listing, in session-id order.
pub struct Page {
    /// Sessions after the cursor that metered something; a record that cannot be read is
    /// its error instead, so that one bad record cannot hide the others.
    pub sessions: Vec<(u64, Result<SessionRecord, RecordError>)>,
    /// Where the next page starts, if there may be more.
    pub next_after: Option<u64>,
}

const ID_BASE: &[u8] = b"id_base";

/// A registry record that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("the registry record of session {session} is corrupt ({reason}); left as found")]
    Corrupt { session: u64, reason: String },
    #[error("the registry record of session {0} belongs to another worker")]
    OtherWorker(u64),
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
        let meta = db.open_tree("meta")?;
        let id_base = match meta.get(ID_BASE)? {
            Some(bytes) => u64::from_be_bytes(
                bytes
                    .as_ref()
                    .try_into()
                    .context("the registry's id base is not 8 bytes")?,
            ),
            None => {
                // A registry written before the base existed keeps its ids (base 0); a new one
                // draws a base far from any other registry's ids (2^62 of room above it).
                let base = if db.is_empty() {
                    rand::random::<u64>() >> 2
                } else {
                    0
                };
                meta.insert(ID_BASE, &base.to_be_bytes())?;
                meta.flush()?;
                base
            }
        };
        Ok(Registry { db, id_base })
    }

    /// A new session id. Nothing is written for it until it meters a byte, so connections
    /// that never work cost the registry nothing.
    pub fn new_session(&self) -> Result<u64> {
        // Ids start above 0: 0 is the backbone's session in `Welcome`.
        let session = self
            .id_base
            .checked_add(self.db.generate_id()?)
            .and_then(|id| id.checked_add(1))
            .context("session ids are exhausted")?;
        Ok(session)
    }

    /// Adds `bytes` to the count of `session` of `worker` (its record made on the first
    /// bytes) and returns the new cumulative count. A corrupt record, or one of another
    /// worker, is an error and stays as it is.
    pub fn meter(&self, session: u64, worker: Address, bytes: u64) -> Result<u64> {
        let mut outcome = Ok(0);
        // The closure may run again if the record changed meanwhile; the last run decides.
        self.db.update_and_fetch(session.to_be_bytes(), |old| {
            let Some(old) = old else {
                outcome = Ok(bytes);
                let record = SessionRecord {
                    worker,
                    cumulative_bytes: bytes,
                };
                return borsh::to_vec(&record).ok();
            };
            let updated = decode(session, old)
                .and_then(|record| match record.worker == worker {
                    true => Ok(record),
                    false => Err(RecordError::OtherWorker(session)),
                })
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

    /// Up to `limit` sessions with an id above `after` that metered something, in id order,
    /// after making the counts durable: a receipt served from here never claims more than a
    /// restarted hub remembers. Sessions that never relayed a useful byte are not listed, so
    /// connecting without working costs the listing nothing.
    pub fn page(&self, after: u64, limit: usize) -> Result<Page> {
        self.db.flush()?;
        let mut sessions = Vec::new();
        let Some(start) = after.checked_add(1) else {
            return Ok(Page {
                sessions,
                next_after: None,
            });
        };
        for entry in self.db.range(start.to_be_bytes()..) {
            if sessions.len() == limit {
                let next_after = sessions.last().map(|(id, _)| *id);
                return Ok(Page {
                    sessions,
                    next_after,
                });
            }
            let (key, value) = entry?;
            let id: [u8; 8] = key.as_ref().try_into().context("registry key")?;
            let session = u64::from_be_bytes(id);
            match decode(session, &value) {
                Ok(record) if record.cumulative_bytes == 0 => {}
                record => sessions.push((session, record)),
            }
        }
        Ok(Page {
            sessions,
            next_after: None,
        })
    }

    /// Every session that metered something, failing on the first unreadable record.
    #[cfg(test)]
    pub fn sessions(&self) -> Result<Vec<(u64, SessionRecord)>> {
        self.page(0, usize::MAX)?
            .sessions
            .into_iter()
            .map(|(id, record)| Ok((id, record?)))
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
            let session = registry.new_session().unwrap();
            assert_eq!(registry.meter(session, worker, 100).unwrap(), 100);
            assert_eq!(registry.meter(session, worker, 23).unwrap(), 123);
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
        assert!(registry.new_session().unwrap() > first);
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_its_session_and_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[6; 32]).address();
        let (good, bad) = {
            let registry = Registry::open(dir.path()).unwrap();
            let good = registry.new_session().unwrap();
            let bad = registry.new_session().unwrap();
            registry.meter(bad, worker, 10).unwrap();
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
        let metering = registry.meter(bad, worker, 5).unwrap_err().to_string();
        assert!(metering.contains(&named), "{metering}");
        let listing = format!("{:#}", registry.sessions().unwrap_err());
        assert!(listing.contains(&named), "{listing}");
        // Nothing was deleted: the bytes are as found, the other session still meters.
        assert_eq!(
            registry.db.get(bad.to_be_bytes()).unwrap().as_deref(),
            Some(&b"garbage"[..])
        );
        assert_eq!(registry.meter(good, worker, 7).unwrap(), 7);
        // A session's record is made by its first bytes, and stays its worker's.
        assert_eq!(registry.meter(bad + 100, worker, 1).unwrap(), 1);
        let stranger = Keypair::from_seed(&[10; 32]).address();
        let taken = registry
            .meter(bad + 100, stranger, 1)
            .unwrap_err()
            .to_string();
        assert!(taken.contains("another worker"), "{taken}");
    }

    #[test]
    fn the_listing_pages_by_cursor_and_leaves_out_sessions_that_did_no_work() {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::open(dir.path()).unwrap();
        let worker = Keypair::from_seed(&[7; 32]).address();
        let mut working = Vec::new();
        for i in 0..10 {
            let session = registry.new_session().unwrap();
            if i % 2 == 0 {
                registry.meter(session, worker, 1 + i).unwrap();
                working.push(session);
            }
        }
        let mut listed = Vec::new();
        let mut after = 0;
        loop {
            let page = registry.page(after, 2).unwrap();
            assert!(page.sessions.len() <= 2);
            listed.extend(page.sessions.iter().map(|(id, r)| (*id, r.is_ok())));
            match page.next_after {
                Some(next) => after = next,
                None => break,
            }
        }
        let expected: Vec<(u64, bool)> = working.iter().map(|id| (*id, true)).collect();
        assert_eq!(listed, expected);
        assert!(registry.page(u64::MAX, 2).unwrap().sessions.is_empty());
    }

    #[test]
    fn a_registry_made_again_after_its_data_is_lost_does_not_reuse_session_ids() {
        let first = {
            let dir = tempfile::tempdir().unwrap();
            Registry::open(dir.path()).unwrap().new_session().unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let again = Registry::open(dir.path()).unwrap().new_session().unwrap();
        assert_ne!(first, again);
        assert!(
            first > 1 && again > 1,
            "{first} {again}: the base is random"
        );
    }

    #[test]
    fn a_registry_written_before_the_id_base_keeps_its_ids() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[9; 32]).address();
        {
            // As the old hub wrote it: a record under id 1, no base.
            let db = sled::open(dir.path()).unwrap();
            let record = SessionRecord {
                worker,
                cumulative_bytes: 5,
            };
            db.insert(1u64.to_be_bytes(), borsh::to_vec(&record).unwrap())
                .unwrap();
            db.generate_id().unwrap();
            db.flush().unwrap();
        }
        let registry = Registry::open(dir.path()).unwrap();
        assert_eq!(registry.sessions().unwrap()[0].0, 1);
        // Base 0: sled's own counter (which jumps ahead on reopen), not a random base.
        assert!(registry.new_session().unwrap() < 1 << 32);
    }
}
