//! Storage: the only module that knows sled. Everything lives in one sled tree under short
//! key prefixes, so a block, its state changes, its transaction index and the new head go in
//! one atomic `apply_batch`, flushed before `commit` returns: a crash at any instant leaves
//! either the whole block or none of it. Beside the block and state, two indexes: where each
//! transaction was included, and per account the locations of the transactions it is a party
//! to (so an account's history is a range read, however long the chain).

use std::path::Path;
use std::sync::Arc;

use borsh::BorshDeserialize;

use crate::block::{genesis_block, Block};
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::keys::Address;
use crate::state::{Account, ChangeSet, ReceiptMark, SessionKey, State};

const GENESIS: &[u8] = b"m/genesis";
const HEAD: &[u8] = b"m/head";
const BLOCK: &[u8] = b"b/";
const BLOCK_HASH: &[u8] = b"h/";
const ACCOUNT: &[u8] = b"a/";
const RECEIPT: &[u8] = b"r/";
const TX: &[u8] = b"t/";
const HISTORY: &[u8] = b"x/";
/// Present once every stored block is in the HISTORY index (stores written before it existed
/// are indexed when opened).
const HISTORY_INDEXED: &[u8] = b"m/history-indexed";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage: {0}")]
    Sled(#[from] sled::Error),
    #[error("no ledger at {0}: run `kvasir-node genesis init` or start the ledger with --genesis")]
    NotInitialised(String),
    #[error("ledger at {0} already holds a chain")]
    AlreadyInitialised(String),
    #[error("ledger holds chain {stored}, the genesis given is {given}")]
    GenesisMismatch { stored: Hash, given: Hash },
    #[error("block {got} does not follow the stored head {head}")]
    OutOfOrder { head: u64, got: u64 },
    #[error("storage is corrupt: {0}")]
    Corrupt(String),
    #[error("ledger at {0} is in use by another process")]
    InUse(String),
}

/// Where a transaction was included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxLocation {
    pub height: u64,
    pub index: u32,
}

pub struct Store {
    db: sled::Db,
}

