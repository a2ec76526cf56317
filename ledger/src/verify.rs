//! Re-verification: replays a stored chain from genesis, checking every hash link,
//! signature, transaction root and state root, and every block's commit certificate against
//! the genesis validator set, then compares the stored state with the replay. What a validator runs to trust nothing it did not check itself: given the genesis
//! it trusts, it also refuses a store that holds another chain (a store's own genesis proves
//! nothing about which chain it is).

use crate::apply::apply_block;
use crate::block::{genesis_block, Block};
use crate::certificate::Certificate;
use crate::genesis::Genesis;
use crate::hash::Hash;
use std::sync::Arc;

use crate::state::{AnswerCheck, State};
use crate::store::{Storage, StoreError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Blocks checked after block 0.
    pub blocks: u64,
    pub transactions: u64,
    pub head_hash: Hash,
    pub state_root: Hash,
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the store holds the chain of genesis {stored}, not the genesis given ({given})")]
    GenesisMismatch { stored: Hash, given: Hash },
    #[error("block {height} is bad: {reason}")]
    BadBlock { height: u64, reason: String },
    #[error("stored state differs from the replay of the chain at height {height}")]
    StateMismatch { height: u64 },
}

/// Replays the whole chain in `store`, first checking that it is the chain of `trusted`
/// when given (without, the store's own genesis is taken on trust). Evidence in it is
/// recomputed with `answers` (without, a chain holding evidence does not verify).
/// `progress(done, total)` is called after each block.
pub fn verify_chain(
    store: &dyn Storage,
    trusted: Option<&Genesis>,
    answers: Option<Arc<dyn AnswerCheck>>,
    mut progress: impl FnMut(u64, u64),
) -> Result<VerifyReport, VerifyError> {
    let genesis = store.genesis()?;
    if let Some(trusted) = trusted {
        if genesis.hash() != trusted.hash() {
            return Err(VerifyError::GenesisMismatch {
                stored: genesis.hash(),
                given: trusted.hash(),
            });
        }
    }
    let head = store.head()?;
    let bad = |height, reason: String| VerifyError::BadBlock { height, reason };
    let expected_zero = genesis_block(&genesis).to_bytes();
    if store.block_bytes(0)?.as_deref() != Some(expected_zero.as_slice()) {
        return Err(bad(0, "block 0 does not match the stored genesis".into()));
    }
    let max_bytes = genesis.params.max_block_bytes;
    let mut state = State::from_genesis(genesis.clone());
    if let Some(answers) = answers {
        state = state.with_answer_check(answers);
    }
    let mut transactions = 0u64;
    for height in 1..=head {
        let bytes = store
            .block_bytes(height)?
            .ok_or_else(|| bad(height, "missing".into()))?;
        let block = Block::from_bytes(&bytes, max_bytes).map_err(|e| bad(height, e.to_string()))?;
        let (next, _) = apply_block(&state, &block).map_err(|e| bad(height, e.to_string()))?;
        let certificate = store
            .certificate_bytes(height)?
            .ok_or_else(|| bad(height, "no commit certificate is stored for it".into()))?;
        Certificate::from_bytes(&certificate, &genesis)
            .and_then(|c| c.verify(&genesis, height, &block.hash()))
            .map_err(|e| bad(height, e.to_string()))?;
        if store.height_of(&block.hash())? != Some(height) {
            return Err(bad(
                height,
                "block hash index does not point at this block".into(),
            ));
        }
        transactions += block.txs.len() as u64;
        state = next;
        progress(height, head);
    }
    let stored = store
        .load_state()
        .map_err(|_| VerifyError::StateMismatch { height: head })?;
    let same_accounts = stored.accounts().eq(state.accounts());
    let same_receipts = stored.receipts().eq(state.receipts());
    if stored.root() != state.root() || !same_accounts || !same_receipts {
        return Err(VerifyError::StateMismatch { height: head });
    }
    Ok(VerifyReport {
        blocks: head,
        transactions,
        head_hash: state.block_hash(),
        state_root: state.root(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::genesis::tests::test_genesis;
    use crate::store::MemoryStore;

    #[test]
    fn every_block_needs_a_certificate_of_the_genesis_validators() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis.clone());
        let produced = crate::apply::produce_block(&state, &[], &keys.validator, 10).unwrap();
        let verify = |signer: &crate::Keypair| {
            let store = MemoryStore::new(&genesis).unwrap();
            let certificate = Certificate::for_block(&produced.block, 0, &[signer]);
            store
                .commit(&produced.block, &produced.changes, &certificate)
                .unwrap();
            verify_chain(&store, Some(&genesis), None, |_, _| {})
        };
        assert_eq!(verify(&keys.validator).unwrap().blocks, 1);
        match verify(&keys.alice) {
            Err(VerifyError::BadBlock { height: 1, reason }) => {
                assert!(reason.contains("not a validator"), "{reason}")
            }
            other => panic!("expected a bad certificate, got {other:?}"),
        }
    }

    #[test]
    fn a_certificate_short_of_a_quorum_or_with_a_forged_precommit_fails() {
        let (genesis, keys) = crate::certificate::tests::validators(4);
        let state = State::from_genesis(genesis.clone());
        let produced = crate::apply::produce_block(&state, &[], &keys[0], 10).unwrap();
        let verify = |certificate: &Certificate| {
            let store = MemoryStore::new(&genesis).unwrap();
            store
                .commit(&produced.block, &produced.changes, certificate)
                .unwrap();
            match verify_chain(&store, Some(&genesis), None, |_, _| {}) {
                Ok(report) => Ok(report.blocks),
                Err(VerifyError::BadBlock { height: 1, reason }) => Err(reason),
                Err(other) => panic!("expected a bad block, got {other:?}"),
            }
        };
        let three = [&keys[0], &keys[1], &keys[2]];
        assert_eq!(
            verify(&Certificate::for_block(&produced.block, 0, &three)),
            Ok(1)
        );
        let two = Certificate::for_block(&produced.block, 0, &three[..2]);
        assert!(verify(&two).unwrap_err().contains("2 of 4 votes"));
        let mut forged = Certificate::for_block(&produced.block, 0, &three);
        forged.signatures[2].signature.0[0] ^= 1;
        assert!(verify(&forged).unwrap_err().contains("does not verify"));
    }

    /// A format-1 chain verifies by its rules (blocks signed under its name, as every test
    /// on `test_genesis` does), a format-2 chain by its own: a block signed under the name
    /// alone does not verify there.
    #[test]
    fn a_format_2_block_is_signed_for_the_name_and_genesis_hash() {
        let (genesis, keys) = crate::genesis::tests::test_genesis_v2();
        let state = State::from_genesis(genesis.clone());
        let produced = crate::apply::produce_block(&state, &[], &keys.validator, 10).unwrap();
        assert_eq!(produced.block.header.chain_id, genesis.chain_id());
        let verify = |block: &crate::Block| {
            let store = MemoryStore::new(&genesis).unwrap();
            let certificate = Certificate::for_block(block, 0, &[&keys.validator]);
            store
                .commit(block, &produced.changes, &certificate)
                .unwrap();
            verify_chain(&store, Some(&genesis), None, |_, _| {})
        };
        assert_eq!(verify(&produced.block).unwrap().blocks, 1);
        let mut by_name = produced.block.clone();
        by_name.signature = crate::intent::sign(
            &keys.validator,
            crate::intent::Intent::Block,
            &genesis.params.chain_id,
            &by_name.header,
        );
        match verify(&by_name) {
            Err(VerifyError::BadBlock { height: 1, reason }) => {
                assert!(reason.contains("signature"), "{reason}")
            }
            other => panic!("expected a bad signature, got {other:?}"),
        }
    }

    #[test]
    fn a_store_of_another_genesis_is_refused_when_one_is_given() {
        let (genesis, _) = test_genesis();
        let store = MemoryStore::new(&genesis).unwrap();
        assert_eq!(
            verify_chain(&store, Some(&genesis), None, |_, _| {})
                .unwrap()
                .blocks,
            0
        );
        assert!(verify_chain(&store, None, None, |_, _| {}).is_ok());
        let mut other = genesis.clone();
        other.genesis_time_ms += 1;
        match verify_chain(&store, Some(&other), None, |_, _| {}) {
            Err(VerifyError::GenesisMismatch { stored, given }) => {
                assert_eq!((stored, given), (genesis.hash(), other.hash()));
            }
            other => panic!("expected a genesis mismatch, got {other:?}"),
        }
    }
}
