//! Votes and commit certificates: what validators sign while they agree on a block, and the
//! proof that more than 2/3 of the voting power named in genesis committed it.
//!
//! The consensus engine (Malachite) defines no signed bytes of its own; the preimages are
//! ours, intent-prefixed like every other signature (`Intent::Vote`, `Intent::Proposal`), so
//! a vote never verifies as a transaction, a block or a vote on another chain. Because they
//! are ours, anyone holding the blocks can check every certificate with this module alone
//! (`verify-chain`, a full node), without the engine.
//!
//! Voting power: every validator named in genesis has one vote.

use std::collections::BTreeSet;

use borsh::{BorshDeserialize, BorshSerialize};

use crate::block::Block;
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::intent::{self, Intent};
use crate::keys::{Address, Keypair, Signature};

/// Which of Tendermint's two votes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, BorshSerialize, BorshDeserialize)]
#[borsh(use_discriminant = true)]
#[repr(u8)]
pub enum VoteKind {
    Prevote = 0,
    Precommit = 1,
}

/// What a validator signs when it votes: for a block, or for none (`block: None`, nil), at
/// one height and round. The voter is the key that signs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, BorshSerialize, BorshDeserialize)]
pub struct Vote {
    pub kind: VoteKind,
    pub height: u64,
    pub round: u32,
    pub block: Option<Hash>,
}

impl Vote {
    pub fn sign(&self, chain_id: &str, validator: &Keypair) -> Signature {
        intent::sign(validator, Intent::Vote, chain_id, self)
    }

    pub fn verify(&self, chain_id: &str, voter: &Address, signature: &Signature) -> bool {
        intent::verify(voter, Intent::Vote, chain_id, self, signature).is_ok()
    }
}

/// What a proposer signs for its proposal of `block` at (height, round); `pol_round` is the
/// round of the proof-of-lock it re-proposes under, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, BorshSerialize, BorshDeserialize)]
pub struct Proposal {
    pub height: u64,
    pub round: u32,
    pub pol_round: Option<u32>,
    pub block: Hash,
}

impl Proposal {
    pub fn sign(&self, chain_id: &str, proposer: &Keypair) -> Signature {
        intent::sign(proposer, Intent::Proposal, chain_id, self)
    }

    pub fn verify(&self, chain_id: &str, proposer: &Address, signature: &Signature) -> bool {
        intent::verify(proposer, Intent::Proposal, chain_id, self, signature).is_ok()
    }
}

/// What a proposer signs on the block it streams for its proposal at (height, round)
/// (re-proposing under a proof-of-lock from `pol_round`, if any): the blake3 of the block's
/// bytes. The stream itself is not signed by the engine, so without this seal anyone could
/// stream blocks in the proposer's name and crowd out its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, BorshSerialize, BorshDeserialize)]
pub struct StreamedBlock {
    pub height: u64,
    pub round: u32,
    pub pol_round: Option<u32>,
    pub digest: Hash,
}

impl StreamedBlock {
    pub fn new(height: u64, round: u32, pol_round: Option<u32>, block: &[u8]) -> StreamedBlock {
        StreamedBlock {
            height,
            round,
            pol_round,
            digest: Hash::of_parts(&[block]),
        }
    }

    pub fn sign(&self, chain_id: &str, proposer: &Keypair) -> Signature {
        intent::sign(proposer, Intent::StreamedBlock, chain_id, self)
    }

    pub fn verify(&self, chain_id: &str, proposer: &Address, signature: &Signature) -> bool {
        intent::verify(proposer, Intent::StreamedBlock, chain_id, self, signature).is_ok()
    }
}

/// One validator's precommit in a certificate.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct CommitSignature {
    pub validator: Address,
    pub signature: Signature,
}

