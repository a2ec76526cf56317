//! What the hub meters for an answer, as a pure function of what was asked and what came
//! back, so that the rule paid per byte is written down once and tested apart from sockets
//! and sled: a response that carries exactly the values its request implies and the
//! worker's good answer signature, in time, meters the request's bytes and its own; a failure
//! meters nothing; an answer after the request's deadline (the backbone has computed it
//! locally by then) earns nothing and is not relayed; anything else (an answer to a request
//! this session was never sent, too many values, too few, a signature that does not verify)
//! is refused, and the relay drops the worker.

use std::time::Instant;

use kvasir_ledger::hash::Hash;

/// A request relayed to a session and not yet answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Asked {
    /// Bytes of the request frame as relayed.
    pub request_bytes: u64,
    /// Partial values the answering response must carry.
    pub response_values: usize,
    /// blake3 of the request body as relayed: the answer signature must name it.
    pub request_hash: Hash,
    /// After this the backbone no longer waits for the answer.
    pub deadline: Instant,
    /// The market order of the backbone that asked (zero: none): the answer is metered for
    /// it, whatever backbone is attached when the answer comes.
    pub order: u64,
}

/// What an answer is worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Metered {
    /// In time: meter these bytes (zero for a failure) and relay the answer.
    Bytes(u64),
    /// After the deadline: nothing metered, nothing relayed.
    Late,
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
    #[error("response to request {id} is not signed by the worker as its answer to that request")]
    BadSignature { id: u64 },
}

/// What `answer` to request `id`, arriving at `now`, is worth, given what the relay sent that
/// session under that id (`None`: nothing, or already answered or expired). `signed` says
/// whether a response's signature verifies for what was asked; it is called only for a
/// response of the right size to a request that was asked, so junk costs no signature check.
pub(super) fn metered(
    id: u64,
    asked: Option<Asked>,
    answer: Answer,
    now: Instant,
    signed: impl FnOnce(&Asked) -> bool,
) -> Result<Metered, Refusal> {
    let asked = asked.ok_or(Refusal::Unasked { id })?;
    // A wrong size or a bad signature is a lie whenever it arrives; lateness is only
    // slowness.
    match answer {
        Answer::Response { values, .. } if values != asked.response_values => {
            Err(Refusal::WrongSize {
                id,
                values,
                expected: asked.response_values,
            })
        }
        Answer::Response { .. } if !signed(&asked) => Err(Refusal::BadSignature { id }),
        _ if now > asked.deadline => Ok(Metered::Late),
        Answer::Failure => Ok(Metered::Bytes(0)),
        Answer::Response { bytes, .. } => {
            Ok(Metered::Bytes(asked.request_bytes.saturating_add(bytes)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    fn asked() -> Asked {
        Asked {
            request_bytes: 500,
            response_values: 12,
            request_hash: Hash([3; 32]),
            deadline: Instant::now() + Duration::from_secs(60),
            order: 0,
        }
    }

    fn response(values: usize) -> Answer {
        Answer::Response {
            values,
            bytes: 86 + 4 * values as u64,
        }
    }

    /// `metered` for an answer whose signature verifies.
    fn metered_signed(
        id: u64,
        asked: Option<Asked>,
        answer: Answer,
        now: Instant,
    ) -> Result<Metered, Refusal> {
        metered(id, asked, answer, now, |a| a.request_hash == Hash([3; 32]))
    }

    #[test]
    fn the_right_size_meters_request_and_response() {
        assert_eq!(
            metered_signed(3, Some(asked()), response(12), Instant::now()),
            Ok(Metered::Bytes(500 + 134))
        );
    }

    #[test]
    fn a_bad_signature_is_refused_late_or_not_and_checked_only_when_the_size_is_right() {
        for now in [Instant::now(), asked().deadline + Duration::from_millis(1)] {
            assert_eq!(
                metered(3, Some(asked()), response(12), now, |_| false),
                Err(Refusal::BadSignature { id: 3 })
            );
        }
        let never = |_: &Asked| -> bool { panic!("a signature checked for nothing") };
        assert!(matches!(
            metered(3, Some(asked()), response(13), Instant::now(), never),
            Err(Refusal::WrongSize { .. })
        ));
        assert!(matches!(
            metered(3, None, response(12), Instant::now(), never),
            Err(Refusal::Unasked { .. })
        ));
        assert_eq!(
            metered(3, Some(asked()), Answer::Failure, Instant::now(), never),
            Ok(Metered::Bytes(0))
        );
    }

    #[test]
    fn too_many_or_too_few_values_are_refused() {
        for values in [13, 24, 11, 0] {
            assert_eq!(
                metered_signed(3, Some(asked()), response(values), Instant::now()),
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
        assert_eq!(
            metered_signed(3, Some(asked()), Answer::Failure, Instant::now()),
            Ok(Metered::Bytes(0))
        );
    }

    #[test]
    fn an_answer_to_nothing_asked_is_refused() {
        for answer in [response(12), Answer::Failure] {
            assert_eq!(
                metered_signed(4, None, answer, Instant::now()),
                Err(Refusal::Unasked { id: 4 })
            );
        }
    }

    #[test]
    fn an_answer_after_the_deadline_earns_nothing_and_a_wrong_size_is_still_refused() {
        let late = asked().deadline + Duration::from_millis(1);
        for answer in [response(12), Answer::Failure] {
            assert_eq!(
                metered_signed(3, Some(asked()), answer, late),
                Ok(Metered::Late)
            );
        }
        // A wrong size is refused, late or not.
        assert!(matches!(
            metered_signed(3, Some(asked()), response(13), late),
            Err(Refusal::WrongSize { .. })
        ));
    }
}
