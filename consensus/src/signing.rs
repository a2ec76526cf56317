//! Signing and checking what validators say, in the ledger's own preimages: a vote is a
//! `certificate::Vote`, a proposal a `certificate::Proposal`, and the binding of a
//! validator's key to its network identity an `Intent::ValidatorProof`. So a commit
//! certificate the engine gathers is one `Certificate::verify` checks offline, without
//! Malachite.

use async_trait::async_trait;
use kvasir_ledger::certificate::{self, VoteKind};
use kvasir_ledger::intent::{self, Intent};
use kvasir_ledger::Keypair;
use malachitebft_app_channel::app::types::core::{
    NilOrVal, SignedMessage, SigningScheme, ValidatorProof, VoteExtensionScope, VoteType,
};
use malachitebft_app_channel::{Signer, Verifier};
use malachitebft_signing::{Error, VerificationResult};

use crate::context::{ConsensusSignature, LedgerContext, LedgerSigning, Proposal, Vote};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigningError {
    #[error("a vote or proposal at a nil round cannot be signed")]
    NilRound,
    #[error("asked to sign for {0}, which is not this validator")]
    NotOurs(kvasir_ledger::Address),
    #[error("vote extensions are disabled on this chain")]
    NoExtensions,
}

/// The ledger's preimage of a vote; `None` when its round is nil, which no signed vote has.
pub(crate) fn ledger_vote(vote: &Vote) -> Option<certificate::Vote> {
    Some(certificate::Vote {
        kind: match vote.vote_type {
            VoteType::Prevote => VoteKind::Prevote,
            VoteType::Precommit => VoteKind::Precommit,
        },
        height: vote.height.0,
        round: vote.round.as_u32()?,
        block: match vote.value {
            NilOrVal::Nil => None,
            NilOrVal::Val(id) => Some(id.0),
        },
    })
}

fn ledger_proposal(proposal: &Proposal) -> Option<certificate::Proposal> {
    Some(certificate::Proposal {
        height: proposal.height.0,
        round: proposal.round.as_u32()?,
        pol_round: proposal.pol_round.as_u32(),
        block: proposal.value.0,
    })
}

/// The message a validator proof signs: its public key and peer id, as the engine hands
/// them over.
fn proof_payload<'a>(public_key: &'a Vec<u8>, peer_id: &'a Vec<u8>) -> (&'a Vec<u8>, &'a Vec<u8>) {
    (public_key, peer_id)
}

/// A validator's signing key on one chain.
pub struct LedgerSigner {
    key: Keypair,
    chain_id: String,
}

impl LedgerSigner {
    pub fn new(key: Keypair, chain_id: String) -> LedgerSigner {
        LedgerSigner { key, chain_id }
    }

    fn check_ours(&self, who: &kvasir_ledger::Address) -> Result<(), Error> {
        if *who != self.key.address() {
            return Err(Error::from_source(SigningError::NotOurs(*who)));
        }
        Ok(())
    }
}

#[async_trait]
impl Signer<LedgerContext> for LedgerSigner {
    async fn sign_vote(&self, vote: Vote) -> Result<SignedMessage<LedgerContext, Vote>, Error> {
        self.check_ours(&vote.validator.0)?;
        let preimage = ledger_vote(&vote).ok_or(Error::from_source(SigningError::NilRound))?;
        let signature = preimage.sign(&self.chain_id, &self.key);
        Ok(SignedMessage::new(vote, ConsensusSignature(signature)))
    }

    async fn sign_proposal(
        &self,
        proposal: Proposal,
    ) -> Result<SignedMessage<LedgerContext, Proposal>, Error> {
        self.check_ours(&proposal.proposer.0)?;
        let preimage =
            ledger_proposal(&proposal).ok_or(Error::from_source(SigningError::NilRound))?;
        let signature = preimage.sign(&self.chain_id, &self.key);
        Ok(SignedMessage::new(proposal, ConsensusSignature(signature)))
    }

    async fn sign_vote_extension(
        &self,
        _scope: VoteExtensionScope<LedgerContext>,
        _extension: (),
    ) -> Result<SignedMessage<LedgerContext, ()>, Error> {
        Err(Error::from_source(SigningError::NoExtensions))
    }

    async fn sign_validator_proof(
        &self,
        public_key: Vec<u8>,
        peer_id: Vec<u8>,
    ) -> Result<ValidatorProof<LedgerContext>, Error> {
        self.check_ours(
            &LedgerSigning::decode_public_key(&public_key).map_err(Error::from_source)?,
        )?;
        let signature = intent::sign(
            &self.key,
            Intent::ValidatorProof,
            &self.chain_id,
            &proof_payload(&public_key, &peer_id),
        );
        Ok(ValidatorProof::new(
            public_key,
            peer_id,
            ConsensusSignature(signature),
        ))
    }
}

/// Checks signatures for one chain; the key is the validator's address.
pub struct LedgerVerifier {
    chain_id: String,
}

impl LedgerVerifier {
    pub fn new(chain_id: String) -> LedgerVerifier {
        LedgerVerifier { chain_id }
    }
}

