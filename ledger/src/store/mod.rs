//! Storage: the ledger's durable record of its chain, behind two traits. `KeyValue` is what a
//! storage engine must offer: ordered byte keys, reads, range scans, and batches of writes
//! applied atomically and durably. `Storage` is what the ledger asks of its record (genesis,
//! blocks, the state at the head, two indexes, and `commit`); it is implemented once, here,
//! for every `KeyValue`, so the key layout and its guarantees hold whatever the engine.
//! `sled` (`SledStore`, on disk) is the only code that knows sled; `memory` (`MemoryStore`)
//! keeps a chain in memory, for tests.
//!
//! Everything lives under short key prefixes, so a block, its state changes, its transaction
//! index and the new head go in one batch: a crash at any instant leaves either the whole
//! block or none of it. Beside the block and state, two indexes: where each transaction was
//! included, and per account and block the indices of the transactions it is a party to
//! (so an account's history is a range read, however long the chain, and a block adds one
//! entry per account it touches rather than one per transaction and party: what a store
//! pays most for is the number of keys a commit writes).

mod memory;
mod sled;

use std::sync::Arc;

use borsh::BorshDeserialize;

pub use self::memory::MemoryStore;
pub use self::sled::{open_sled, SledStore};
use crate::amount::Amount;
use crate::block::{genesis_block, Block};
use crate::certificate::Certificate;
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::keys::Address;
use crate::state::{Account, ChangeSet, MeterKey, ReceiptMark, SessionKey, State};
use crate::tx::SignedTx;

const GENESIS: &[u8] = b"m/genesis";
const HEAD: &[u8] = b"m/head";
const BLOCK: &[u8] = b"b/";
const BLOCK_HASH: &[u8] = b"h/";
const ACCOUNT: &[u8] = b"a/";
const RECEIPT: &[u8] = b"r/";
const TX: &[u8] = b"t/";
/// Per (account, height): the indices of the block's transactions the account is a party
/// to, u32 big-endian each, ascending.
const HISTORY: &[u8] = b"y/";
/// The history index as it was first written, one key per (account, location): replaced by
/// `HISTORY` when a store is opened.
const HISTORY_PER_TX: &[u8] = b"x/";
const CERTIFICATE: &[u8] = b"c/";
const OFFER: &[u8] = b"o/";
const ORDER: &[u8] = b"d/";
const PLACEMENT: &[u8] = b"p/";
/// The base fee, on a chain with fees (absent from a record of a chain without).
const BASE_FEE: &[u8] = b"m/base-fee";
/// The record's format: how its state entries are encoded and which rules its blocks were
/// made under. A record of another format cannot be loaded or re-verified by this build.
const FORMAT: &[u8] = b"m/format";
/// 2: the market (orders on receipts and pending rewards, offers, orders, placements).
/// A record without the key is of format 1.
const FORMAT_VERSION: u8 = 2;
/// Present once every stored block is in the HISTORY index (stores written before it existed,
/// or with the index per transaction, are indexed when opened).
const HISTORY_INDEXED: &[u8] = b"m/history-by-block";
/// What marked the index per transaction.
const HISTORY_PER_TX_INDEXED: &[u8] = b"m/history-indexed";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage: {0}")]
    Engine(Box<dyn std::error::Error + Send + Sync>),
    #[error("no ledger at {0}: run `kvasir-node genesis init` or start the ledger with --genesis")]
    NotInitialised(String),
    #[error("ledger at {0} already holds a chain")]
    AlreadyInitialised(String),
    #[error("ledger holds chain {stored}, the genesis given is {given}")]
    GenesisMismatch { stored: Hash, given: Hash },
    #[error("block {got} does not follow the stored head {head}")]
    OutOfOrder { head: u64, got: u64 },
    #[error("the certificate given is for block {certified} at height {height}, not this block")]
    CertificateMismatch { height: u64, certified: Hash },
    #[error("storage is corrupt: {0}")]
    Corrupt(String),
    #[error("the store at {0} is in use by another process")]
    InUse(String),
    #[error("ledger at {path} was written by an older Kvasir (store format {found}; this one reads {FORMAT_VERSION}): its blocks follow other rules and cannot be replayed here; start a new data directory (for dev: another --data-dir)")]
    OldFormat { path: String, found: u8 },
}

