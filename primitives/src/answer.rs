//! A worker's signed answer: what it was asked (the blake3 of the request body exactly as it
//! received it) and what it answered (the blake3 of its response body), bound to the chain,
//! the hub, the session, the request id and the model. The worker signs one with every
//! response; the hub pays only answers that carry a good one, and an Evidence transaction
//! quotes one to prove that the worker answered wrongly. Because the request is bound in by
//! its hash, a worker can neither deny an answer nor claim it was asked something else.

use borsh::{BorshDeserialize, BorshSerialize};

use crate::hash::Hash;
use crate::intent::{self, Intent};
use crate::keys::{Address, BadSignature, Keypair, Signature};

/// What an answer signature covers (besides the chain id, which the intent prefix carries).
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct AnswerClaim {
    pub hub: Address,
    pub session: u64,
    pub request_id: u64,
    /// The model the worker declared in its hello; the answer is only correct for it.
    pub model_id: String,
    pub request_hash: Hash,
    pub response_hash: Hash,
}

/// The hash of a request or response body as an answer claim names it: plain blake3.
pub fn body_hash(body: &[u8]) -> Hash {
    Hash(*blake3::hash(body).as_bytes())
}

impl AnswerClaim {
    pub fn sign(&self, chain_id: &str, worker: &Keypair) -> Signature {
        intent::sign(worker, Intent::Answer, chain_id, self)
    }

    pub fn verify(
        &self,
        chain_id: &str,
        worker: &Address,
        signature: &Signature,
    ) -> Result<(), BadSignature> {
        intent::verify(worker, Intent::Answer, chain_id, self, signature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_signature_binds_every_claim_and_the_chain() {
        let worker = Keypair::from_seed(&[4; 32]);
        let claim = AnswerClaim {
            hub: Keypair::from_seed(&[5; 32]).address(),
            session: 7,
            request_id: 9,
            model_id: "m".into(),
            request_hash: body_hash(b"rows"),
            response_hash: body_hash(b"partials"),
        };
        let signature = claim.sign("kvasir-test", &worker);
        assert!(claim
            .verify("kvasir-test", &worker.address(), &signature)
            .is_ok());
        assert!(claim
            .verify("other", &worker.address(), &signature)
            .is_err());
        let changed = [
            AnswerClaim {
                session: 8,
                ..claim.clone()
            },
            AnswerClaim {
                request_id: 10,
                ..claim.clone()
            },
            AnswerClaim {
                model_id: "n".into(),
                ..claim.clone()
            },
            AnswerClaim {
                request_hash: body_hash(b"other rows"),
                ..claim.clone()
            },
            AnswerClaim {
                response_hash: body_hash(b"zeros"),
                ..claim.clone()
            },
            AnswerClaim {
                hub: worker.address(),
                ..claim.clone()
            },
        ];
        for other in changed {
            assert!(other
                .verify("kvasir-test", &worker.address(), &signature)
                .is_err());
        }
        // Not a transaction, receipt or hello signature either.
        assert!(intent::verify(
            &worker.address(),
            Intent::Transaction,
            "kvasir-test",
            &claim,
            &signature
        )
        .is_err());
    }
}
