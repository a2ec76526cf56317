//! The hub's contribution registry: per session, the worker it belongs to and the cumulative
//! bytes of well-formed dispatch traffic it moved. Kept in sled so counts survive a restart.
//! Session ids are a random base, drawn when the registry is created, plus sled's persistent
//! id counter: never reused while the data directory lives, and not reused in practice after
//! it is lost either (a new base is drawn), so a new session cannot collide with the ledger's
//! marks of an old one.
//!
//! A record that does not decode is an error naming its session, and is left as found: a
//! count the hub has signed receipts for is never silently dropped or reset.
//!
//! A change log lets a reader list only the sessions whose count rose since a mark: every
//! metering takes the next number of sled's persistent counter (above the random base), and
//! the log keeps each session's newest number only. A change is logged after its count is written; a hub that
//! dies between the two leaves that session out of "since" listings until it meters again,
//! so a reader walks the whole listing (by id) now and then.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use anyhow::{Context, Result};
use borsh::{BorshDeserialize, BorshSerialize};
use kvasir_ledger::keys::Address;

#[derive(Clone, Copy, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct SessionRecord {
    pub worker: Address,
    pub cumulative_bytes: u64,
    /// The order the session's traffic was for (its backbone's); zero for none. A session
    /// is metered under one order only.
    pub order: u64,
}

/// A record as written before orders existed: worker and count.
const RECORD_BEFORE_ORDERS: usize = 40;

pub struct Registry {
    db: sled::Db,
    /// Added to every session id (see the module comment).
    id_base: u64,
    /// Change number -> session (each session's newest only), and session -> that number.
    changes: sled::Tree,
    change_of: sled::Tree,
    /// Held while a change is numbered and logged, and while the log is read: a reader that
    /// sees change n has seen every change below n that is still the newest of its session.
    log: Mutex<()>,
}

/// One page of a listing: in session-id order (`page`), or in change order (`changed`).
pub struct Page {
    /// Sessions that metered something; a record that cannot be read is its error instead,
    /// so that one bad record cannot hide the others.
    pub sessions: Vec<(u64, Result<SessionRecord, RecordError>)>,
    /// Where the next page of the same listing starts, if there may be more.
    pub next: Option<u64>,
    /// The change log's mark: everything changed after it is listed by `changed(mark, _)`.
    /// For an id page, the mark when it was read; for a change page, its last change.
    pub mark: u64,
}

const ID_BASE: &[u8] = b"id_base";

/// A registry record that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("the registry record of session {session} is corrupt ({reason}); left as found")]
    Corrupt { session: u64, reason: String },
    #[error("the registry record of session {0} belongs to another worker")]
    OtherWorker(u64),
    #[error("session {session} was metered for order {recorded}, not {got}")]
    OtherOrder {
        session: u64,
        recorded: u64,
        got: u64,
    },
}

fn be_u64(bytes: &[u8]) -> Result<u64> {
    let bytes: [u8; 8] = bytes.try_into().context("a registry key is not 8 bytes")?;
    Ok(u64::from_be_bytes(bytes))
}

fn decode(session: u64, bytes: &[u8]) -> Result<SessionRecord, RecordError> {
    let corrupt = |e: std::io::Error| RecordError::Corrupt {
        session,
        reason: e.to_string(),
    };
    if bytes.len() == RECORD_BEFORE_ORDERS {
        let mut padded = bytes.to_vec();
        padded.extend_from_slice(&0u64.to_le_bytes());
        return SessionRecord::try_from_slice(&padded).map_err(corrupt);
    }
    SessionRecord::try_from_slice(bytes).map_err(corrupt)
}

impl Registry {
    pub fn open(dir: &Path) -> Result<Registry> {
        // Opened as the ledger opens its store, so it reopens after a kill the same way.
        let db = kvasir_ledger::store::open_sled(dir)
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
        Ok(Registry {
            changes: db.open_tree("changes")?,
            change_of: db.open_tree("change_of")?,
            db,
            id_base,
            log: Mutex::new(()),
        })
    }