/// Where a transaction was included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxLocation {
    pub height: u64,
    pub index: u32,
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

/// Writes that a `KeyValue` engine applies all together or not at all. Only this module
/// fills one, so an engine never sees anything but the layout below.
#[derive(Default)]
pub struct Batch {
    writes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl Batch {
    fn insert(&mut self, key: Vec<u8>, value: impl Into<Vec<u8>>) {
        self.writes.push((key, Some(value.into())));
    }

    fn remove(&mut self, key: Vec<u8>) {
        self.writes.push((key, None));
    }

    /// Each key with its new value, or none to remove it, in the order they were added; a
    /// later write of the same key wins.
    pub fn into_writes(self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        self.writes
    }
}

/// Entries of a range read, in key order or (`rev`) in reverse.
pub type Entries<'a> =
    Box<dyn DoubleEndedIterator<Item = Result<(Vec<u8>, Vec<u8>), StoreError>> + 'a>;

/// What a storage engine offers the ledger: an ordered map from byte keys to byte values.
pub trait KeyValue {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// The entries with `start <= key < end`.
    fn range(&self, start: &[u8], end: &[u8]) -> Entries<'_>;

    /// Applies every write in `batch` at once, durably: when this returns `Ok` a crash
    /// loses none of it, and a crash at any instant before leaves none of it.
    fn write(&self, batch: Batch) -> Result<(), StoreError>;
}

/// The ledger's record of its chain. Implemented for every `KeyValue` engine.
pub trait Storage {
    /// The genesis this record holds.
    fn genesis(&self) -> Result<Genesis, StoreError>;

    /// The height of the newest committed block.
    fn head(&self) -> Result<u64, StoreError>;

    /// The stored bytes of block `height`, exactly as committed.
    fn block_bytes(&self, height: u64) -> Result<Option<Vec<u8>>, StoreError>;

    fn block(&self, height: u64) -> Result<Option<Block>, StoreError>;

    /// The stored bytes of the certificate that committed block `height` (none for block 0).
    fn certificate_bytes(&self, height: u64) -> Result<Option<Vec<u8>>, StoreError>;

    fn certificate(&self, height: u64) -> Result<Option<Certificate>, StoreError>;

    /// The height of the block with this hash.
    fn height_of(&self, hash: &Hash) -> Result<Option<u64>, StoreError>;

    /// Where the transaction with this hash was included.
    fn tx_location(&self, hash: &Hash) -> Result<Option<TxLocation>, StoreError>;

    /// Where the transactions `address` is a party to were included, newest first: at most
    /// `limit` of them, all before location `before` when given.
    fn history(
        &self,
        address: &Address,
        before: Option<TxLocation>,
        limit: usize,
    ) -> Result<Vec<TxLocation>, StoreError>;

    /// The committed state at the head, checked against the head's state root.
    fn load_state(&self) -> Result<State, StoreError>;

    /// Commits the next block, its state changes and the certificate that committed it,
    /// atomically and durably. The certificate must name the block; checking its signatures
    /// is the caller's business.
    fn commit(
        &self,
        block: &Block,
        changes: &ChangeSet,
        certificate: &Certificate,
    ) -> Result<(), StoreError>;
}

impl<K: KeyValue> Storage for K {
    fn genesis(&self) -> Result<Genesis, StoreError> {
        let bytes = self
            .get(GENESIS)?
            .ok_or_else(|| StoreError::Corrupt("no genesis".into()))?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| StoreError::Corrupt("genesis is not UTF-8".into()))?;
        Genesis::from_json(text).map_err(|e| StoreError::Corrupt(format!("genesis: {e}")))
    }

    fn head(&self) -> Result<u64, StoreError> {
        let bytes = self
            .get(HEAD)?
            .ok_or_else(|| StoreError::Corrupt("no head".into()))?;
        be_u64("head", &bytes)
    }

    fn block_bytes(&self, height: u64) -> Result<Option<Vec<u8>>, StoreError> {
        self.get(&block_key(height))
    }

    fn block(&self, height: u64) -> Result<Option<Block>, StoreError> {
        self.block_bytes(height)?
            .map(|bytes| decode("block", &bytes))
            .transpose()
    }

    fn certificate_bytes(&self, height: u64) -> Result<Option<Vec<u8>>, StoreError> {
        self.get(&key(CERTIFICATE, &height.to_be_bytes()))
    }

