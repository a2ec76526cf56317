//! The ledger as Malachite sees it: the types its `Context` names. They are thin wrappers
//! over the ledger's own (a height is a block height, an address a validator's key), because
//! the engine's traits cannot be implemented on another crate's types.
//!
//! The value consensus agrees on is only a block's id: it travels inside every signed
//! proposal, so it stays 32 bytes, and the block itself travels beside it as proposal parts
//! (`parts`). Signatures are the ledger's own (`signing`), so the signing scheme here is
//! our key and signature types, not a second ed25519 binding.

use std::cmp::Ordering;
use std::fmt;

use kvasir_ledger::certificate;
use kvasir_ledger::keys::Signature;
use kvasir_ledger::{Genesis, Hash, Keypair};
use malachitebft_app_channel::app::types::core::{
    self as core, LinearTimeouts, NilOrVal, Round, SignedExtension, VoteType, VotingPower,
};

use crate::parts::ProposalPart;

/// A block height; 0 is genesis, consensus starts at 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Height(pub u64);

impl fmt::Display for Height {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl core::Height for Height {
    const ZERO: Self = Height(0);
    const INITIAL: Self = Height(1);

    fn increment_by(&self, n: u64) -> Self {
        Height(self.0.saturating_add(n))
    }

    fn decrement_by(&self, n: u64) -> Option<Self> {
        self.0.checked_sub(n).map(Height)
    }

    fn as_u64(&self) -> u64 {
        self.0
    }
}

/// A validator: its ed25519 public key, as the ledger names accounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Address(pub kvasir_ledger::Address);

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl core::Address for Address {}

/// What consensus decides: the id (hash) of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub Hash);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl core::Value for BlockId {
    type Id = BlockId;

    fn id(&self) -> BlockId {
        *self
    }
}

/// A proposer's proposal of a block at (height, round), re-proposed under the proof-of-lock
/// of `pol_round` when that is not nil.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proposal {
    pub height: Height,
    pub round: Round,
    pub value: BlockId,
    pub pol_round: Round,
    pub proposer: Address,
}

impl core::Proposal<LedgerContext> for Proposal {
    fn height(&self) -> Height {
        self.height
    }

    fn round(&self) -> Round {
        self.round
    }

    fn value(&self) -> &BlockId {
        &self.value
    }

    fn take_value(self) -> BlockId {
        self.value
    }

    fn pol_round(&self) -> Round {
        self.pol_round
    }

    fn validator_address(&self) -> &Address {
        &self.proposer
    }
}

/// A prevote or precommit. Vote extensions are disabled on this chain, so a vote carries
/// none and drops one it is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vote {
    pub vote_type: VoteType,
    pub height: Height,
    pub round: Round,
    pub value: NilOrVal<BlockId>,
    pub validator: Address,
}

impl core::Vote<LedgerContext> for Vote {
    fn height(&self) -> Height {
        self.height
    }

    fn round(&self) -> Round {
        self.round
    }

    fn value(&self) -> &NilOrVal<BlockId> {
        &self.value
    }

    fn take_value(self) -> NilOrVal<BlockId> {
        self.value
    }

    fn vote_type(&self) -> VoteType {
        self.vote_type
    }

    fn validator_address(&self) -> &Address {
        &self.validator
    }

    fn extension(&self) -> Option<&SignedExtension<LedgerContext>> {
        None
    }

    fn take_extension(&mut self) -> Option<SignedExtension<LedgerContext>> {
        None
    }

    fn extend(self, _extension: SignedExtension<LedgerContext>) -> Self {
        self
    }
}

/// A validator with its voting power; its public key is its address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Validator {
    pub address: Address,
    pub power: VotingPower,
}

impl core::Validator<LedgerContext> for Validator {
    fn address(&self) -> &Address {
        &self.address
    }

    fn public_key(&self) -> &kvasir_ledger::Address {
        &self.address.0
    }

    fn voting_power(&self) -> VotingPower {
        self.power
    }
}

/// The validators of a height, in ascending address order (never empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidatorSet {
    validators: Vec<Validator>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("genesis names no validator")]
pub struct NoValidators;

impl ValidatorSet {
    /// The validators genesis names, with the power the ledger gives them
    /// (`certificate::ValidatorSet`), so the engine counts quorums as certificates do.
    pub fn from_genesis(genesis: &Genesis) -> Result<ValidatorSet, NoValidators> {
        let validators: Vec<Validator> = certificate::ValidatorSet::of(genesis)
            .members()
            .into_iter()
            .map(|(address, power)| Validator {
                address: Address(address),
                power,
            })
            .collect();
        if validators.is_empty() {
            return Err(NoValidators);
        }
        Ok(ValidatorSet { validators })
    }

    #[cfg(test)]
    pub fn validators(&self) -> &[Validator] {
        &self.validators
    }
}

impl core::ValidatorSet<LedgerContext> for ValidatorSet {
    fn count(&self) -> usize {
        self.validators.len()
    }

    fn total_voting_power(&self) -> VotingPower {
        self.validators
            .iter()
            .fold(0u64, |sum, v| sum.saturating_add(v.power))
    }

    fn get_by_address(&self, address: &Address) -> Option<&Validator> {
        self.validators
            .binary_search_by(|v| v.address.cmp(address))
            .ok()
            .map(|i| &self.validators[i])
    }

