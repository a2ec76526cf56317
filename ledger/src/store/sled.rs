//! The ledger's record on disk, in sled: the only code in the ledger that knows sled. One
//! sled tree holds the whole layout of `store`; a batch is one sled `apply_batch`, flushed
//! before `write` returns, which is what makes a commit atomic and durable. Also here: the
//! directory's life cycle (create, open, one process at a time).

use std::path::Path;

use crate::genesis::Genesis;

use super::{
    check_format, check_genesis, holds_chain, index_history_if_missing, write_genesis, Batch,
    Entries, KeyValue, StoreError,
};

impl From<sled::Error> for StoreError {
    fn from(error: sled::Error) -> Self {
        StoreError::Engine(Box::new(error))
    }
}

/// A ledger record in a sled directory.
pub struct SledStore {
    db: sled::Db,
}

/// Opens a sled database: the ledger's, and every other store of the node's (the consensus
/// engine's proposals, the hub's registry), so that all reopen after a crash the same way.
///
/// - sled releases its file lock from a background thread shortly after the last handle is
///   dropped, so a lock that is still held is retried briefly before the store is reported
///   as in use.
/// - A process killed while sled wrote a snapshot leaves `snap.<LSN>.generating` half
///   written. sled writes and syncs that file before renaming it `snap.<LSN>`, and its reader
///   takes the highest-named `snap.*` file, the unfinished one included, so the next open
///   fails as corrupt (sled issues 1527 and 1533). Such a file holds nothing the store
///   needs: when an open fails as corrupt (sled checks the snapshot after taking the lock, so
///   no other process holds the store), unfinished snapshots are removed and the open
///   tried once more.
pub fn open_sled(path: &Path) -> Result<sled::Db, StoreError> {
    match open_locked(path) {
        Err(StoreError::Engine(e))
            if matches!(e.downcast_ref(), Some(sled::Error::Corruption { .. }))
                && remove_unfinished_snapshots(path)? > 0 =>
        {
            open_locked(path)
        }
        other => other,
    }
}

/// `sled::open`, retried while the lock is still held (see `open_sled`).
fn open_locked(path: &Path) -> Result<sled::Db, StoreError> {
    // Two seconds in all, in short steps: a store reopened at once (a role restarted, a
    // crash test's next child) gets it within a few milliseconds of its release.
    const ATTEMPTS: u32 = 200;
    let locked = |e: &sled::Error| matches!(e, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"));
    for _ in 1..ATTEMPTS {
        match sled::open(path) {
            Err(e) if locked(&e) => std::thread::sleep(std::time::Duration::from_millis(10)),
            other => return Ok(other?),
        }
    }
    sled::open(path).map_err(|e| {
        if locked(&e) {
            StoreError::InUse(path.display().to_string())
        } else {
            e.into()
        }
    })
}

/// Removes the `snap.*.generating` files in `path` (see `open_sled`); how many there were.
/// Done holding the lock sled takes on the store's `db` file (the failed open has let it go),
/// so that no process can open the store and begin a snapshot meanwhile; one holding it
/// already makes this an `InUse`.
fn remove_unfinished_snapshots(path: &Path) -> Result<usize, StoreError> {
    let io = |e: std::io::Error| StoreError::Engine(Box::new(e));
    let db = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.join("db"))
        .map_err(io)?;
    if db.try_lock().is_err() {
        return Err(StoreError::InUse(path.display().to_string()));
    }
    let mut removed = 0;
    for entry in std::fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            std::fs::remove_file(entry.path()).map_err(io)?;
            removed += 1;
        }
    }
    Ok(removed)
}

impl SledStore {
    /// Creates a new ledger at `path` holding `genesis` and block 0.
    pub fn create(path: &Path, genesis: &Genesis) -> Result<SledStore, StoreError> {
        let store = SledStore {
            db: open_sled(path)?,
        };
        if holds_chain(&store)? {
            return Err(StoreError::AlreadyInitialised(path.display().to_string()));
        }
        write_genesis(&store, genesis)?;
        Ok(store)
    }

    /// Opens an existing ledger.
    pub fn open(path: &Path) -> Result<SledStore, StoreError> {
        let not_there = || StoreError::NotInitialised(path.display().to_string());
        if !path.exists() {
            return Err(not_there());
        }
        let store = SledStore {
            db: open_sled(path)?,
        };
        if !holds_chain(&store)? {
            return Err(not_there());
        }
        check_format(&store, &path.display().to_string())?;
        index_history_if_missing(&store)?;
        Ok(store)
    }

    /// Opens the ledger at `path`, creating it from `genesis` if absent; an existing ledger
    /// must hold the same genesis.
    pub fn open_or_create(path: &Path, genesis: &Genesis) -> Result<SledStore, StoreError> {
        match SledStore::open(path) {
            Ok(store) => {
                check_genesis(&store, genesis)?;
                Ok(store)
            }
            Err(StoreError::NotInitialised(_)) => SledStore::create(path, genesis),
            Err(e) => Err(e),
        }
    }

    /// Overwrites the stored bytes of a block. Only for tests that prove tampering is caught.
    #[doc(hidden)]
    pub fn tamper_block_bytes(&self, height: u64, bytes: &[u8]) -> Result<(), StoreError> {
        let mut batch = Batch::default();
        batch.insert(super::block_key(height), bytes);
        self.write(batch)
    }
}