    fn certificate(&self, height: u64) -> Result<Option<Certificate>, StoreError> {
        self.certificate_bytes(height)?
            .map(|bytes| decode("certificate", &bytes))
            .transpose()
    }

    fn height_of(&self, hash: &Hash) -> Result<Option<u64>, StoreError> {
        self.get(&key(BLOCK_HASH, hash.as_bytes()))?
            .map(|v| be_u64("block index", &v))
            .transpose()
    }

    fn tx_location(&self, hash: &Hash) -> Result<Option<TxLocation>, StoreError> {
        self.get(&key(TX, hash.as_bytes()))?
            .map(|value| TxLocation::from_bytes("tx index", &value))
            .transpose()
    }

    fn history(
        &self,
        address: &Address,
        before: Option<TxLocation>,
        limit: usize,
    ) -> Result<Vec<TxLocation>, StoreError> {
        let start = history_key(address, &[]);
        // The block of `before` itself is read too, for the indices below it.
        let end = match before.and_then(|b| b.height.checked_add(1)) {
            Some(next) => history_key(address, &next.to_be_bytes()),
            None => history_key(address, &[0xff; 9]),
        };
        let mut found = Vec::new();
        if limit == 0 {
            return Ok(found);
        }
        for entry in self.range(&start, &end).rev() {
            let (k, v) = entry?;
            let height = be_u64(
                "history key",
                k.get(HISTORY.len() + 32..).unwrap_or_default(),
            )?;
            if v.len() % 4 != 0 {
                return Err(StoreError::Corrupt("history entry".into()));
            }
            let newest_first = v.chunks_exact(4).rev().map(|index| TxLocation {
                height,
                index: u32::from_be_bytes([index[0], index[1], index[2], index[3]]),
            });
            for location in newest_first {
                if before.is_none_or(|b| location.to_bytes() < b.to_bytes()) {
                    found.push(location);
                }
                if found.len() >= limit {
                    return Ok(found);
                }
            }
        }
        Ok(found)
    }

