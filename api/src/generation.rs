//! A generation's result: what `generate --json` and `backbone --json` print and what the
//! backbone's `POST /generate` answers.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /generate` on the backbone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct GenerateRequest {
    pub prompt: String,
    #[serde(default = "default_tokens")]
    pub tokens: usize,
}

fn default_tokens() -> usize {
    32
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct GenerationReport {
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    /// The generated text (without the prompt).
    pub text: String,
    pub generate_s: f64,
    pub tokens_per_s: f64,
    /// blake3 of the last step's logits as little-endian f32 bytes: equal hashes, equal bits.
    pub logits_blake3: String,
    /// Seconds to load the checkpoint (`generate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_s: Option<f64>,
    /// Where the experts ran (`generate`): `cpu` or `cuda`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// How the experts were dispatched (the backbone).
    #[serde(default, skip_serializing_if = "Option::is_none", flatten)]
    pub dispatch: Option<DispatchCounts>,
    /// What the backbone's audits found (the backbone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditReport>,
}

/// The backbone's audits since it started: remote answers recomputed, how many differed,
/// and the workers caught with what became of the evidence against each.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AuditReport {
    pub audits: u64,
    pub mismatches: u64,
    pub caught: Vec<CaughtWorker>,
}

/// A worker whose answer differed from the recomputation, and its Evidence transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CaughtWorker {
    #[schema(value_type = String)]
    pub worker: kvasir_ledger::Address,
    #[schema(value_type = String)]
    pub hub: kvasir_ledger::Address,
    pub session_id: u64,
    pub request_id: u64,
    /// Which answer of this worker it was (1 for its first), as the backbone counted them.
    pub answer_number: u64,
    /// The Evidence transaction's hash, once submitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub evidence: Option<kvasir_ledger::Hash>,
    /// The ledger's head when the ledger took it, and the height it was committed at: the
    /// blocks it waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_height: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed_height: Option<u64>,
    /// Why it was not submitted or not committed (no ledger given, refused, timed out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The backbone's dispatch counts since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DispatchCounts {
    /// Requests sent to workers (one per worker per layer step).
    pub remote_requests: u64,
    /// Expert evaluations answered by workers.
    pub remote_evaluations: u64,
    /// Requests computed locally after their worker failed, left or stalled.
    pub fallbacks: u64,
}

impl DispatchCounts {
    /// Whether the work really went to workers, all of it: equal output proves nothing about
    /// remote dispatch if the experts never left the backbone. Why not, if not.
    pub fn all_remote(&self) -> Result<(), String> {
        if self.remote_requests == 0 {
            return Err("no request reached a worker: the run did not go remote".into());
        }
        if self.fallbacks > 0 {
            return Err(format!(
                "{} of {} remote requests fell back to local experts: the run did not fully go remote",
                self.fallbacks, self.remote_requests
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_run_with_requests_and_no_fallbacks_went_remote() {
        let counts = |remote_requests, fallbacks| DispatchCounts {
            remote_requests,
            remote_evaluations: remote_requests,
            fallbacks,
        };
        assert!(counts(32, 0).all_remote().is_ok());
        assert!(counts(0, 0)
            .all_remote()
            .unwrap_err()
            .contains("did not go remote"));
        assert!(counts(32, 1).all_remote().unwrap_err().contains("1 of 32"));
    }
}