#[async_trait]
impl Verifier<LedgerContext> for LedgerVerifier {
    async fn verify_signed_vote(
        &self,
        vote: &Vote,
        signature: &ConsensusSignature,
        public_key: &kvasir_ledger::Address,
    ) -> Result<VerificationResult, Error> {
        let valid = vote.validator.0 == *public_key
            && ledger_vote(vote)
                .is_some_and(|v| v.verify(&self.chain_id, public_key, &signature.0));
        Ok(VerificationResult::from_bool(valid))
    }

    async fn verify_signed_proposal(
        &self,
        proposal: &Proposal,
        signature: &ConsensusSignature,
        public_key: &kvasir_ledger::Address,
    ) -> Result<VerificationResult, Error> {
        let valid = proposal.proposer.0 == *public_key
            && ledger_proposal(proposal)
                .is_some_and(|p| p.verify(&self.chain_id, public_key, &signature.0));
        Ok(VerificationResult::from_bool(valid))
    }

    async fn verify_signed_vote_extension(
        &self,
        _scope: &VoteExtensionScope<LedgerContext>,
        _extension: &(),
        _signature: &ConsensusSignature,
        _public_key: &kvasir_ledger::Address,
    ) -> Result<VerificationResult, Error> {
        Ok(VerificationResult::Invalid)
    }

    async fn verify_validator_proof(
        &self,
        proof: &ValidatorProof<LedgerContext>,
    ) -> Result<VerificationResult, Error> {
        let Ok(signer) = LedgerSigning::decode_public_key(&proof.public_key) else {
            return Ok(VerificationResult::Invalid);
        };
        let valid = intent::verify(
            &signer,
            Intent::ValidatorProof,
            &self.chain_id,
            &proof_payload(&proof.public_key, &proof.peer_id),
            &proof.signature.0,
        )
        .is_ok();
        Ok(VerificationResult::from_bool(valid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{Address, BlockId, Height};
    use kvasir_ledger::Hash;
    use malachitebft_app_channel::app::types::core::Round;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    #[test]
    fn votes_verify_as_ledger_precommits_and_nothing_else() {
        let key = Keypair::from_seed(&[1; 32]);
        let me = key.address();
        let signer = LedgerSigner::new(key.clone(), "kvasir-test".into());
        let verifier = LedgerVerifier::new("kvasir-test".into());
        let vote = Vote {
            vote_type: VoteType::Precommit,
            height: Height(3),
            round: Round::new(1),
            value: NilOrVal::Val(BlockId(Hash([7; 32]))),
            validator: Address(me),
        };
        let signed = block_on(signer.sign_vote(vote.clone())).unwrap();
        let ledger = certificate::Vote {
            kind: VoteKind::Precommit,
            height: 3,
            round: 1,
            block: Some(Hash([7; 32])),
        };
        assert!(ledger.verify("kvasir-test", &me, &signed.signature.0));
        assert!(
            block_on(verifier.verify_signed_vote(&vote, &signed.signature, &me))
                .unwrap()
                .is_valid()
        );

        let mut prevote = vote.clone();
        prevote.vote_type = VoteType::Prevote;
        assert!(
            block_on(verifier.verify_signed_vote(&prevote, &signed.signature, &me))
                .unwrap()
                .is_invalid()
        );
        let other = LedgerVerifier::new("kvasir-other".into());
        assert!(
            block_on(other.verify_signed_vote(&vote, &signed.signature, &me))
                .unwrap()
                .is_invalid()
        );
        let stranger = Keypair::from_seed(&[2; 32]).address();
        assert!(
            block_on(verifier.verify_signed_vote(&vote, &signed.signature, &stranger))
                .unwrap()
                .is_invalid()
        );

        let mut theirs = vote.clone();
        theirs.validator = Address(stranger);
        assert!(block_on(signer.sign_vote(theirs)).is_err());
        let mut nil_round = vote;
        nil_round.round = Round::Nil;
        assert!(block_on(signer.sign_vote(nil_round)).is_err());
    }

    #[test]
    fn proposals_and_proofs_verify() {
        let key = Keypair::from_seed(&[1; 32]);
        let me = key.address();
        let signer = LedgerSigner::new(key, "kvasir-test".into());
        let verifier = LedgerVerifier::new("kvasir-test".into());
        let proposal = Proposal {
            height: Height(2),
            round: Round::new(0),
            value: BlockId(Hash([3; 32])),
            pol_round: Round::Nil,
            proposer: Address(me),
        };
        let signed = block_on(signer.sign_proposal(proposal.clone())).unwrap();
        assert!(certificate::Proposal {
            height: 2,
            round: 0,
            pol_round: None,
            block: Hash([3; 32]),
        }
        .verify("kvasir-test", &me, &signed.signature.0));
        assert!(
            block_on(verifier.verify_signed_proposal(&proposal, &signed.signature, &me))
                .unwrap()
                .is_valid()
        );

        let proof =
            block_on(signer.sign_validator_proof(me.as_bytes().to_vec(), vec![0, 36, 1, 2]))
                .unwrap();
        assert!(block_on(verifier.verify_validator_proof(&proof))
            .unwrap()
            .is_valid());
        let mut moved = proof.clone();
        moved.peer_id.push(0);
        assert!(block_on(verifier.verify_validator_proof(&moved))
            .unwrap()
            .is_invalid());
        let mut short = proof;
        short.public_key.pop();
        assert!(block_on(verifier.verify_validator_proof(&short))
            .unwrap()
            .is_invalid());
    }
}