impl KeyValue for SledStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.db.get(key)?.map(|value| value.to_vec()))
    }

    fn range(&self, start: &[u8], end: &[u8]) -> Entries<'_> {
        Box::new(self.db.range(start..end).map(|entry| {
            let (key, value) = entry?;
            Ok((key.to_vec(), value.to_vec()))
        }))
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let mut sled_batch = sled::Batch::default();
        for (key, value) in batch.into_writes() {
            match value {
                Some(value) => sled_batch.insert(key, value),
                None => sled_batch.remove(key),
            }
        }
        self.db.apply_batch(sled_batch)?;
        self.db.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{commit_blocks, three_blocks, three_blocks_history};
    use super::super::{
        Storage, FORMAT, HISTORY, HISTORY_INDEXED, HISTORY_PER_TX, HISTORY_PER_TX_INDEXED,
    };
    use super::*;
    use crate::genesis::tests::test_genesis;

    #[test]
    fn commits_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, keys) = test_genesis();
        let store = SledStore::create(dir.path(), &genesis).unwrap();
        let state = commit_blocks(&store, &keys, &three_blocks(&keys));
        drop(store);
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(store.head().unwrap(), 3);
        let loaded = store.load_state().unwrap();
        assert_eq!(loaded.root(), state.root());
        assert!(loaded.accounts().eq(state.accounts()));
    }

    /// What a kill while sled writes a snapshot leaves: a half-written `snap.*.generating`
    /// named after every finished one, which sled alone cannot open past.
    #[test]
    fn a_store_reopens_past_a_snapshot_left_half_written() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, keys) = test_genesis();
        let store = SledStore::create(dir.path(), &genesis).unwrap();
        let state = commit_blocks(&store, &keys, &three_blocks(&keys));
        drop(store);
        let unfinished = dir.path().join("snap.FFFFFFFFFFFFFFFF.generating");
        std::fs::write(&unfinished, vec![0x5a; 4096]).unwrap();
        let refused = open_locked(dir.path()).map(drop).unwrap_err();
        assert!(refused.to_string().contains("corrupt"), "{refused}");
        let store = SledStore::open(dir.path()).unwrap();
        assert!(!unfinished.exists());
        assert_eq!(store.head().unwrap(), 3);
        assert_eq!(store.load_state().unwrap().root(), state.root());
    }

    /// A store written before the history index, or with the index one key per transaction
    /// and party as it was first written (also by an older build after this one indexed it,
    /// which leaves both markers): indexed per block when opened, the old keys gone.
    #[test]
    fn a_store_written_before_the_history_index_is_indexed_when_opened() {
        for (per_tx, both_markers) in [(false, false), (true, false), (true, true)] {
            let dir = tempfile::tempdir().unwrap();
            let (genesis, keys) = test_genesis();
            let store = SledStore::create(dir.path(), &genesis).unwrap();
            commit_blocks(&store, &keys, &three_blocks(&keys));
            for entry in store.db.scan_prefix(HISTORY) {
                store.db.remove(entry.unwrap().0).unwrap();
            }
            if !both_markers {
                store.db.remove(HISTORY_INDEXED).unwrap();
            }
            let bob = keys.bob.address();
            assert_eq!(store.history(&bob, None, 10).unwrap(), vec![]);
            if per_tx {
                for location in three_blocks_history() {
                    let mut key = [HISTORY_PER_TX, bob.as_bytes()].concat();
                    key.extend(location.height.to_be_bytes());
                    key.extend(location.index.to_be_bytes());
                    store.db.insert(key, &[]).unwrap();
                }
                store.db.insert(HISTORY_PER_TX_INDEXED, &[]).unwrap();
            }
            drop(store);
            let store = SledStore::open(dir.path()).unwrap();
            assert_eq!(
                store.history(&bob, None, 10).unwrap(),
                three_blocks_history()
            );
            // Opened again once indexed: nothing to do, the same history.
            drop(store);
            let store = SledStore::open(dir.path()).unwrap();
            assert_eq!(
                store.history(&bob, None, 10).unwrap(),
                three_blocks_history()
            );
            assert_eq!(store.db.scan_prefix(HISTORY_PER_TX).count(), 0);
            assert!(store.db.get(HISTORY_PER_TX_INDEXED).unwrap().is_none());
        }
    }

    #[test]
    fn a_store_of_an_older_format_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, _) = test_genesis();
        let store = SledStore::create(dir.path(), &genesis).unwrap();
        store.db.remove(FORMAT).unwrap();
        drop(store);
        let refused = SledStore::open(dir.path()).err().unwrap();
        assert!(matches!(refused, StoreError::OldFormat { found: 1, .. }));
        assert!(
            refused.to_string().contains("start a new data directory"),
            "{refused}"
        );
    }

    #[test]
    fn a_ledger_holds_one_chain() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, _) = test_genesis();
        drop(SledStore::create(dir.path(), &genesis).unwrap());
        assert!(matches!(
            SledStore::create(dir.path(), &genesis),
            Err(StoreError::AlreadyInitialised(_))
        ));
        let mut other = genesis.clone();
        other.params.chain_id = "another-chain".into();
        assert!(matches!(
            SledStore::open_or_create(dir.path(), &other),
            Err(StoreError::GenesisMismatch { .. })
        ));
        assert!(SledStore::open_or_create(dir.path(), &genesis).is_ok());
        let missing = dir.path().join("missing");
        assert!(matches!(
            SledStore::open(&missing),
            Err(StoreError::NotInitialised(_))
        ));
        assert!(!missing.exists(), "opening must not create a ledger");
        // A second handle while the first is open: refused with a clear error.
        let held = SledStore::open(dir.path()).unwrap();
        assert!(matches!(
            SledStore::open(dir.path()),
            Err(StoreError::InUse(_))
        ));
        drop(held);
    }
}
