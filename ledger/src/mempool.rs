//! The mempool: transactions waiting for a block, ordered per sender by nonce so that a
//! sender's transactions reach the producer in the order they can apply.

use std::collections::{BTreeMap, HashMap};

use crate::hash::Hash;
use crate::keys::Address;
use crate::tx::VerifiedTx;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MempoolError {
    #[error("mempool is full ({0} transactions)")]
    Full(usize),
    #[error("transaction {0} is already in the mempool")]
    Duplicate(Hash),
    #[error("sender {0} already has a transaction with nonce {1} waiting")]
    NonceTaken(Address, u64),
}

pub struct Mempool {
    capacity: usize,
    by_slot: BTreeMap<(Address, u64), VerifiedTx>,
    slot_of: HashMap<Hash, (Address, u64)>,
}

impl Mempool {
    pub fn new(capacity: usize) -> Self {
        Mempool {
            capacity,
            by_slot: BTreeMap::new(),
            slot_of: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    pub fn contains(&self, hash: &Hash) -> bool {
        self.slot_of.contains_key(hash)
    }

    /// Admits a transaction that passed the stateless check.
    pub fn insert(&mut self, tx: VerifiedTx) -> Result<Hash, MempoolError> {
        let hash = tx.tx().hash();
        if self.slot_of.contains_key(&hash) {
            return Err(MempoolError::Duplicate(hash));
        }
        let slot = (tx.tx().tx.sender, tx.tx().tx.nonce);
        if self.by_slot.contains_key(&slot) {
            return Err(MempoolError::NonceTaken(slot.0, slot.1));
        }
        if self.by_slot.len() >= self.capacity {
            return Err(MempoolError::Full(self.capacity));
        }
        self.slot_of.insert(hash, slot);
        self.by_slot.insert(slot, tx);
        Ok(hash)
    }

    /// Up to `limit` transactions for the next block, each sender's in nonce order.
    pub fn candidates(&self, limit: usize) -> Vec<VerifiedTx> {
        self.by_slot.values().take(limit).cloned().collect()
    }

    /// Drops transactions that were included or rejected.
    pub fn remove(&mut self, hashes: impl IntoIterator<Item = Hash>) {
        for hash in hashes {
            if let Some(slot) = self.slot_of.remove(&hash) {
                self.by_slot.remove(&slot);
            }
        }
    }
}
