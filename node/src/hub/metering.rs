//! What the hub meters for an answer, as a pure function of what was asked and what came
//! back, so that the rule paid per byte is written down once and tested apart from sockets
//! and sled: a response that carries exactly the values its request implies meters the
//! request's bytes and its own; a failure meters nothing; anything else (an answer to a
//! request this session was never sent, too many values, too few) is refused, and the relay
//! drops the worker.

/// A request relayed to a session and not yet answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Asked {
    /// Bytes of the request frame as relayed.
    pub request_bytes: u64,
    /// Partial values the answering response must carry.
    pub response_values: usize,
}

/// A worker's answer to request `id`, as the relay inspected it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// A response frame of `bytes` bytes carrying `values` partial values.
    Response { values: usize, bytes: u64 },
    /// The worker could not serve the request.
    Failure,
}

/// Why an answer earns nothing and costs the worker its session.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refusal {
    #[error("answer to request {id}, which this session was never sent")]
    Unasked { id: u64 },
    #[error("response to request {id} carries {values} values, the request implies {expected}")]
    WrongSize {
        id: u64,
        values: usize,
        expected: usize,
    },
}

/// Bytes to meter for `answer` to request `id`, given what the relay sent that session under
/// that id (`None`: nothing, or already answered). Zero for a failure.
pub(super) fn metered(id: u64, asked: Option<Asked>, answer: Answer) -> Result<u64, Refusal> {
    let asked = asked.ok_or(Refusal::Unasked { id })?;
    match answer {
        Answer::Failure => Ok(0),
        Answer::Response { values, bytes } if values == asked.response_values => {
            Ok(asked.request_bytes.saturating_add(bytes))
        }
        Answer::Response { values, .. } => Err(Refusal::WrongSize {
            id,
            values,
            expected: asked.response_values,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ASKED: Asked = Asked {
        request_bytes: 500,
        response_values: 12,
    };

    fn response(values: usize) -> Answer {
        Answer::Response {
            values,
            bytes: 22 + 4 * values as u64,
        }
    }

    #[test]
    fn the_right_size_meters_request_and_response() {
        assert_eq!(metered(3, Some(ASKED), response(12)), Ok(500 + 70));
    }

    #[test]
    fn too_many_or_too_few_values_are_refused() {
        for values in [13, 24, 11, 0] {
            assert_eq!(
                metered(3, Some(ASKED), response(values)),
                Err(Refusal::WrongSize {
                    id: 3,
                    values,
                    expected: 12
                })
            );
        }
    }

    #[test]
    fn a_failure_meters_nothing() {
        assert_eq!(metered(3, Some(ASKED), Answer::Failure), Ok(0));
    }

    #[test]
    fn an_answer_to_nothing_asked_is_refused() {
        for answer in [response(12), Answer::Failure] {
            assert_eq!(metered(4, None, answer), Err(Refusal::Unasked { id: 4 }));
        }
    }
}