/// Opens the sled database. sled releases its file lock from a background thread shortly
/// after the last handle is dropped, so a lock that is still held is retried briefly before
/// the ledger is reported as in use.
fn open_db(path: &Path) -> Result<sled::Db, StoreError> {
    const ATTEMPTS: u32 = 40;
    let locked = |e: &sled::Error| matches!(e, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"));
    for _ in 1..ATTEMPTS {
        match sled::open(path) {
            Err(e) if locked(&e) => std::thread::sleep(std::time::Duration::from_millis(50)),
            other => return Ok(other?),
        }
    }
    sled::open(path).map_err(|e| {
        if locked(&e) {
            StoreError::InUse(path.display().to_string())
        } else {
            StoreError::Sled(e)
        }
    })
}

fn key(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    [prefix, rest].concat()
}

fn receipt_key(session: &SessionKey) -> Vec<u8> {
    key(
        RECEIPT,
        &[
            session.hub.as_bytes().as_slice(),
            &session.session_id.to_be_bytes(),
        ]
        .concat(),
    )
}

impl TxLocation {
    /// Big-endian height then index: byte order is chain order.
    fn to_bytes(self) -> [u8; 12] {
        let mut bytes = [0u8; 12];
        bytes[..8].copy_from_slice(&self.height.to_be_bytes());
        bytes[8..].copy_from_slice(&self.index.to_be_bytes());
        bytes
    }

    fn from_bytes(what: &str, bytes: &[u8]) -> Result<TxLocation, StoreError> {
        let index = bytes
            .get(8..12)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
            .ok_or_else(|| StoreError::Corrupt(format!("{what}: short location")))?;
        Ok(TxLocation {
            height: be_u64(what, bytes)?,
            index,
        })
    }
}

fn history_key(address: &Address, rest: &[u8]) -> Vec<u8> {
    [HISTORY, address.as_bytes().as_slice(), rest].concat()
}

fn decode<T: BorshDeserialize>(what: &str, bytes: &[u8]) -> Result<T, StoreError> {
    borsh::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

fn be_u64(what: &str, bytes: &[u8]) -> Result<u64, StoreError> {
    let array: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::Corrupt(format!("{what}: short integer")))?;
    Ok(u64::from_be_bytes(array))
}

impl Store {
    /// Creates a new ledger at `path` holding `genesis` and block 0.
    pub fn create(path: &Path, genesis: &Genesis) -> Result<Store, StoreError> {
        let store = Store { db: open_db(path)? };
        if store.db.contains_key(GENESIS)? {
            return Err(StoreError::AlreadyInitialised(path.display().to_string()));
        }
        let state = State::from_genesis(genesis.clone());
        let block = genesis_block(genesis);
        let mut batch = sled::Batch::default();
        batch.insert(GENESIS, genesis.to_json().as_bytes());
        batch.insert(HISTORY_INDEXED, &[]);
        let changes = ChangeSet {
            accounts: state.accounts().map(|(a, acc)| (*a, acc.clone())).collect(),
            receipts: Vec::new(),
        };
        store.write_block(&mut batch, &block, &changes);
        store.db.apply_batch(batch)?;
        store.db.flush()?;
        Ok(store)
    }

    /// Opens an existing ledger.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let not_there = || StoreError::NotInitialised(path.display().to_string());
        if !path.exists() {
            return Err(not_there());
        }
        let store = Store { db: open_db(path)? };
        if !store.db.contains_key(GENESIS)? {
            return Err(not_there());
        }
        if !store.db.contains_key(HISTORY_INDEXED)? {
            store.index_history()?;
        }
        Ok(store)
    }

    /// Adds every stored block's transactions to the account history index.
    fn index_history(&self) -> Result<(), StoreError> {
        const BLOCKS_PER_BATCH: u64 = 1_000;
        let head = self.head()?;
        let mut batch = sled::Batch::default();
        for height in 0..=head {
            let block = self
                .block(height)?
                .ok_or_else(|| StoreError::Corrupt(format!("no block at height {height}")))?;
            write_history(&mut batch, &block);
            if height % BLOCKS_PER_BATCH == 0 {
                self.db.apply_batch(std::mem::take(&mut batch))?;
            }
        }
        batch.insert(HISTORY_INDEXED, &[]);
        self.db.apply_batch(batch)?;
        self.db.flush()?;
        Ok(())
    }

    /// Where the transactions `address` is a party to were included, newest first: at most
    /// `limit` of them, all before location `before` when given.
    pub fn history(
        &self,
        address: &Address,
        before: Option<TxLocation>,
        limit: usize,
    ) -> Result<Vec<TxLocation>, StoreError> {
        let start = history_key(address, &[]);
        let end = match before {
            Some(location) => history_key(address, &location.to_bytes()),
            None => history_key(address, &[0xff; 13]),
        };
        self.db
            .range(start..end)
            .rev()
            .take(limit)
            .map(|entry| {
                let (k, _) = entry?;
                TxLocation::from_bytes(
                    "history index",
                    k.get(HISTORY.len() + 32..).unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Opens the ledger at `path`, creating it from `genesis` if absent; an existing ledger
    /// must hold the same genesis.
    pub fn open_or_create(path: &Path, genesis: &Genesis) -> Result<Store, StoreError> {
        match Store::open(path) {
            Ok(store) => {
                let stored = store.genesis()?.hash();
                if stored != genesis.hash() {
                    return Err(StoreError::GenesisMismatch {
                        stored,
                        given: genesis.hash(),
                    });
                }
                Ok(store)
            }
            Err(StoreError::NotInitialised(_)) => Store::create(path, genesis),
            Err(e) => Err(e),
        }
    }

    pub fn genesis(&self) -> Result<Genesis, StoreError> {
        let bytes = self
            .db
            .get(GENESIS)?
            .ok_or_else(|| StoreError::Corrupt("no genesis".into()))?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| StoreError::Corrupt("genesis is not UTF-8".into()))?;
        Genesis::from_json(text).map_err(|e| StoreError::Corrupt(format!("genesis: {e}")))
    }

    pub fn head(&self) -> Result<u64, StoreError> {
        let bytes = self
            .db
            .get(HEAD)?
            .ok_or_else(|| StoreError::Corrupt("no head".into()))?;
        be_u64("head", &bytes)
    }

    /// The stored bytes of block `height`, exactly as committed.
    pub fn block_bytes(&self, height: u64) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .db
            .get(key(BLOCK, &height.to_be_bytes()))?
            .map(|v| v.to_vec()))
    }

    pub fn block(&self, height: u64) -> Result<Option<Block>, StoreError> {
        self.block_bytes(height)?
            .map(|bytes| decode("block", &bytes))
            .transpose()
    }

    pub fn height_of(&self, hash: &Hash) -> Result<Option<u64>, StoreError> {
        self.db
            .get(key(BLOCK_HASH, hash.as_bytes()))?
            .map(|v| be_u64("block index", &v))
            .transpose()
    }

    pub fn tx_location(&self, hash: &Hash) -> Result<Option<TxLocation>, StoreError> {
        self.db
            .get(key(TX, hash.as_bytes()))?
            .map(|value| TxLocation::from_bytes("tx index", &value))
            .transpose()
    }

    /// Loads the committed state at the head and checks it against the head's state root.
    pub fn load_state(&self) -> Result<State, StoreError> {
        let genesis = Arc::new(self.genesis()?);
        let head = self.head()?;
        let block = self
            .block(head)?
            .ok_or_else(|| StoreError::Corrupt(format!("head block {head} missing")))?;
        let mut accounts = Vec::new();
        for entry in self.db.scan_prefix(ACCOUNT) {
            let (k, v) = entry?;
            let bytes: [u8; 32] = k[ACCOUNT.len()..]
                .try_into()
                .map_err(|_| StoreError::Corrupt("account key".into()))?;
            accounts.push((
                Address::from_bytes(bytes),
                decode::<Account>("account", &v)?,
            ));
        }
        let mut receipts = Vec::new();
        for entry in self.db.scan_prefix(RECEIPT) {
            let (k, v) = entry?;
            let rest = &k[RECEIPT.len()..];
            let hub: [u8; 32] = rest
                .get(..32)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| StoreError::Corrupt("receipt key".into()))?;
            let session_id = be_u64("receipt key", rest.get(32..).unwrap_or_default())?;
            let session = SessionKey {
                hub: Address::from_bytes(hub),
                session_id,
            };
            receipts.push((session, decode::<ReceiptMark>("receipt", &v)?));
        }
        let state = State::from_parts(
            genesis,
            head,
            block.hash(),
            block.header.timestamp_ms,
            accounts,
            receipts,
        );
        if state.root() != block.header.state_root {
            return Err(StoreError::Corrupt(format!(
                "stored state root {} differs from block {head}'s {}",
                state.root(),
                block.header.state_root
            )));
        }
        Ok(state)
    }

    /// Commits the next block and its state changes atomically and durably.
    pub fn commit(&self, block: &Block, changes: &ChangeSet) -> Result<(), StoreError> {
        let head = self.head()?;
        if block.header.height != head + 1 {
            return Err(StoreError::OutOfOrder {
                head,
                got: block.header.height,
            });
        }
        let mut batch = sled::Batch::default();
        self.write_block(&mut batch, block, changes);
        self.db.apply_batch(batch)?;
        self.db.flush()?;
        Ok(())
    }

    fn write_block(&self, batch: &mut sled::Batch, block: &Block, changes: &ChangeSet) {
        let height = block.header.height;
        batch.insert(key(BLOCK, &height.to_be_bytes()), block.to_bytes());
        batch.insert(
            key(BLOCK_HASH, block.hash().as_bytes()),
            &height.to_be_bytes(),
        );
        for (location, tx) in locations(block) {
            batch.insert(key(TX, tx.hash().as_bytes()), &location.to_bytes());
        }
        write_history(batch, block);
        for (address, account) in &changes.accounts {
            batch.insert(
                key(ACCOUNT, address.as_bytes()),
                borsh::to_vec(account).unwrap_or_default(),
            );
        }
        for (session, mark) in &changes.receipts {
            batch.insert(
                receipt_key(session),
                borsh::to_vec(mark).unwrap_or_default(),
            );
        }
        batch.insert(HEAD, &height.to_be_bytes());
    }

    /// Overwrites the stored bytes of a block. Only for tests that prove tampering is caught.
    #[doc(hidden)]
    pub fn tamper_block_bytes(&self, height: u64, bytes: &[u8]) -> Result<(), StoreError> {
        self.db.insert(key(BLOCK, &height.to_be_bytes()), bytes)?;
        self.db.flush()?;
        Ok(())
    }
}