    fn get_by_index(&self, index: usize) -> Option<&Validator> {
        self.validators.get(index)
    }
}

/// A signature as consensus carries it: the ledger's, ordered by its bytes because the
/// engine keeps signatures in ordered sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsensusSignature(pub Signature);

impl PartialOrd for ConsensusSignature {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ConsensusSignature {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0 .0.cmp(&other.0 .0)
    }
}

/// Our ed25519 keys and signatures, under the ledger's verification rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerSigning;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected {expected} bytes, got {got}")]
pub struct WrongLength {
    pub expected: usize,
    pub got: usize,
}

impl core::SigningScheme for LedgerSigning {
    type DecodingError = WrongLength;
    type Signature = ConsensusSignature;
    type PublicKey = kvasir_ledger::Address;
    type PrivateKey = Keypair;

    fn decode_signature(bytes: &[u8]) -> Result<ConsensusSignature, WrongLength> {
        let array: [u8; 64] = bytes.try_into().map_err(|_| WrongLength {
            expected: 64,
            got: bytes.len(),
        })?;
        Ok(ConsensusSignature(Signature(array)))
    }

    fn encode_signature(signature: &ConsensusSignature) -> Vec<u8> {
        signature.0 .0.to_vec()
    }

    fn decode_public_key(bytes: &[u8]) -> Result<kvasir_ledger::Address, WrongLength> {
        let array: [u8; 32] = bytes.try_into().map_err(|_| WrongLength {
            expected: 32,
            got: bytes.len(),
        })?;
        Ok(kvasir_ledger::Address::from_bytes(array))
    }

    fn encode_public_key(public_key: &kvasir_ledger::Address) -> Vec<u8> {
        public_key.as_bytes().to_vec()
    }
}

/// The ledger's consensus context. It holds nothing: the validator set travels in each
/// height's parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerContext;

impl core::Context for LedgerContext {
    type Address = Address;
    type Height = Height;
    type ProposalPart = ProposalPart;
    type Proposal = Proposal;
    type Validator = Validator;
    type ValidatorSet = ValidatorSet;
    type Timeouts = LinearTimeouts;
    type Value = BlockId;
    type Vote = Vote;
    type Extension = ();
    type SigningScheme = LedgerSigning;

    /// Round-robin over the address-ordered set: the proposer of (h, r) is validator
    /// `(h + r) mod n`. Every node computes the same from genesis alone, and each new round
    /// moves to the next validator, so a silent or rejected proposer costs one round.
    fn select_proposer<'a>(
        &self,
        validator_set: &'a ValidatorSet,
        height: Height,
        round: Round,
    ) -> &'a Validator {
        proposer_of(validator_set, height, round)
    }

    fn new_proposal(
        &self,
        height: Height,
        round: Round,
        value: BlockId,
        pol_round: Round,
        address: Address,
    ) -> Proposal {
        Proposal {
            height,
            round,
            value,
            pol_round,
            proposer: address,
        }
    }

    fn new_prevote(
        &self,
        height: Height,
        round: Round,
        value_id: NilOrVal<BlockId>,
        address: Address,
    ) -> Vote {
        Vote {
            vote_type: VoteType::Prevote,
            height,
            round,
            value: value_id,
            validator: address,
        }
    }

    fn new_precommit(
        &self,
        height: Height,
        round: Round,
        value_id: NilOrVal<BlockId>,
        address: Address,
    ) -> Vote {
        Vote {
            vote_type: VoteType::Precommit,
            height,
            round,
            value: value_id,
            validator: address,
        }
    }
}

/// The proposer of (height, round); a nil round counts as round 0.
pub fn proposer_of(validator_set: &ValidatorSet, height: Height, round: Round) -> &Validator {
    // `from_genesis` never builds an empty set, so the index is always in range.
    let validators = &validator_set.validators;
    let round = u128::from(round.as_u32().unwrap_or(0));
    let index = (u128::from(height.0) + round) % validators.len() as u128;
    &validators[index as usize]
}

/// How long each step of a round may take before the engine moves on.
pub fn timeouts() -> LinearTimeouts {
    LinearTimeouts::default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::genesis_with;
    use malachitebft_app_channel::app::types::core::ValidatorSet as _;

    #[test]
    fn proposers_rotate_in_address_order() {
        let (genesis, keys) = genesis_with(4);
        let set = ValidatorSet::from_genesis(&genesis).unwrap();
        let addresses: Vec<Address> = set.validators().iter().map(|v| v.address).collect();
        let mut sorted = addresses.clone();
        sorted.sort();
        assert_eq!(addresses, sorted);
        assert_eq!(set.count(), keys.len());
        assert_eq!(set.total_voting_power(), 4);
        for height in 1..6u64 {
            for round in 0..6u32 {
                let expected = addresses[((height + u64::from(round)) % 4) as usize];
                let got = proposer_of(&set, Height(height), Round::new(round)).address;
                assert_eq!(got, expected);
            }
        }
        let last = proposer_of(&set, Height(u64::MAX), Round::new(u32::MAX));
        assert!(addresses.contains(&last.address));
        assert_eq!(
            set.get_by_address(&addresses[2]).unwrap().address,
            addresses[2]
        );
        assert!(set
            .get_by_address(&Address(Keypair::from_seed(&[0; 32]).address()))
            .is_none());
    }
}
