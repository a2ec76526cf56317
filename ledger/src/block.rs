//! Blocks: a header signed by its proposer, and the transactions. The block hash is blake3
//! over the canonical header encoding; the header commits to the transactions (tx root),
//! the state after them (state root) and the previous block (prev hash).

use borsh::{BorshDeserialize, BorshSerialize};

use crate::genesis::Genesis;
use crate::hash::{merkle_root, Hash};
use crate::intent::{self, Intent};
use crate::keys::{Address, Keypair, Signature};
use crate::state::State;
use crate::tx::SignedTx;

pub use crate::limits::{BLOCK_OVERHEAD_BYTES, MAX_TIMESTAMP_MS};

#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct BlockHeader {
    pub chain_id: String,
    pub height: u64,
    pub prev_hash: Hash,
    pub timestamp_ms: u64,
    pub tx_root: Hash,
    pub state_root: Hash,
    pub proposer: Address,
}

impl BlockHeader {
    pub fn hash(&self) -> Hash {
        Hash::of_borsh(b"kvasir-block", self)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct Block {
    pub header: BlockHeader,
    pub signature: Signature,
    pub txs: Vec<SignedTx>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed block: {0}")]
pub struct MalformedBlock(pub String);

impl Block {
    pub fn hash(&self) -> Hash {
        self.header.hash()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        borsh::to_vec(self).unwrap_or_default()
    }

    /// Decodes canonical bytes, refusing anything over `max_bytes` or with trailing bytes.
    pub fn from_bytes(bytes: &[u8], max_bytes: u64) -> Result<Block, MalformedBlock> {
        if bytes.len() as u64 > max_bytes {
            return Err(MalformedBlock(format!(
                "{} bytes, over the {max_bytes}-byte limit",
                bytes.len()
            )));
        }
        borsh::from_slice(bytes).map_err(|e| MalformedBlock(e.to_string()))
    }

    pub fn tx_root(txs: &[SignedTx]) -> Hash {
        let hashes: Vec<Hash> = txs.iter().map(SignedTx::hash).collect();
        merkle_root(&hashes)
    }

    /// Builds and signs a block on top of `parent` whose transactions led to `state_root`.
    pub(crate) fn seal(
        parent: &State,
        txs: Vec<SignedTx>,
        state_root: Hash,
        timestamp_ms: u64,
        proposer: &Keypair,
    ) -> Block {
        let header = BlockHeader {
            chain_id: parent.chain_id().to_string(),
            height: parent.height() + 1,
            prev_hash: parent.block_hash(),
            timestamp_ms,
            tx_root: Block::tx_root(&txs),
            state_root,
            proposer: proposer.address(),
        };
        let signature = intent::sign(proposer, Intent::Block, &header.chain_id, &header);
        Block {
            header,
            signature,
            txs,
        }
    }
}

/// Block 0, derived from genesis alone: it has no proposer and no signature, and its
/// previous hash is the genesis hash, so it pins the chain to its genesis file.
pub fn genesis_block(genesis: &Genesis) -> Block {
    genesis_block_with_root(genesis, State::from_genesis(genesis.clone()).root())
}

pub(crate) fn genesis_block_with_root(genesis: &Genesis, state_root: Hash) -> Block {
    Block {
        header: BlockHeader {
            chain_id: genesis.chain_id(),
            height: 0,
            prev_hash: genesis.hash(),
            timestamp_ms: genesis.genesis_time_ms,
            tx_root: Block::tx_root(&[]),
            state_root,
            proposer: Address::from_bytes([0; 32]),
        },
        signature: Signature([0; 64]),
        txs: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::genesis::tests::test_genesis;
    use proptest::prelude::*;

    #[test]
    fn decoding_refuses_oversize_truncated_and_trailing_bytes() {
        let (genesis, _) = test_genesis();
        let bytes = genesis_block(&genesis).to_bytes();
        assert_eq!(
            Block::from_bytes(&bytes, 1 << 20).unwrap(),
            genesis_block(&genesis)
        );
        assert!(Block::from_bytes(&bytes, bytes.len() as u64 - 1).is_err());
        for cut in 0..bytes.len() {
            assert!(Block::from_bytes(&bytes[..cut], 1 << 20).is_err());
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(Block::from_bytes(&trailing, 1 << 20).is_err());
        // A transaction count far beyond the bytes present must fail, not allocate.
        let mut huge = bytes.clone();
        let count_at = huge.len() - 4;
        huge[count_at..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Block::from_bytes(&huge, 1 << 20).is_err());
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Block::from_bytes(&bytes, 1 << 20);
        }
    }
}