/// The proof that a block was committed: precommits for `block` at (`height`, `round`) from
/// more than 2/3 of the voting power, each validator at most once, in ascending address
/// order (one certificate has one encoding).
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct Certificate {
    pub height: u64,
    pub round: u32,
    pub block: Hash,
    pub signatures: Vec<CommitSignature>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    #[error("the certificate is for height {got}, not {expected}")]
    WrongHeight { expected: u64, got: u64 },
    #[error("the certificate commits block {got}, not {expected}")]
    WrongBlock { expected: Hash, got: Hash },
    #[error("{0} signed the certificate but is not a validator of this chain")]
    NotAValidator(Address),
    #[error("the certificate's signatures are not in ascending validator order, or one signed twice ({0})")]
    Unordered(Address),
    #[error("{0}'s precommit signature does not verify")]
    BadSignature(Address),
    #[error("the certificate carries {signed} of {total} votes; more than 2/3 are needed")]
    NotEnoughPower { signed: u64, total: u64 },
    #[error("malformed certificate: {0}")]
    Malformed(String),
}

/// The validator set of a chain: who votes, with what power.
pub struct ValidatorSet<'a> {
    genesis: &'a Genesis,
}

impl<'a> ValidatorSet<'a> {
    pub fn of(genesis: &'a Genesis) -> Self {
        ValidatorSet { genesis }
    }

    /// Validators in ascending address order with their voting power.
    pub fn members(&self) -> Vec<(Address, u64)> {
        let members: BTreeSet<Address> = self
            .genesis
            .authorities
            .validators
            .iter()
            .copied()
            .collect();
        members.into_iter().map(|a| (a, 1)).collect()
    }

    pub fn power_of(&self, who: &Address) -> Option<u64> {
        self.genesis.is_validator(who).then_some(1)
    }

    pub fn total_power(&self) -> u64 {
        self.members().iter().map(|(_, p)| p).sum()
    }

    /// Whether `signed` of the total is more than 2/3 of it (`3·signed > 2·total`, in u128
    /// so no sum overflows).
    pub fn is_quorum(&self, signed: u64) -> bool {
        3 * u128::from(signed) > 2 * u128::from(self.total_power())
    }
}

impl Certificate {
    /// The certificate `signers` make by precommitting `block` at (`height`, `round`) on
    /// chain `chain_id`, in canonical order.
    pub fn signed_by(
        chain_id: &str,
        height: u64,
        round: u32,
        block: Hash,
        signers: &[&Keypair],
    ) -> Certificate {
        let vote = Vote {
            kind: VoteKind::Precommit,
            height,
            round,
            block: Some(block),
        };
        let mut signatures: Vec<CommitSignature> = signers
            .iter()
            .map(|key| CommitSignature {
                validator: key.address(),
                signature: vote.sign(chain_id, key),
            })
            .collect();
        signatures.sort_by_key(|s| s.validator);
        signatures.dedup_by_key(|s| s.validator);
        Certificate {
            height,
            round,
            block,
            signatures,
        }
    }

    /// Checks that this certificate commits `block` at `height` on the chain of `genesis`:
    /// every signer a validator, once, in order, its precommit signature valid, and together
    /// more than 2/3 of the voting power. Returns the power that signed.
    pub fn verify(
        &self,
        genesis: &Genesis,
        height: u64,
        block: &Hash,
    ) -> Result<u64, CertificateError> {
        if self.height != height {
            return Err(CertificateError::WrongHeight {
                expected: height,
                got: self.height,
            });
        }
        if self.block != *block {
            return Err(CertificateError::WrongBlock {
                expected: *block,
                got: self.block,
            });
        }
        let set = ValidatorSet::of(genesis);
        let vote = Vote {
            kind: VoteKind::Precommit,
            height: self.height,
            round: self.round,
            block: Some(self.block),
        };
        let chain_id = &genesis.chain_id();
        let mut signed = 0u64;
        let mut previous: Option<Address> = None;
        for CommitSignature {
            validator,
            signature,
        } in &self.signatures
        {
            if previous.is_some_and(|p| p >= *validator) {
                return Err(CertificateError::Unordered(*validator));
            }
            previous = Some(*validator);
            let power = set
                .power_of(validator)
                .ok_or(CertificateError::NotAValidator(*validator))?;
            if !vote.verify(chain_id, validator, signature) {
                return Err(CertificateError::BadSignature(*validator));
            }
            signed = signed.saturating_add(power);
        }
        if !set.is_quorum(signed) {
            return Err(CertificateError::NotEnoughPower {
                signed,
                total: set.total_power(),
            });
        }
        Ok(signed)
    }

