//! A ledger record kept in memory: an ordered map behind a lock, which a batch updates
//! under one write lock, so readers see all of a commit or none of it. Nothing survives the
//! process; for tests, and for anything that needs a chain without a disk.

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLock};

use crate::genesis::Genesis;

use super::{write_genesis, Batch, Entries, KeyValue, StoreError};

/// A ledger record in memory.
pub struct MemoryStore {
    entries: RwLock<BTreeMap<Vec<u8>, Vec<u8>>>,
}

impl MemoryStore {
    /// A record holding `genesis` and block 0.
    pub fn new(genesis: &Genesis) -> Result<MemoryStore, StoreError> {
        let store = MemoryStore {
            entries: RwLock::default(),
        };
        write_genesis(&store, genesis)?;
        Ok(store)
    }
}

impl KeyValue for MemoryStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        Ok(entries.get(key).cloned())
    }

    fn range(&self, start: &[u8], end: &[u8]) -> Entries<'_> {
        if start >= end {
            return Box::new(std::iter::empty());
        }
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        let found: Vec<_> = entries
            .range::<[u8], _>((
                std::ops::Bound::Included(start),
                std::ops::Bound::Excluded(end),
            ))
            .map(|(key, value)| Ok((key.clone(), value.clone())))
            .collect();
        Box::new(found.into_iter())
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        for (key, value) in batch.into_writes() {
            match value {
                Some(value) => entries.insert(key, value),
                None => entries.remove(&key),
            };
        }
        Ok(())
    }
}
