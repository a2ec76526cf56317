//! Commit certificates between the engine's form and the ledger's. They hold the same
//! precommit signatures (`signing` makes them over the ledger's preimage); the ledger's form
//! is the one stored with each block, in ascending address order as
//! `Certificate::verify` requires, and sync ships it back in the engine's extended form.

use kvasir_ledger::certificate::{Certificate, CommitSignature as LedgerSignature};
use malachitebft_app_channel::app::types::core::{
    CommitCertificate, CommitSignature, ExtendedCommitCertificate, ExtendedCommitSignature, Round,
};

use crate::context::{Address, BlockId, ConsensusSignature, Height, LedgerContext};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    #[error("the certificate is for a nil round")]
    NilRound,
    #[error("{0} signed with a vote extension, which this chain does not use")]
    Extension(kvasir_ledger::Address),
}

fn ledger_form<'a>(
    height: Height,
    round: Round,
    value_id: BlockId,
    signatures: impl Iterator<Item = (&'a Address, &'a ConsensusSignature)>,
) -> Result<Certificate, ConversionError> {
    let mut signatures: Vec<LedgerSignature> = signatures
        .map(|(address, signature)| LedgerSignature {
            validator: address.0,
            signature: signature.0,
        })
        .collect();
    signatures.sort_by_key(|s| s.validator);
    Ok(Certificate {
        height: height.0,
        round: round.as_u32().ok_or(ConversionError::NilRound)?,
        block: value_id.0,
        signatures,
    })
}

/// The ledger's certificate for what the engine decided.
pub fn ledger_certificate(
    cert: &CommitCertificate<LedgerContext>,
) -> Result<Certificate, ConversionError> {
    ledger_form(
        cert.height,
        cert.round,
        cert.value_id,
        cert.commit_signatures
            .iter()
            .map(|s| (&s.address, &s.signature)),
    )
}

/// The ledger's certificate for one shipped by sync, which must carry no extensions.
pub fn ledger_certificate_of_synced(
    cert: &ExtendedCommitCertificate<LedgerContext>,
) -> Result<Certificate, ConversionError> {
    if let Some(s) = cert
        .commit_signatures
        .iter()
        .find(|s| s.extension.is_some())
    {
        return Err(ConversionError::Extension(s.address.0));
    }
    ledger_form(
        cert.height,
        cert.round,
        cert.value_id,
        cert.commit_signatures
            .iter()
            .map(|s| (&s.address, &s.signature)),
    )
}

/// The engine's form of a stored certificate.
pub fn commit_certificate(cert: &Certificate) -> CommitCertificate<LedgerContext> {
    CommitCertificate {
        height: Height(cert.height),
        round: Round::new(cert.round),
        value_id: BlockId(cert.block),
        commit_signatures: cert
            .signatures
            .iter()
            .map(|s| CommitSignature::new(Address(s.validator), ConsensusSignature(s.signature)))
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
    use malachitebft_app_channel::app::types::core::SignedMessage;

    #[test]
    fn certificates_convert_both_ways_and_verify_offline() {
        let (genesis, keys) = genesis_with(4);
        let block = Hash([5; 32]);
        let signers: Vec<_> = keys.iter().rev().take(3).collect();
        let ours = Certificate::signed_by(&genesis.params.chain_id, 9, 2, block, &signers);
        assert_eq!(ours.verify(&genesis, 9, &block), Ok(3));

        let mut engine = commit_certificate(&ours);
        engine.commit_signatures.reverse();
        let back = ledger_certificate(&engine).unwrap();
        assert_eq!(back, ours);
        assert_eq!(back.verify(&genesis, 9, &block), Ok(3));

        let synced = synced_certificate(&ours);
        assert_eq!(ledger_certificate_of_synced(&synced), Ok(ours.clone()));
        let mut extended = synced;
        extended.commit_signatures[0].extension = Some(SignedMessage::new(
            (),
            extended.commit_signatures[0].signature,
        ));
        assert!(matches!(
            ledger_certificate_of_synced(&extended),
            Err(ConversionError::Extension(_))
        ));
        engine.round = Round::Nil;
        assert_eq!(ledger_certificate(&engine), Err(ConversionError::NilRound));
    }
}