    /// The certificate `signers` make for `block` at `round`.
    pub fn for_block(block: &Block, round: u32, signers: &[&Keypair]) -> Certificate {
        let header = &block.header;
        Certificate::signed_by(
            &header.chain_id,
            header.height,
            round,
            block.hash(),
            signers,
        )
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        borsh::to_vec(self).unwrap_or_default()
    }

    /// Decodes canonical bytes; a certificate of `genesis` has at most one signature per
    /// validator, so anything longer is refused before it is allocated.
    pub fn from_bytes(bytes: &[u8], genesis: &Genesis) -> Result<Certificate, CertificateError> {
        const FIXED: usize = 8 + 4 + 32 + 4;
        const PER_SIGNATURE: usize = 32 + 64;
        let most = FIXED + PER_SIGNATURE * genesis.authorities.validators.len();
        if bytes.len() > most {
            return Err(CertificateError::Malformed(format!(
                "{} bytes, more than this chain's {most}",
                bytes.len()
            )));
        }
        borsh::from_slice(bytes).map_err(|e| CertificateError::Malformed(e.to_string()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::genesis::tests::test_genesis;
    use proptest::prelude::*;

    /// The test genesis with `n` validators (seeds 100..), and their keys in address order.
    pub(crate) fn validators(n: u8) -> (Genesis, Vec<Keypair>) {
        let (mut genesis, _) = test_genesis();
        let mut keys: Vec<Keypair> = (0..n).map(|i| Keypair::from_seed(&[100 + i; 32])).collect();
        keys.sort_by_key(Keypair::address);
        genesis.authorities.validators = keys.iter().map(Keypair::address).collect();
        (genesis, keys)
    }

    fn certify(genesis: &Genesis, signers: &[&Keypair], height: u64, block: Hash) -> Certificate {
        Certificate::signed_by(&genesis.chain_id(), height, 0, block, signers)
    }

    #[test]
    fn three_of_four_commit_and_two_do_not() {
        let (genesis, keys) = validators(4);
        let block = Hash([9; 32]);
        let three = certify(&genesis, &[&keys[0], &keys[2], &keys[3]], 5, block);
        assert_eq!(three.verify(&genesis, 5, &block), Ok(3));
        let two = certify(&genesis, &[&keys[0], &keys[1]], 5, block);
        assert_eq!(
            two.verify(&genesis, 5, &block),
            Err(CertificateError::NotEnoughPower {
                signed: 2,
                total: 4
            })
        );
        // One validator of one: its own vote is the quorum.
        let (alone, key) = validators(1);
        assert!(certify(&alone, &[&key[0]], 1, block)
            .verify(&alone, 1, &block)
            .is_ok());
    }

    #[test]
    fn a_forged_duplicated_foreign_or_misplaced_signature_fails() {
        let (genesis, keys) = validators(4);
        let block = Hash([9; 32]);
        let good = certify(&genesis, &[&keys[0], &keys[1], &keys[2]], 5, block);
        assert!(good.verify(&genesis, 5, &block).is_ok());

        let mut forged = good.clone();
        forged.signatures[1].signature.0[0] ^= 1;
        assert_eq!(
            forged.verify(&genesis, 5, &block),
            Err(CertificateError::BadSignature(keys[1].address()))
        );

        // One validator counted three times is still one vote.
        let mut repeated = good.clone();
        repeated.signatures = vec![good.signatures[0].clone(); 3];
        assert_eq!(
            repeated.verify(&genesis, 5, &block),
            Err(CertificateError::Unordered(keys[0].address()))
        );

        let stranger = Keypair::from_seed(&[250; 32]);
        let foreign = certify(&genesis, &[&keys[0], &keys[1], &stranger], 5, block);
        assert_eq!(
            foreign.verify(&genesis, 5, &block),
            Err(CertificateError::NotAValidator(stranger.address()))
        );

        assert!(matches!(
            good.verify(&genesis, 6, &block),
            Err(CertificateError::WrongHeight { .. })
        ));
        assert!(matches!(
            good.verify(&genesis, 5, &Hash([8; 32])),
            Err(CertificateError::WrongBlock { .. })
        ));

        // A prevote, or a precommit at another round, is not a precommit for this one.
        let mut prevotes = good.clone();
        for (sig, key) in prevotes.signatures.iter_mut().zip(&keys) {
            let vote = Vote {
                kind: VoteKind::Prevote,
                height: 5,
                round: 0,
                block: Some(block),
            };
            sig.signature = vote.sign(&genesis.chain_id(), key);
        }
        assert!(matches!(
            prevotes.verify(&genesis, 5, &block),
            Err(CertificateError::BadSignature(_))
        ));
        let mut later = good.clone();
        later.round = 1;
        assert!(matches!(
            later.verify(&genesis, 5, &block),
            Err(CertificateError::BadSignature(_))
        ));

        // Another chain's validators signing the same block prove nothing here.
        let mut other = genesis.clone();
        other.params.chain_id = "kvasir-other".into();
        let elsewhere = certify(&other, &[&keys[0], &keys[1], &keys[2]], 5, block);
        assert!(matches!(
            elsewhere.verify(&genesis, 5, &block),
            Err(CertificateError::BadSignature(_))
        ));
    }

    #[test]
    fn a_vote_does_not_verify_as_a_proposal() {
        let key = Keypair::from_seed(&[7; 32]);
        let vote = Vote {
            kind: VoteKind::Precommit,
            height: 1,
            round: 0,
            block: Some(Hash([1; 32])),
        };
        let signature = vote.sign("c", &key);
        assert!(vote.verify("c", &key.address(), &signature));
        let proposal = Proposal {
            height: 1,
            round: 0,
            pol_round: None,
            block: Hash([1; 32]),
        };
        assert!(!proposal.verify("c", &key.address(), &signature));
        assert!(proposal.verify("c", &key.address(), &proposal.sign("c", &key)));
        // A seal binds the stream's height, round, lock round and bytes.
        let seal = StreamedBlock::new(1, 0, None, b"block");
        let sealed = seal.sign("c", &key);
        assert!(seal.verify("c", &key.address(), &sealed));
        assert!(!StreamedBlock::new(1, 0, None, b"other").verify("c", &key.address(), &sealed));
        assert!(!StreamedBlock::new(1, 0, Some(0), b"block").verify("c", &key.address(), &sealed));
        assert!(!proposal.verify("c", &key.address(), &sealed));
    }

    #[test]
    fn decoding_refuses_more_signatures_than_validators() {
        let (genesis, keys) = validators(4);
        let block = Hash([9; 32]);
        let good = certify(
            &genesis,
            &[&keys[0], &keys[1], &keys[2], &keys[3]],
            5,
            block,
        );
        let bytes = good.to_bytes();
        assert_eq!(Certificate::from_bytes(&bytes, &genesis), Ok(good.clone()));
        let mut padded = good.clone();
        padded.signatures.push(good.signatures[0].clone());
        assert!(Certificate::from_bytes(&padded.to_bytes(), &genesis).is_err());
        let mut huge = bytes.clone();
        huge[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Certificate::from_bytes(&huge, &genesis).is_err());
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let (genesis, _) = validators(4);
            let _ = Certificate::from_bytes(&bytes, &genesis);
        }
    }
}
