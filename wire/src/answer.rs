//! What a correct worker answers: the one function that turns a dispatch request into its
//! response, used by the worker to answer and by whoever checks an answer (a validator
//! judging evidence, the backbone's audit) to recompute it. Both go through the same
//! translation (`translate`), so "correct" means bit for bit.

use std::path::Path;

use anyhow::Context;
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::moe::{ExpertError, ExpertExecutor};

use crate::{Request, Response, TranslateError};

/// Why a request has no answer (sent to the backbone as a `Failure`'s text).
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("rows are {got} wide, this model's are {hidden}")]
    Width { got: usize, hidden: usize },
    #[error(transparent)]
    Translate(#[from] TranslateError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
}

/// The unsigned response to `request` from `experts`, the experts of a model whose rows are
/// `hidden` wide: the partials of the request's experts on its rows, in its order.
pub fn answer(
    request: &Request,
    hidden: usize,
    experts: &dyn ExpertExecutor,
) -> Result<Response, AnswerError> {
    let got = request.hidden as usize;
    if got != hidden {
        return Err(AnswerError::Width { got, hidden });
    }
    let requests = request.to_expert_requests()?;
    let partials = experts.evaluate(request.layer as usize, &requests)?;
    Ok(Response::from_partials(request, &partials)?)
}

/// What identifies a model to the swarm (the hello's model id): workers and backbone must
/// agree on it. The hash of config.json and of the tensors' layout (names, shapes, dtypes,
/// offsets), the first 32 hex digits; of a GGUF file, the hash of its header (metadata and
/// tensor layout), or of each part's header in turn for a model split over several files.
pub fn model_id(dir: &Path) -> anyhow::Result<String> {
    if kvasir_inference::gguf::is_gguf(dir) {
        let mut hasher = blake3::Hasher::new();
        for part in kvasir_inference::gguf::split::open(dir)? {
            hasher.update(part.header_bytes());
        }
        return Ok(hasher.finalize().to_hex()[..32].to_string());
    }
    let mut hasher = blake3::Hasher::new();
    let config = dir.join("config.json");
    hasher
        .update(&std::fs::read(&config).with_context(|| format!("reading {}", config.display()))?);
    hasher.update(Checkpoint::open(dir)?.layout().as_bytes());
    Ok(hasher.finalize().to_hex()[..32].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_inference::moe::ExpertRequest;

    /// Doubles every row value: a stand-in for the expert kernels.
    struct Doubling;

    impl ExpertExecutor for Doubling {
        fn holds(&self, _: usize, _: usize) -> bool {
            true
        }
        fn evaluate(
            &self,
            _: usize,
            requests: &[ExpertRequest],
        ) -> Result<Vec<Vec<f32>>, ExpertError> {
            let double = |r: &ExpertRequest| r.rows.iter().map(|v| v * 2.0).collect();
            Ok(requests.iter().map(double).collect())
        }
    }

    fn request(hidden: u32) -> Request {
        Request {
            session: 9,
            id: 3,
            layer: 0,
            hidden,
            format: crate::RowFormat::F32,
            rows: vec![1.0, 2.0, 3.0, 4.0],
            experts: vec![(1, vec![1]), (5, vec![0, 1])],
        }
    }

    #[test]
    fn answers_each_expert_on_its_rows_in_request_order() {
        let response = answer(&request(2), 2, &Doubling).unwrap();
        assert_eq!(response.id, 3);
        assert_eq!(response.partials, [6.0, 8.0, 2.0, 4.0, 6.0, 8.0]);
    }

    #[test]
    fn a_request_of_another_width_is_refused_not_evaluated() {
        let error = answer(&request(4), 2, &Doubling).unwrap_err();
        assert_eq!(error.to_string(), "rows are 4 wide, this model's are 2");
    }
}
