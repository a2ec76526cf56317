//! Every signature commits to an intent prefix: a domain tag, the intent (what is being
//! signed) and the chain id, followed by the canonical borsh encoding of the payload. A
//! transaction signature therefore never verifies as a receipt or a block signature, nor on
//! another chain. The chain id is the ledger's `Genesis::chain_id`: on a format-2 chain the
//! chain's name and genesis hash (`NAME:HASH`), so that two chains of one name differ too.

use borsh::BorshSerialize;

use crate::keys::{self, Address, BadSignature, Keypair, Signature};

const DOMAIN: &[u8] = b"KVASIR-SIG-V1";

/// What a signature authorises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Intent {
    Transaction = 1,
    Receipt = 2,
    Block = 3,
    /// A worker's or backbone's answer to a hub's challenge.
    SwarmHello = 4,
    /// A worker's statement of what it answered to one dispatch request (`answer`).
    Answer = 5,
    /// A validator's prevote or precommit (`certificate::Vote`).
    Vote = 6,
    /// A proposer's proposal of a block at a height and round (`certificate::Proposal`).
    Proposal = 7,
    /// A validator's binding of its consensus key to its network peer id.
    ValidatorProof = 8,
    /// A proposer's seal on the block it streams to the other validators
    /// (`certificate::StreamedBlock`).
    StreamedBlock = 9,
}

/// The exact bytes that are signed for `payload` under `intent` on chain `chain_id`.
pub fn signing_message(intent: Intent, chain_id: &str, payload: &impl BorshSerialize) -> Vec<u8> {
    let mut message = Vec::with_capacity(128);
    message.extend_from_slice(DOMAIN);
    message.push(intent as u8);
    // Writing into a Vec cannot fail.
    let _ = chain_id.serialize(&mut message);
    let _ = payload.serialize(&mut message);
    message
}

pub fn sign(
    keypair: &Keypair,
    intent: Intent,
    chain_id: &str,
    payload: &impl BorshSerialize,
) -> Signature {
    keypair.sign(&signing_message(intent, chain_id, payload))
}

/// Verifies one signature by itself (a block's proposer, a swarm hello) under the ledger's
/// one rule (`keys::verify`); the signatures transactions carry are batch-checked under the
/// same rule by `tx::check_stateless`.
pub fn verify(
    signer: &Address,
    intent: Intent,
    chain_id: &str,
    payload: &impl BorshSerialize,
    signature: &Signature,
) -> Result<(), BadSignature> {
    keys::verify(
        signer,
        &signing_message(intent, chain_id, payload),
        signature,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_bound_to_intent_and_chain() {
        let keypair = Keypair::from_seed(&[3; 32]);
        let payload = (42u64, "hello".to_string());
        let signature = sign(&keypair, Intent::Transaction, "kvasir-dev", &payload);
        let who = keypair.address();
        assert_eq!(
            verify(
                &who,
                Intent::Transaction,
                "kvasir-dev",
                &payload,
                &signature
            ),
            Ok(())
        );
        assert!(verify(&who, Intent::Receipt, "kvasir-dev", &payload, &signature).is_err());
        assert!(verify(&who, Intent::Block, "kvasir-dev", &payload, &signature).is_err());
        assert!(verify(
            &who,
            Intent::Transaction,
            "other-chain",
            &payload,
            &signature
        )
        .is_err());
        let other = (43u64, "hello".to_string());
        assert!(verify(&who, Intent::Transaction, "kvasir-dev", &other, &signature).is_err());
    }
}
