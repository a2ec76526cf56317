//! Commit certificates between the engine's form and the ledger's. They hold the same
//! precommit signatures (`signing` makes them over the ledger's preimage); the ledger's form
//! is the one stored with each block, in ascending address order as
//! `Certificate::verify` requires, and sync ships it back in the engine's extended form.

use kvasir_ledger::certificate::{Certificate, CommitSignature as LedgerSignature};
use malachitebft_app_channel::app::types::core::{
    CommitCertificate, ExtendedCommitCertificate, ExtendedCommitSignature, Round,
};

use crate::context::{Address, BlockId, ConsensusSignature, Height, LedgerContext};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    #[error("the certificate is for a nil round")]
    NilRound,
}

/// The ledger's certificate for what the engine decided.
pub fn ledger_certificate(
    cert: &CommitCertificate<LedgerContext>,
) -> Result<Certificate, ConversionError> {
    let mut signatures: Vec<LedgerSignature> = cert
        .commit_signatures
        .iter()
        .map(|s| LedgerSignature {
            validator: s.address.0,
            signature: s.signature.0,
        })
        .collect();
    signatures.sort_by_key(|s| s.validator);
    Ok(Certificate {
        height: cert.height.0,
        round: cert.round.as_u32().ok_or(ConversionError::NilRound)?,
        block: cert.value_id.0,
        signatures,
    })
}

/// The engine's form of a stored certificate.
#[cfg(test)]
pub fn commit_certificate(cert: &Certificate) -> CommitCertificate<LedgerContext> {
    CommitCertificate {
        height: Height(cert.height),
        round: Round::new(cert.round),
        value_id: BlockId(cert.block),
        commit_signatures: cert
            .signatures
            .iter()
            .map(|s| {
                malachitebft_app_channel::app::types::core::CommitSignature::new(
                    Address(s.validator),
                    ConsensusSignature(s.signature),
                )
            })
            .collect(),
    }
}

/// A stored certificate as sync ships it.
pub fn synced_certificate(cert: &Certificate) -> ExtendedCommitCertificate<LedgerContext> {
    ExtendedCommitCertificate {
        height: Height(cert.height),
        round: Round::new(cert.round),
        value_id: BlockId(cert.block),
        commit_signatures: cert
            .signatures
            .iter()
            .map(|s| {
                ExtendedCommitSignature::new(
                    Address(s.validator),
                    ConsensusSignature(s.signature),
                    None,
                )
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::genesis_with;
    use kvasir_ledger::Hash;

    #[test]
    fn certificates_convert_both_ways_and_verify_offline() {
        let (genesis, keys) = genesis_with(4);
        let block = Hash([5; 32]);
        let signers: Vec<_> = keys.iter().rev().take(3).collect();
        let ours = Certificate::signed_by(&genesis.chain_id(), 9, 2, block, &signers);
        assert_eq!(ours.verify(&genesis, 9, &block), Ok(3));

        let mut engine = commit_certificate(&ours);
        engine.commit_signatures.reverse();
        let back = ledger_certificate(&engine).unwrap();
        assert_eq!(back, ours);
        assert_eq!(back.verify(&genesis, 9, &block), Ok(3));

        let synced = synced_certificate(&ours);
        assert_eq!(synced.commit_signatures.len(), 3);
        assert!(synced
            .commit_signatures
            .iter()
            .all(|s| s.extension.is_none()));
        engine.round = Round::Nil;
        assert_eq!(ledger_certificate(&engine), Err(ConversionError::NilRound));
    }
}