    fn load_state(&self) -> Result<State, StoreError> {
        let genesis = Arc::new(self.genesis()?);
        let head = self.head()?;
        let block = self
            .block(head)?
            .ok_or_else(|| StoreError::Corrupt(format!("head block {head} missing")))?;
        let mut accounts = Vec::new();
        for entry in scan_prefix(self, ACCOUNT) {
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
        for entry in scan_prefix(self, RECEIPT) {
            let (k, v) = entry?;
            let rest = &k[RECEIPT.len()..];
            let hub: [u8; 32] = rest
                .get(..32)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| StoreError::Corrupt("receipt key".into()))?;
            let session_id = be_u64("receipt key", rest.get(32..).unwrap_or_default())?;
            let order = match rest.get(40..) {
                Some(order) if !order.is_empty() => be_u64("receipt key", order)?,
                _ => 0,
            };
            let session = SessionKey {
                hub: Address::from_bytes(hub),
                session_id,
            };
            let key = MeterKey { session, order };
            receipts.push((key, decode::<ReceiptMark>("receipt", &v)?));
        }
        let entries = ChangeSet {
            accounts,
            receipts,
            offers: scan_values(self, OFFER, "offer")?,
            orders: scan_values(self, ORDER, "order")?,
            placements: scan_values(self, PLACEMENT, "placement")?,
            base_fee: match self.get(BASE_FEE)? {
                Some(bytes) => Some(decode::<Amount>("base fee", &bytes)?),
                None => None,
            },
        };
        let state = State::from_parts(
            genesis,
            head,
            block.hash(),
            block.header.timestamp_ms,
            entries,
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

    fn commit(
        &self,
        block: &Block,
        changes: &ChangeSet,
        certificate: &Certificate,
    ) -> Result<(), StoreError> {
        let head = self.head()?;
        let height = block.header.height;
        if height != head + 1 {
            return Err(StoreError::OutOfOrder { head, got: height });
        }
        if certificate.height != height || certificate.block != block.hash() {
            return Err(StoreError::CertificateMismatch {
                height: certificate.height,
                certified: certificate.block,
            });
        }
        let mut batch = Batch::default();
        write_block(&mut batch, block, changes);
        batch.insert(
            key(CERTIFICATE, &height.to_be_bytes()),
            certificate.to_bytes(),
        );
        self.write(batch)
    }
}

/// Whether `kv` holds a chain at all.
fn holds_chain(kv: &impl KeyValue) -> Result<bool, StoreError> {
    Ok(kv.get(GENESIS)?.is_some())
}

/// Writes `genesis` and block 0 into an engine that holds no chain.
fn write_genesis(kv: &impl KeyValue, genesis: &Genesis) -> Result<(), StoreError> {
    let state = State::from_genesis(genesis.clone());
    let mut batch = Batch::default();
    batch.insert(GENESIS.to_vec(), genesis.to_json());
    batch.insert(FORMAT.to_vec(), [FORMAT_VERSION]);
    batch.insert(HISTORY_INDEXED.to_vec(), []);
    let changes = ChangeSet {
        accounts: state.accounts().map(|(a, acc)| (*a, acc.clone())).collect(),
        base_fee: genesis.params.fees.map(|_| state.base_fee()),
        ..ChangeSet::default()
    };
    write_block(&mut batch, &genesis_block(genesis), &changes);
    kv.write(batch)
}

/// Refuses a record written in another format than this build's (`path` names it).
fn check_format(kv: &impl KeyValue, path: &str) -> Result<(), StoreError> {
    let found = match kv.get(FORMAT)?.as_deref() {
        None => 1,
        Some([FORMAT_VERSION]) => return Ok(()),
        Some([other]) => *other,
        Some(_) => {
            return Err(StoreError::Corrupt(
                "the store format is not one byte".into(),
            ))
        }
    };
    Err(StoreError::OldFormat {
        path: path.to_string(),
        found,
    })
}

/// Refuses a record that holds another chain than `genesis`.
fn check_genesis(store: &dyn Storage, genesis: &Genesis) -> Result<(), StoreError> {
    let stored = store.genesis()?.hash();
    if stored != genesis.hash() {
        return Err(StoreError::GenesisMismatch {
            stored,
            given: genesis.hash(),
        });
    }
    Ok(())
}

/// Brings a record written before the account history index existed, or with the index per
/// transaction, up to date: the index per block is written and the old one removed.
fn index_history_if_missing(kv: &impl KeyValue) -> Result<(), StoreError> {
    const BLOCKS_PER_BATCH: u64 = 1_000;
    const REMOVALS_PER_BATCH: usize = 100_000;
    // An older build that opened the store since it was indexed writes the old index again
    // (and marks it): index anew then, or its blocks would be missing from the history.
    if kv.get(HISTORY_INDEXED)?.is_some() && kv.get(HISTORY_PER_TX_INDEXED)?.is_none() {
        return Ok(());
    }
    // The marker goes first and comes back last: a crash anywhere between leaves a store that
    // is indexed again when next opened. The old keys go in bounded batches; nothing reads
    // them.
    let mut unmark = Batch::default();
    unmark.remove(HISTORY_INDEXED.to_vec());
    kv.write(unmark)?;
    loop {
        let old: Vec<Vec<u8>> = scan_prefix(kv, HISTORY_PER_TX)
            .take(REMOVALS_PER_BATCH)
            .map(|entry| entry.map(|(k, _)| k))
            .collect::<Result<_, _>>()?;
        if old.is_empty() {
            break;
        }
        let mut batch = Batch::default();
        for key in old {
            batch.remove(key);
        }
        kv.write(batch)?;
    }
    let head = kv.head()?;
    let mut batch = Batch::default();
    batch.remove(HISTORY_PER_TX_INDEXED.to_vec());
    for height in 0..=head {
        let block = kv
            .block(height)?
            .ok_or_else(|| StoreError::Corrupt(format!("no block at height {height}")))?;
        write_history(&mut batch, &block);
        if height % BLOCKS_PER_BATCH == 0 {
            kv.write(std::mem::take(&mut batch))?;
        }
    }
    batch.insert(HISTORY_INDEXED.to_vec(), []);
    kv.write(batch)
}

fn write_block(batch: &mut Batch, block: &Block, changes: &ChangeSet) {
    let height = block.header.height;
    batch.insert(block_key(height), block.to_bytes());
    batch.insert(
        key(BLOCK_HASH, block.hash().as_bytes()),
        height.to_be_bytes(),
    );
    for (location, tx) in locations(block) {
        batch.insert(key(TX, tx.hash().as_bytes()), location.to_bytes());
    }
    write_history(batch, block);
    for (address, account) in &changes.accounts {
        batch.insert(
            key(ACCOUNT, address.as_bytes()),
            borsh::to_vec(account).unwrap_or_default(),
        );
    }
    for (meter, mark) in &changes.receipts {
        batch.insert(receipt_key(meter), borsh::to_vec(mark).unwrap_or_default());
    }
    for offer in &changes.offers {
        let value = borsh::to_vec(offer).unwrap_or_default();
        batch.insert(key(OFFER, &offer.id.to_be_bytes()), value);
    }
    for order in &changes.orders {
        let value = borsh::to_vec(order).unwrap_or_default();
        batch.insert(key(ORDER, &order.id.to_be_bytes()), value);
    }
    for placement in &changes.placements {
        let value = borsh::to_vec(placement).unwrap_or_default();
        batch.insert(key(PLACEMENT, &placement.id.to_be_bytes()), value);
    }
    if let Some(base_fee) = changes.base_fee {
        batch.insert(
            BASE_FEE.to_vec(),
            borsh::to_vec(&base_fee).unwrap_or_default(),
        );
    }
    batch.insert(HEAD.to_vec(), height.to_be_bytes());
}

fn write_history(batch: &mut Batch, block: &Block) {
    let mut indices: std::collections::BTreeMap<Address, Vec<u8>> = Default::default();
    for (location, tx) in locations(block) {
        for party in tx.tx.parties() {
            let listed = indices.entry(party).or_default();
            // A party twice in one transaction (a transfer to oneself is refused, but a
            // reporter may be the worker it reports) is listed once.
            if listed.get(listed.len().saturating_sub(4)..)
                != Some(&location.index.to_be_bytes()[..])
            {
                listed.extend(location.index.to_be_bytes());
            }
        }
    }
    let height = block.header.height.to_be_bytes();
    for (party, listed) in indices {
        batch.insert(history_key(&party, &height), listed);
    }
}

fn locations(block: &Block) -> impl Iterator<Item = (TxLocation, &SignedTx)> {
    let height = block.header.height;
    block.txs.iter().enumerate().map(move |(index, tx)| {
        let index = index as u32;
        (TxLocation { height, index }, tx)
    })
}

/// Every entry under `prefix` (which must not end in 0xff), in key order.
fn scan_prefix<'a>(kv: &'a impl KeyValue, prefix: &[u8]) -> Entries<'a> {
    let mut end = prefix.to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    kv.range(prefix, &end)
}