fn locations(block: &Block) -> impl Iterator<Item = (TxLocation, &crate::tx::SignedTx)> {
    let height = block.header.height;
    block.txs.iter().enumerate().map(move |(index, tx)| {
        let index = index as u32;
        (TxLocation { height, index }, tx)
    })
}

fn write_history(batch: &mut sled::Batch, block: &Block) {
    for (location, tx) in locations(block) {
        for party in tx.tx.parties() {
            batch.insert(history_key(&party, &location.to_bytes()), &[]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::produce_block;
    use crate::genesis::tests::test_genesis;
    use crate::tx::check_stateless;
    use crate::tx::tests::transfer;

    #[test]
    fn commits_survive_reopening_and_indexes_find_blocks_and_txs() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, keys) = test_genesis();
        let store = Store::create(dir.path(), &genesis).unwrap();
        let mut state = store.load_state().unwrap();
        assert_eq!(state.root(), State::from_genesis(genesis.clone()).root());
        let tx = transfer(&keys.alice, 0, keys.bob.address(), "2");
        let checked: Vec<_> = check_stateless(&genesis, vec![tx.clone()])
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let produced = produce_block(&state, &checked, &keys.validator, 10).unwrap();
        store.commit(&produced.block, &produced.changes).unwrap();
        // The same block again, or one skipping a height, is refused.
        assert!(matches!(
            store.commit(&produced.block, &produced.changes),
            Err(StoreError::OutOfOrder { head: 1, got: 1 })
        ));
        state = produced.state;
        drop(store);

        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.head().unwrap(), 1);
        let loaded = store.load_state().unwrap();
        assert_eq!(loaded.root(), state.root());
        assert!(loaded.accounts().eq(state.accounts()));
        assert_eq!(store.height_of(&produced.block.hash()).unwrap(), Some(1));
        assert_eq!(
            store.tx_location(&tx.hash()).unwrap(),
            Some(TxLocation {
                height: 1,
                index: 0
            })
        );
        assert_eq!(store.tx_location(&Hash::ZERO).unwrap(), None);
        assert_eq!(store.block(1).unwrap().unwrap(), produced.block);
        assert_eq!(store.block(2).unwrap(), None);
    }

    #[test]
    fn account_history_is_indexed_newest_first_pages_and_is_rebuilt_for_old_stores() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, keys) = test_genesis();
        let store = Store::create(dir.path(), &genesis).unwrap();
        let mut state = store.load_state().unwrap();
        // Three blocks: alice pays bob twice, then bob pays alice once; carol is untouched.
        let blocks = [
            vec![
                transfer(&keys.alice, 0, keys.bob.address(), "1"),
                transfer(&keys.alice, 1, keys.bob.address(), "2"),
            ],
            vec![],
            vec![transfer(&keys.bob, 0, keys.alice.address(), "1")],
        ];
        for (height, txs) in blocks.iter().enumerate() {
            let checked: Vec<_> = check_stateless(&genesis, txs.clone())
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let produced =
                produce_block(&state, &checked, &keys.validator, height as u64 + 10).unwrap();
            assert!(produced.rejected.is_empty());
            store.commit(&produced.block, &produced.changes).unwrap();
            state = produced.state;
        }
        let at = |height, index| TxLocation { height, index };
        let bob = keys.bob.address();
        let newest_first = vec![at(3, 0), at(1, 1), at(1, 0)];
        assert_eq!(store.history(&bob, None, 10).unwrap(), newest_first);
        assert_eq!(
            store.history(&keys.alice.address(), None, 10).unwrap(),
            newest_first
        );
        assert_eq!(store.history(&bob, None, 2).unwrap(), newest_first[..2]);
        assert_eq!(
            store.history(&bob, Some(at(3, 0)), 10).unwrap(),
            newest_first[1..]
        );
        assert_eq!(
            store.history(&bob, Some(at(1, 1)), 10).unwrap(),
            newest_first[2..]
        );
        assert_eq!(store.history(&bob, Some(at(1, 0)), 10).unwrap(), vec![]);
        assert_eq!(
            store.history(&keys.worker.address(), None, 10).unwrap(),
            vec![]
        );

        // A store written before the index existed is indexed when opened.
        for entry in store.db.scan_prefix(HISTORY) {
            store.db.remove(entry.unwrap().0).unwrap();
        }
        store.db.remove(HISTORY_INDEXED).unwrap();
        assert_eq!(store.history(&bob, None, 10).unwrap(), vec![]);
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.history(&bob, None, 10).unwrap(), newest_first);
    }

    #[test]
    fn a_ledger_holds_one_chain() {
        let dir = tempfile::tempdir().unwrap();
        let (genesis, _) = test_genesis();
        drop(Store::create(dir.path(), &genesis).unwrap());
        assert!(matches!(
            Store::create(dir.path(), &genesis),
            Err(StoreError::AlreadyInitialised(_))
        ));
        let mut other = genesis.clone();
        other.params.chain_id = "another-chain".into();
        assert!(matches!(
            Store::open_or_create(dir.path(), &other),
            Err(StoreError::GenesisMismatch { .. })
        ));
        assert!(Store::open_or_create(dir.path(), &genesis).is_ok());
        let missing = dir.path().join("missing");
        assert!(matches!(
            Store::open(&missing),
            Err(StoreError::NotInitialised(_))
        ));
        assert!(!missing.exists(), "opening must not create a ledger");
        // A second handle while the first is open: refused with a clear error.
        let held = Store::open(dir.path()).unwrap();
        assert!(matches!(Store::open(dir.path()), Err(StoreError::InUse(_))));
        drop(held);
    }
}
