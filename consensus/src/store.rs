//! Blocks proposed at heights not yet decided, kept on disk beside the engine's WAL.
//!
//! After a crash the engine replays its WAL and re-signs what it signed before; if it asks
//! for this node's proposal at a height again, it must get the very block it proposed, or
//! replay diverges and the node halts. So the block this node builds for a height is
//! written and fsynced before the engine hears of it, and reused for every round of that
//! height. Blocks received from proposers are kept too, so that a decision reached after a
//! restart finds the block it decided. Everything at or below the committed height goes.

use std::path::Path;

use borsh::{BorshDeserialize, BorshSerialize};
use kvasir_ledger::Hash;
use malachitebft_app_channel::app::types::core::{Round, Validity};
use malachitebft_app_channel::app::types::ProposedValue;

use crate::context::{Address, BlockId, Height, LedgerContext};

/// Distinct blocks kept for one (height, round): a proposer who equivocates gets two.
pub const MAX_PER_ROUND: usize = 2;
/// Blocks kept in all, across the few heights and rounds not yet decided; past it the
/// oldest round's go first.
pub const MAX_UNDECIDED: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("proposal store: {0}")]
    Sled(#[from] sled::Error),
    #[error("proposal store: {0}")]
    Open(#[from] kvasir_ledger::StoreError),
    #[error("proposal store holds an unreadable record: {0}")]
    Corrupt(#[from] std::io::Error),
}

#[derive(BorshSerialize, BorshDeserialize)]
struct Record {
    proposer: kvasir_ledger::Address,
    valid_round: Option<u32>,
    valid: bool,
    block: Vec<u8>,
}

/// One proposed block and what consensus needs to know of it.
pub struct Stored {
    pub value: ProposedValue<LedgerContext>,
    pub block: Vec<u8>,
}

pub struct Proposals {
    db: sled::Db,
    undecided: sled::Tree,
    own: sled::Tree,
}

fn height_key(height: Height) -> [u8; 8] {
    height.0.to_be_bytes()
}

fn round_key(height: Height, round: u32) -> [u8; 12] {
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&height.0.to_be_bytes());
    key[8..].copy_from_slice(&round.to_be_bytes());
    key
}

fn value_key(height: Height, round: u32, id: &BlockId) -> [u8; 44] {
    let mut key = [0u8; 44];
    key[..12].copy_from_slice(&round_key(height, round));
    key[12..].copy_from_slice(id.0.as_bytes());
    key
}

impl Proposals {
    pub fn open(path: &Path) -> Result<Proposals, StoreError> {
        // Opened as the ledger opens its own store, so it reopens after a kill the same way.
        let db = kvasir_ledger::store::open_sled(path)?;
        let undecided = db.open_tree("undecided")?;
        let own = db.open_tree("own")?;
        Ok(Proposals { db, undecided, own })
    }

    /// The block this node built for `height`, if it built one.
    pub fn own(&self, height: Height) -> Result<Option<(BlockId, Vec<u8>)>, StoreError> {
        let Some(bytes) = self.own.get(height_key(height))? else {
            return Ok(None);
        };
        let (id, block): ([u8; 32], Vec<u8>) = borsh::from_slice(&bytes)?;
        Ok(Some((BlockId(Hash(id)), block)))
    }

    /// Records the block this node built for `height`, durably, before it is proposed.
    pub fn put_own(&self, height: Height, id: BlockId, block: &[u8]) -> Result<(), StoreError> {
        let bytes = borsh::to_vec(&(id.0 .0, block))?;
        self.own.insert(height_key(height), bytes)?;
        self.db.flush()?;
        Ok(())
    }

    /// Keeps a proposed block, durably before the engine hears of it (its WAL will name the
    /// block, and a decision after a restart needs it), unless its round already holds
    /// `MAX_PER_ROUND` others or the store is full; whether it was kept (or already was).
    pub fn put(&self, stored: &Stored) -> Result<bool, StoreError> {
        let value = &stored.value;
        let Some(round) = value.round.as_u32() else {
            return Ok(false);
        };
        let key = value_key(value.height, round, &value.value);
        if self.undecided.contains_key(key)? {
            return Ok(true);
        }
        let in_round = self
            .undecided
            .scan_prefix(round_key(value.height, round))
            .count();
        if in_round >= MAX_PER_ROUND {
            return Ok(false);
        }
        // Full: the oldest round goes. A chain stalled for many rounds (too few validators
        // up) must still keep the proposals of the rounds that can decide when they return.
        while self.undecided.len() >= MAX_UNDECIDED {
            match self.undecided.first()? {
                Some((oldest, _)) if oldest.as_ref() < key.as_slice() => {
                    self.undecided.remove(oldest)?;
                }
                _ => return Ok(false),
            }
        }
        let record = Record {
            proposer: value.proposer.0,
            valid_round: value.valid_round.as_u32(),
            valid: value.validity.is_valid(),
            block: stored.block.clone(),
        };
        self.undecided.insert(key, borsh::to_vec(&record)?)?;
        self.db.flush()?;
        Ok(true)
    }

    /// The blocks proposed at (height, round).
    pub fn at(&self, height: Height, round: Round) -> Result<Vec<Stored>, StoreError> {
        let Some(r) = round.as_u32() else {
            return Ok(Vec::new());
        };
        self.undecided
            .scan_prefix(round_key(height, r))
            .map(|entry| {
                let (key, bytes) = entry?;
                decode(height, round, &key, &bytes)
            })
            .collect()
    }

    /// The block with id `id` proposed at `height`, in any round.
    pub fn find(&self, height: Height, id: &BlockId) -> Result<Option<Stored>, StoreError> {
        for entry in self.undecided.scan_prefix(height_key(height)) {
            let (key, bytes) = entry?;
            if key.len() == 44 && key[12..] == id.0 .0 {
                let mut round = [0u8; 4];
                round.copy_from_slice(&key[8..12]);
                let round = Round::new(u32::from_be_bytes(round));
                return decode(height, round, &key, &bytes).map(Some);
            }
        }
        Ok(None)
    }

    /// Forgets every block at or below `committed`.
    pub fn prune(&self, committed: Height) -> Result<(), StoreError> {
        let end = height_key(Height(committed.0.saturating_add(1)));
        for tree in [&self.undecided, &self.own] {
            let keys: Vec<_> = tree
                .range(..end)
                .keys()
                .collect::<Result<_, sled::Error>>()?;
            for key in keys {
                tree.remove(key)?;
            }
        }
        Ok(())
    }
}

fn decode(height: Height, round: Round, key: &[u8], bytes: &[u8]) -> Result<Stored, StoreError> {
    let record: Record = borsh::from_slice(bytes)?;
    let mut id = [0u8; 32];
    if key.len() == 44 {
        id.copy_from_slice(&key[12..]);
    }
    Ok(Stored {
        value: ProposedValue {
            height,
            round,
            valid_round: Round::from(record.valid_round),
            proposer: Address(record.proposer),
            value: BlockId(Hash(id)),
            validity: Validity::from_bool(record.valid),
        },
        block: record.block,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_devnet::crash::{self, Kills};
    use kvasir_ledger::Keypair;

    /// The block the crash test's child builds for `height`: its id and bytes, of a size
    /// that varies so that sled's segments fill unevenly.
    fn built(height: u64) -> (BlockId, Vec<u8>) {
        let block = vec![height as u8; 1000 + (height % 7) as usize * 3000];
        (BlockId(Hash(*blake3::hash(&block).as_bytes())), block)
    }

    /// The child of the crash test: builds its own block for each height, keeps it and a
    /// proposal received at the same height durably, reports `HEIGHT`, then prunes three
    /// heights behind, as a node committing every height does; until killed. It starts at
    /// the clock's microseconds, above every height an earlier child reached, as a node's
    /// heights only rise (the store's bound evicts the lowest first).
    #[test]
    #[ignore = "the child half of sigkill_at_random_instants_loses_no_durable_proposal"]
    fn crash_child_proposes_forever() {
        let Some(dir) = crash::child_dir() else {
            return;
        };
        let store = Proposals::open(&dir).unwrap();
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        for height in start.. {
            let (id, block) = built(height);
            store.put_own(Height(height), id, &block).unwrap();
            let mut received = stored(height, 0, height as u8);
            received.block = block;
            received.value.value = id;
            assert!(store.put(&received).unwrap());
            crash::report_durable(format_args!("{height}"));
            store.prune(Height(height.saturating_sub(3))).unwrap();
        }
    }

    /// Killed at random instants (`kvasir_devnet::crash`; 100 kills here), the proposal
    /// store reopens every time, and the blocks of the last three heights the child reported
    /// (those it had not pruned yet) are the very blocks it built, its own and received.
    #[test]
    fn sigkill_at_random_instants_loses_no_durable_proposal() {
        let mut kills = Kills::from_env("consensus proposals", 100);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proposals");
        for iteration in 0..kills.iterations {
            let reported = kills.kill_child("store::tests::crash_child_proposes_forever", &path);
            let store = match Proposals::open(&path) {
                Ok(store) => store,
                Err(e) => {
                    let kept = dir.keep().join("proposals");
                    panic!(
                        "iteration {iteration}: reopening failed: {e}; {}",
                        crash::listing(&kept)
                    )
                }
            };
            let reported: Vec<u64> = reported.iter().map(|h| h.parse().unwrap()).collect();
            let Some(&last) = reported.last() else {
                continue;
            };
            // The last three it reported, which it had not pruned yet.
            for &height in reported.iter().filter(|h| **h + 2 >= last) {
                let (id, block) = built(height);
                let own = store.own(Height(height)).unwrap();
                assert!(
                    own == Some((id, block.clone())),
                    "iteration {iteration}: the own block at {height} is lost or changed"
                );
                let found = store.find(Height(height), &id).unwrap();
                assert!(
                    found.is_some_and(|stored| stored.block == block),
                    "iteration {iteration}: the received block at {height} is lost or changed"
                );
            }
        }
        kills.assert_enough_after_writes();
    }

    fn stored(height: u64, round: u32, id: u8) -> Stored {
        Stored {
            value: ProposedValue {
                height: Height(height),
                round: Round::new(round),
                valid_round: Round::Nil,
                proposer: Address(Keypair::from_seed(&[1; 32]).address()),
                value: BlockId(Hash([id; 32])),
                validity: Validity::Valid,
            },
            block: vec![id; 10],
        }
    }

    #[test]
    fn proposals_survive_reopening_and_are_pruned_at_commit() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Proposals::open(dir.path()).unwrap();
            store
                .put_own(Height(3), BlockId(Hash([9; 32])), b"mine")
                .unwrap();
            assert!(store.put(&stored(3, 0, 1)).unwrap());
            assert!(store.put(&stored(3, 0, 1)).unwrap());
            assert!(store.put(&stored(3, 0, 2)).unwrap());
            assert!(!store.put(&stored(3, 0, 3)).unwrap());
            assert!(store.put(&stored(3, 1, 3)).unwrap());
            assert!(store.put(&stored(4, 0, 4)).unwrap());
        }
        let store = Proposals::open(dir.path()).unwrap();
        assert_eq!(
            store.own(Height(3)).unwrap(),
            Some((BlockId(Hash([9; 32])), b"mine".to_vec()))
        );
        let at = store.at(Height(3), Round::new(0)).unwrap();
        assert_eq!(at.len(), 2);
        assert_eq!(at[0].value, stored(3, 0, 1).value);
        let found = store
            .find(Height(3), &BlockId(Hash([3; 32])))
            .unwrap()
            .unwrap();
        assert_eq!(found.value, stored(3, 1, 3).value);
        assert_eq!(found.block, vec![3; 10]);

        store.prune(Height(3)).unwrap();
        assert!(store.own(Height(3)).unwrap().is_none());
        assert!(store.at(Height(3), Round::new(0)).unwrap().is_empty());
        assert!(store
            .find(Height(4), &BlockId(Hash([4; 32])))
            .unwrap()
            .is_some());
    }

    #[test]
    fn the_store_stays_bounded_and_keeps_the_newest_rounds() {
        let dir = tempfile::tempdir().unwrap();
        let store = Proposals::open(dir.path()).unwrap();
        // A height stalled for a hundred rounds: every new round's proposal is still kept.
        for round in 0..100 {
            assert!(
                store.put(&stored(5, round, round as u8)).unwrap(),
                "{round}"
            );
        }
        assert_eq!(store.undecided.len(), MAX_UNDECIDED);
        assert!(store.at(Height(5), Round::new(99)).unwrap().len() == 1);
        assert!(store.at(Height(5), Round::new(0)).unwrap().is_empty());
        // One older than everything kept makes no room for itself.
        assert!(!store.put(&stored(4, 0, 200)).unwrap());
        // An equivocating proposer gets two blocks in a round, not more.
        assert!(store.put(&stored(5, 99, 201)).unwrap());
        assert!(!store.put(&stored(5, 99, 202)).unwrap());
    }
}