fn key(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    [prefix, rest].concat()
}

fn block_key(height: u64) -> Vec<u8> {
    key(BLOCK, &height.to_be_bytes())
}

/// Hub, session and (for traffic of an order only, so that keys written before orders
/// existed keep their meaning) the order.
fn receipt_key(meter: &MeterKey) -> Vec<u8> {
    let session = &meter.session;
    let mut rest = [
        session.hub.as_bytes().as_slice(),
        &session.session_id.to_be_bytes(),
    ]
    .concat();
    if meter.order != 0 {
        rest.extend_from_slice(&meter.order.to_be_bytes());
    }
    key(RECEIPT, &rest)
}

/// Every value under `prefix`, decoded.
fn scan_values<T: BorshDeserialize>(
    kv: &impl KeyValue,
    prefix: &[u8],
    what: &str,
) -> Result<Vec<T>, StoreError> {
    scan_prefix(kv, prefix)
        .map(|entry| decode(what, &entry?.1))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::produce_block;
    use crate::genesis::tests::{test_genesis, TestKeys};
    use crate::tx::check_stateless;
    use crate::tx::tests::transfer;

    /// Commits one block per entry of `blocks`, each holding exactly those transactions;
    /// returns the state after the last.
    pub(super) fn commit_blocks(
        store: &dyn Storage,
        keys: &TestKeys,
        blocks: &[Vec<SignedTx>],
    ) -> State {
        let mut state = store.load_state().unwrap();
        for txs in blocks {
            let checked: Vec<_> = check_stateless(state.genesis(), txs.clone())
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let timestamp = state.timestamp_ms() + 10;
            let produced = produce_block(&state, &checked, &keys.validator, timestamp).unwrap();
            assert!(produced.rejected.is_empty());
            let certificate = Certificate::for_block(&produced.block, 0, &[&keys.validator]);
            store
                .commit(&produced.block, &produced.changes, &certificate)
                .unwrap();
            state = produced.state;
        }
        state
    }

    /// Three blocks: alice pays bob twice, then nothing, then bob pays alice once.
    pub(super) fn three_blocks(keys: &TestKeys) -> [Vec<SignedTx>; 3] {
        [
            vec![
                transfer(&keys.alice, 0, keys.bob.address(), "1"),
                transfer(&keys.alice, 1, keys.bob.address(), "2"),
            ],
            vec![],
            vec![transfer(&keys.bob, 0, keys.alice.address(), "1")],
        ]
    }

    /// Where `three_blocks` puts bob's (and alice's) transactions, newest first.
    pub(super) fn three_blocks_history() -> Vec<TxLocation> {
        let at = |height, index| TxLocation { height, index };
        vec![at(3, 0), at(1, 1), at(1, 0)]
    }

    /// What every engine must do: commit in order, read back blocks, state and indexes.
    fn commits_and_reads_back(store: &dyn Storage, genesis: &Genesis, keys: &TestKeys) {
        assert_eq!(store.genesis().unwrap(), *genesis);
        assert_eq!(store.head().unwrap(), 0);
        assert_eq!(
            store.load_state().unwrap().root(),
            State::from_genesis(genesis.clone()).root()
        );
        let blocks = three_blocks(keys);
        let state = commit_blocks(store, keys, &blocks);
        assert_eq!(store.head().unwrap(), 3);
        let last = store.block(3).unwrap().unwrap();
        assert_eq!(last.hash(), state.block_hash());
        assert_eq!(store.block(4).unwrap(), None);
        // The same block again, or one skipping a height, is refused.
        let again = ChangeSet::default();
        let certificate = store.certificate(3).unwrap().unwrap();
        assert_eq!(certificate.block, last.hash());
        assert!(matches!(
            store.commit(&last, &again, &certificate),
            Err(StoreError::OutOfOrder { head: 3, got: 3 })
        ));
        assert_eq!(store.certificate(4).unwrap(), None);
        let loaded = store.load_state().unwrap();
        assert_eq!(loaded.root(), state.root());
        assert!(loaded.accounts().eq(state.accounts()));
        assert_eq!(store.height_of(&last.hash()).unwrap(), Some(3));
        assert_eq!(store.height_of(&Hash::ZERO).unwrap(), None);
        assert_eq!(
            store.tx_location(&blocks[0][1].hash()).unwrap(),
            Some(TxLocation {
                height: 1,
                index: 1
            })
        );
        assert_eq!(store.tx_location(&Hash::ZERO).unwrap(), None);
    }

    fn history_is_newest_first_and_pages(store: &dyn Storage, keys: &TestKeys) {
        commit_blocks(store, keys, &three_blocks(keys));
        let newest_first = three_blocks_history();
        let at = |height, index| TxLocation { height, index };
        let bob = keys.bob.address();
        assert_eq!(store.history(&bob, None, 10).unwrap(), newest_first);
        assert_eq!(
            store.history(&keys.alice.address(), None, 10).unwrap(),
            newest_first
        );
        assert_eq!(store.history(&bob, None, 2).unwrap(), newest_first[..2]);
        assert_eq!(store.history(&bob, None, 0).unwrap(), vec![]);
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
    }

    /// Runs `check` on a fresh record of the test genesis in each engine.
    fn on_every_engine(check: impl Fn(&dyn Storage, &Genesis, &TestKeys)) {
        let (genesis, keys) = test_genesis();
        check(&MemoryStore::new(&genesis).unwrap(), &genesis, &keys);
        let dir = tempfile::tempdir().unwrap();
        check(
            &SledStore::create(dir.path(), &genesis).unwrap(),
            &genesis,
            &keys,
        );
    }

    #[test]
    fn every_engine_commits_and_reads_back() {
        on_every_engine(commits_and_reads_back);
    }

    #[test]
    fn every_engine_indexes_account_history() {
        on_every_engine(|store, _, keys| history_is_newest_first_and_pages(store, keys));
    }
}