    fn log(&self) -> MutexGuard<'_, ()> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs a change of `session` under the next change number. The new entry is written
    /// before the old one is removed, so a crash between leaves it listed twice, not lost.
    fn log_change(&self, session: u64) -> Result<()> {
        let _log = self.log();
        // Above the registry's random base, like session ids: a registry made again after
        // its data was lost numbers its changes far from the old ones, below (the reader
        // sees its mark go back) or above (all of them are after the reader's mark).
        let number = self
            .id_base
            .checked_add(self.db.generate_id()?)
            .context("change numbers are exhausted")?
            .to_be_bytes();
        let key = session.to_be_bytes();
        self.changes.insert(number, &key)?;
        if let Some(old) = self.change_of.insert(key, &number)? {
            self.changes.remove(old)?;
        }
        Ok(())
    }

    /// The newest change number logged (0 if none).
    fn current_mark(&self) -> Result<u64> {
        let last = self.changes.last()?;
        last.map_or(Ok(0), |(number, _)| be_u64(&number))
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

    /// Adds `bytes` to the count of `session` of `worker` for `order` (its record made on the
    /// first bytes) and returns the new cumulative count. A corrupt record, or one of another
    /// worker or order, is an error and stays as it is.
    pub fn meter(&self, session: u64, worker: Address, order: u64, bytes: u64) -> Result<u64> {
        let mut outcome = Ok(0);
        // The closure may run again if the record changed meanwhile; the last run decides.
        self.db.update_and_fetch(session.to_be_bytes(), |old| {
            let Some(old) = old else {
                outcome = Ok(bytes);
                let record = SessionRecord {
                    worker,
                    cumulative_bytes: bytes,
                    order,
                };
                return borsh::to_vec(&record).ok();
            };
            let updated = decode(session, old)
                .and_then(
                    |record| match (record.worker == worker, record.order == order) {
                        (false, _) => Err(RecordError::OtherWorker(session)),
                        (true, false) => Err(RecordError::OtherOrder {
                            session,
                            recorded: record.order,
                            got: order,
                        }),
                        (true, true) => Ok(record),
                    },
                )
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
        if bytes > 0 && outcome.is_ok() {
            // The bytes are counted (and will be paid); a change not logged is found by the
            // reader's next walk by id, so it costs no answer.
            if let Err(e) = self.log_change(session) {
                tracing::error!("session {session}: logging its change failed: {e:#}");
            }
        }
        outcome
    }

    /// Up to `limit` sessions with an id above `after` that metered something, in id order,
    /// after making the counts durable: a receipt served from here never claims more than a
    /// restarted hub remembers. Sessions that never relayed a useful byte are not listed, so
    /// connecting without working costs the listing nothing.
    pub fn page(&self, after: u64, limit: usize) -> Result<Page> {
        let mark = {
            let _log = self.log();
            self.current_mark()?
        };
        let mut sessions = Vec::new();
        let Some(start) = after.checked_add(1) else {
            return Ok(Page {
                sessions,
                next: None,
                mark,
            });
        };
        for entry in self.db.range(start.to_be_bytes()..) {
            if sessions.len() == limit {
                let next = sessions.last().map(|(id, _)| *id);
                self.db.flush()?;
                return Ok(Page {
                    sessions,
                    next,
                    mark,
                });
            }
            let (key, value) = entry?;
            let session = be_u64(&key)?;
            match decode(session, &value) {
                Ok(record) if record.cumulative_bytes == 0 => {}
                record => sessions.push((session, record)),
            }
        }
        self.db.flush()?;
        Ok(Page {
            sessions,
            next: None,
            mark,
        })
    }

    /// Up to `limit` sessions whose count rose after change `since`, oldest change first,
    /// after making the counts durable; `next` is the `since` of the next page, `mark` this
    /// page's last change (`since` itself when nothing changed).
    pub fn changed(&self, since: u64, limit: usize) -> Result<Page> {
        let mut changed = Vec::new();
        let mut more = false;
        let current = {
            let _log = self.log();
            let current = self.current_mark()?;
            let start = since.checked_add(1).map(u64::to_be_bytes);
            for entry in start
                .into_iter()
                .flat_map(|start| self.changes.range(start..))
            {
                if changed.len() == limit {
                    more = true;
                    break;
                }
                let (number, session) = entry?;
                changed.push((be_u64(&number)?, be_u64(&session)?));
            }
            current
        };
        // Nothing after `since`: the mark stays, unless this log never reached it (its data
        // was lost or restored), which the reader sees as a mark that went back.
        let mark = changed
            .last()
            .map_or(since.min(current), |(number, _)| *number);
        let mut sessions = Vec::with_capacity(changed.len());
        let mut seen = std::collections::HashSet::new();
        for (_, session) in changed {
            // A session logged twice (a crash between writing and removing) is listed once.
            if !seen.insert(session) {
                continue;
            }
            if let Some(value) = self.db.get(session.to_be_bytes())? {
                sessions.push((session, decode(session, &value)));
            }
        }
        // Durable before it is served: a receipt never claims more than a restarted hub has.
        self.db.flush()?;
        Ok(Page {
            sessions,
            next: more.then_some(mark),
            mark,
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
    use kvasir_devnet::crash::{self, Kills};
    use kvasir_ledger::keys::Keypair;

    /// The child of the crash test: opens new sessions, meters each five times, makes the
    /// counts durable as a receipt listing does, and reports `SESSION COUNT`, until killed.
    #[test]
    #[ignore = "the child half of sigkill_at_random_instants_loses_no_durable_count"]
    fn crash_child_meters_forever() {
        let Some(dir) = crash::child_dir() else {
            return;
        };
        let registry = Registry::open(&dir).unwrap();
        let worker = Keypair::from_seed(&[7; 32]).address();
        let mut mark = 0;
        loop {
            let session = registry.new_session().unwrap();
            let mut count = 0;
            for bytes in 1..=5u64 {
                count = registry.meter(session, worker, 0, bytes * 1000).unwrap();
            }
            mark = registry.changed(mark, 1000).unwrap().mark;
            crash::report_durable(format_args!("{session} {count}"));
        }
    }

    /// Killed at random instants (`kvasir_devnet::crash`; 100 kills here), the registry
    /// reopens every time with every count made durable, each listed as changed, no record
    /// unreadable, and a new session id above all the old ones.
    #[test]
    fn sigkill_at_random_instants_loses_no_durable_count() {
        let mut kills = Kills::from_env("hub registry", 100);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry");
        let mut durable = std::collections::BTreeMap::new();
        for iteration in 0..kills.iterations {
            for line in kills.kill_child("hub::registry::tests::crash_child_meters_forever", &path)
            {
                let (session, count) = line.split_once(' ').unwrap();
                durable.insert(
                    session.parse::<u64>().unwrap(),
                    count.parse::<u64>().unwrap(),
                );
            }
            let registry = match Registry::open(&path) {
                Ok(registry) => registry,
                Err(e) => {
                    let kept = dir.keep().join("registry");
                    panic!(
                        "iteration {iteration}: reopening failed: {e:#}; {}",
                        crash::listing(&kept)
                    )
                }
            };
            let recorded: std::collections::BTreeMap<u64, u64> = registry
                .sessions()
                .unwrap_or_else(|e| panic!("iteration {iteration}: {e:#}"))
                .into_iter()
                .map(|(session, record)| (session, record.cumulative_bytes))
                .collect();
            for (session, count) in &durable {
                assert_eq!(
                    recorded.get(session),
                    Some(count),
                    "iteration {iteration}: session {session}"
                );
            }
            let changed = registry.changed(0, usize::MAX).unwrap();
            let listed: std::collections::BTreeSet<u64> = changed
                .sessions
                .iter()
                .map(|(session, _)| *session)
                .collect();
            assert!(
                durable.keys().all(|session| listed.contains(session)),
                "iteration {iteration}: a durable count is missing from the change log"
            );
            let newest = durable.keys().next_back().copied().unwrap_or(0);
            assert!(
                registry.new_session().unwrap() > newest,
                "iteration {iteration}"
            );
            drop(registry);
            // Sled's flusher lets go of the file lock in its own time; the next child waits
            // for it in `open_sled`.
        }
        kills.assert_enough_after_writes();
    }

    #[test]
    fn counts_and_session_ids_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[5; 32]).address();
        let first = {
            let registry = reopen(dir.path());
            let session = registry.new_session().unwrap();
            assert_eq!(registry.meter(session, worker, 0, 100).unwrap(), 100);
            assert_eq!(registry.meter(session, worker, 0, 23).unwrap(), 123);
            registry.sessions().unwrap();
            session
        };
        let registry = reopen(dir.path());
        assert_eq!(
            registry.sessions().unwrap(),
            vec![(
                first,
                SessionRecord {
                    worker,
                    cumulative_bytes: 123,
                    order: 0,
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
            let registry = reopen(dir.path());
            let good = registry.new_session().unwrap();
            let bad = registry.new_session().unwrap();
            registry.meter(bad, worker, 0, 10).unwrap();
            registry.sessions().unwrap();
            (good, bad)
        };
        {
            let db = opened(|| sled::open(dir.path()));
            db.insert(bad.to_be_bytes(), &b"garbage"[..]).unwrap();
            db.flush().unwrap();
        }
        let registry = reopen(dir.path());
        let named = format!("session {bad} is corrupt");
        let metering = registry.meter(bad, worker, 0, 5).unwrap_err().to_string();
        assert!(metering.contains(&named), "{metering}");
        let listing = format!("{:#}", registry.sessions().unwrap_err());
        assert!(listing.contains(&named), "{listing}");
        // Nothing was deleted: the bytes are as found, the other session still meters.
        assert_eq!(
            registry.db.get(bad.to_be_bytes()).unwrap().as_deref(),
            Some(&b"garbage"[..])
        );
        assert_eq!(registry.meter(good, worker, 0, 7).unwrap(), 7);
        // A session's record is made by its first bytes, and stays its worker's.
        assert_eq!(registry.meter(bad + 100, worker, 0, 1).unwrap(), 1);
        let stranger = Keypair::from_seed(&[10; 32]).address();
        let taken = registry
            .meter(bad + 100, stranger, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(taken.contains("another worker"), "{taken}");
    }

    #[test]
    fn the_listing_pages_by_cursor_and_leaves_out_sessions_that_did_no_work() {
        let dir = tempfile::tempdir().unwrap();
        let registry = reopen(dir.path());
        let worker = Keypair::from_seed(&[7; 32]).address();
        let mut working = Vec::new();
        for i in 0..10 {
            let session = registry.new_session().unwrap();
            if i % 2 == 0 {
                registry.meter(session, worker, 0, 1 + i).unwrap();
                working.push(session);
            }
        }
        let mut listed = Vec::new();
        let mut after = 0;
        loop {
            let page = registry.page(after, 2).unwrap();
            assert!(page.sessions.len() <= 2);
            listed.extend(page.sessions.iter().map(|(id, r)| (*id, r.is_ok())));
            match page.next {
                Some(next) => after = next,
                None => break,
            }
        }
        let expected: Vec<(u64, bool)> = working.iter().map(|id| (*id, true)).collect();
        assert_eq!(listed, expected);
        assert!(registry.page(u64::MAX, 2).unwrap().sessions.is_empty());
    }

    /// `open()` once a dropped database's background flusher has let go of sled's file lock
    /// (it does so shortly after the drop, on its own thread).
    fn opened<T, E: std::fmt::Debug>(open: impl Fn() -> Result<T, E>) -> T {
        for _ in 0..200 {
            if let Ok(opened) = open() {
                return opened;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        open().unwrap()
    }

    fn reopen(dir: &Path) -> Registry {
        opened(|| Registry::open(dir))
    }

    /// Every session a change listing from `since` holds, page by page, with its count.
    fn changed_since(registry: &Registry, since: u64) -> (Vec<(u64, u64)>, u64) {
        let (mut listed, mut since) = (Vec::new(), since);
        loop {
            let page = registry.changed(since, 2).unwrap();
            assert!(page.sessions.len() <= 2);
            listed.extend(
                page.sessions
                    .into_iter()
                    .map(|(id, r)| (id, r.unwrap().cumulative_bytes)),
            );
            since = page.mark;
            if page.next.is_none() {
                return (listed, since);
            }
        }
    }

    #[test]
    fn a_change_listing_holds_only_the_sessions_that_rose_since_the_mark_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let worker = Keypair::from_seed(&[8; 32]).address();
        let registry = reopen(dir.path());
        let sessions: Vec<u64> = (0..5).map(|_| registry.new_session().unwrap()).collect();
        for (i, session) in sessions.iter().enumerate() {
            registry.meter(*session, worker, 0, 10 + i as u64).unwrap();
        }
        let (all, mark) = changed_since(&registry, 0);
        assert_eq!(all.len(), 5);
        assert_eq!(registry.page(0, 10).unwrap().mark, mark);
        // Nothing rose: nothing listed, the mark stays.
        assert_eq!(changed_since(&registry, mark), (vec![], mark));
        // Two rise, one of them twice, one meters nothing: those two, once each, newest count.
        registry.meter(sessions[3], worker, 0, 1).unwrap();
        registry.meter(sessions[1], worker, 0, 1).unwrap();
        registry.meter(sessions[3], worker, 0, 1).unwrap();
        registry.meter(sessions[0], worker, 0, 0).unwrap();
        let (rose, later) = changed_since(&registry, mark);
        assert_eq!(rose, vec![(sessions[1], 12), (sessions[3], 15)]);
        assert!(later > mark);
        // Marks stay ordered across a reopen.
        drop(registry);
        let registry = reopen(dir.path());
        registry.meter(sessions[4], worker, 0, 1).unwrap();
        assert_eq!(changed_since(&registry, later).0, vec![(sessions[4], 15)]);
        assert!(registry.changed(u64::MAX, 2).unwrap().sessions.is_empty());
        // A registry made again after its data was lost: its mark for a later `since` goes
        // back, or everything it logged is after it.
        let lost = tempfile::tempdir().unwrap();
        let fresh = Registry::open(lost.path()).unwrap();
        let session = fresh.new_session().unwrap();
        fresh.meter(session, worker, 0, 3).unwrap();
        let page = fresh.changed(later, 2).unwrap();
        let listed: Vec<u64> = page.sessions.iter().map(|(id, _)| *id).collect();
        assert!(
            page.mark < later || listed == vec![session],
            "{listed:?} {}",
            page.mark
        );
    }

    #[test]
    fn a_registry_made_again_after_its_data_is_lost_does_not_reuse_session_ids() {
        let first = {
            let dir = tempfile::tempdir().unwrap();
            reopen(dir.path()).new_session().unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let again = reopen(dir.path()).new_session().unwrap();
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
            // As the old hub wrote it: a record (worker and count, from before orders) under
            // id 1, no base.
            let db = opened(|| sled::open(dir.path()));
            let record = (worker, 5u64);
            db.insert(1u64.to_be_bytes(), borsh::to_vec(&record).unwrap())
                .unwrap();
            db.generate_id().unwrap();
            db.flush().unwrap();
        }
        let registry = reopen(dir.path());
        assert_eq!(registry.sessions().unwrap()[0].0, 1);
        let old = registry.sessions().unwrap()[0].1;
        assert_eq!(
            (old.worker, old.cumulative_bytes, old.order),
            (worker, 5, 0)
        );
        // A session is metered for one order: bytes for another are refused, the count kept.
        let refused = registry.meter(1, worker, 4, 1).unwrap_err().to_string();
        assert!(refused.contains("metered for order 0, not 4"), "{refused}");
        assert_eq!(registry.meter(1, worker, 0, 1).unwrap(), 6);
        // Base 0: sled's own counter (which jumps ahead on reopen), not a random base.
        assert!(registry.new_session().unwrap() < 1 << 32);
    }
}
