//! The translation between the engine's expert requests and dispatch frames, both ways. The
//! backbone turns the `ExpertRequest`s of one layer step that go to one worker into a
//! `Request` (each token's row once, per expert the indices of its rows) and splits the
//! answering `Response` back per expert (`split_partials`); the worker turns the `Request`
//! back into `ExpertRequest`s and its partials into the `Response` (which it then signs).
//! Both ends call these functions, so the two halves of the protocol cannot drift apart, and
//! a third-party worker has one place to read what a frame means.
//!
//! Input that does not add up (an index out of range, rows or partials of the wrong size,
//! experts out of order, one token given two different rows, a frame over the size limit) is
//! a typed error, never a panic.
//!
//! A frame does not carry the backbone's token numbers: a request's `tokens` come back as
//! row indices of the frame, which name the same tokens (two experts share a token exactly
//! when they share a row index) and are what an expert function needs.

use std::collections::hash_map::{Entry, HashMap};

use kvasir_inference::moe::ExpertRequest;

use kvasir_inference::kernels::quant::BLOCK;

use super::{Request, Response, RowFormat, MAX_FRAME, MAX_HIDDEN, MAX_ROWS};

/// Why expert requests, a frame or partials do not translate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    #[error("member {index} names no expert request (the step has {len})")]
    NoSuchRequest { index: usize, len: usize },
    #[error("{what} {got} does not fit a frame (at most {max})")]
    OutOfRange {
        what: &'static str,
        got: usize,
        max: usize,
    },
    #[error("experts must ascend without repeats: expert {expert} follows {previous}")]
    Order { previous: u16, expert: u16 },
    #[error("rows of width {hidden} are not whole Q8_0 blocks of 32")]
    Blocks { hidden: usize },
    #[error("expert {expert} has {values} row values for {tokens} tokens of width {hidden}")]
    Rows {
        expert: usize,
        tokens: usize,
        values: usize,
        hidden: usize,
    },
    #[error("token {token} is routed to expert {expert} twice")]
    RepeatedToken { expert: usize, token: usize },
    #[error("token {token} has different rows in two expert requests")]
    TokenRows { token: usize },
    #[error("the request's {values} row values are not whole rows of width {hidden}")]
    Ragged { values: usize, hidden: u32 },
    #[error("expert {expert} lists row {index}; the request has {rows} rows")]
    RowIndex {
        expert: u16,
        index: u32,
        rows: usize,
    },
    #[error("{got} partials for a request of {expected} experts")]
    PartialCount { expected: usize, got: usize },
    #[error("expert {expert}'s partial has {got} values, {expected} expected")]
    PartialSize {
        expert: u16,
        expected: usize,
        got: usize,
    },
    #[error("the response carries {got} values, the request implies {expected}")]
    ResponseSize { expected: usize, got: usize },
}

/// `value` as the wire's u16, or `OutOfRange` naming `what`.
fn narrow(what: &'static str, value: usize) -> Result<u16, TranslateError> {
    u16::try_from(value).map_err(|_| TranslateError::OutOfRange {
        what,
        got: value,
        max: u16::MAX.into(),
    })
}

impl Request {
    /// The request for worker `session` carrying `requests[i]` for each `i` in `members`
    /// (one layer step's share of one worker, in ascending expert order): every token's row
    /// once, and per expert the indices of its tokens' rows; the rows to go as `format`.
    pub fn from_expert_requests(
        session: u64,
        id: u64,
        (layer, hidden): (usize, usize),
        format: RowFormat,
        requests: &[ExpertRequest],
        members: &[usize],
    ) -> Result<Request, TranslateError> {
        let layer = narrow("layer", layer)?;
        if hidden == 0 || hidden > MAX_HIDDEN as usize {
            return Err(TranslateError::OutOfRange {
                what: "row width",
                got: hidden,
                max: MAX_HIDDEN as usize,
            });
        }
        if format == RowFormat::Q8_0 && !hidden.is_multiple_of(BLOCK) {
            return Err(TranslateError::Blocks { hidden });
        }
        // Per token its row index in the frame; per row index the last member that used it
        // (a token listed twice for one expert is refused, as the decoder would refuse it).
        let mut slots: HashMap<usize, u32> = HashMap::new();
        let mut used_by: Vec<usize> = Vec::new();
        let mut rows: Vec<f32> = Vec::new();
        let mut experts: Vec<(u16, Vec<u32>)> = Vec::with_capacity(members.len());
        for (position, &index) in members.iter().enumerate() {
            let request = requests.get(index).ok_or(TranslateError::NoSuchRequest {
                index,
                len: requests.len(),
            })?;
            let expert = narrow("expert", request.expert)?;
            if let Some(&(previous, _)) = experts.last() {
                if previous >= expert {
                    return Err(TranslateError::Order { previous, expert });
                }
            }
            if request.rows.len() != request.tokens.len() * hidden {
                return Err(TranslateError::Rows {
                    expert: request.expert,
                    tokens: request.tokens.len(),
                    values: request.rows.len(),
                    hidden,
                });
            }
            let mut indices = Vec::with_capacity(request.tokens.len());
            for (&token, row) in request.tokens.iter().zip(request.rows.chunks_exact(hidden)) {
                let slot = match slots.entry(token) {
                    Entry::Occupied(known) => {
                        let slot = *known.get();
                        let start = slot as usize * hidden;
                        let first: &[u8] = bytemuck::cast_slice(&rows[start..start + hidden]);
                        if first != bytemuck::cast_slice::<f32, u8>(row) {
                            return Err(TranslateError::TokenRows { token });
                        }
                        if used_by[slot as usize] == position {
                            return Err(TranslateError::RepeatedToken {
                                expert: request.expert,
                                token,
                            });
                        }
                        slot
                    }
                    Entry::Vacant(new) => {
                        let slot = used_by.len();
                        if slot >= MAX_ROWS as usize {
                            return Err(TranslateError::OutOfRange {
                                what: "rows of a request",
                                got: slot + 1,
                                max: MAX_ROWS as usize,
                            });
                        }
                        rows.extend_from_slice(row);
                        used_by.push(position);
                        *new.insert(slot as u32)
                    }
                };
                used_by[slot as usize] = position;
                indices.push(slot);
            }
            experts.push((expert, indices));
        }
        let request = Request {
            session,
            id,
            layer,
            hidden: hidden as u32,
            format,
            rows,
            experts,
        };
        for (what, bytes) in [
            ("request frame bytes", request.frame_len()),
            (
                "response frame bytes",
                Response::frame_len(request.response_values()),
            ),
        ] {
            if bytes > MAX_FRAME {
                return Err(TranslateError::OutOfRange {
                    what,
                    got: bytes,
                    max: MAX_FRAME,
                });
            }
        }
        Ok(request)
    }

    /// The expert requests this frame carries, in its order: per expert its listed rows,
    /// with the row indices as `tokens`.
    pub fn to_expert_requests(&self) -> Result<Vec<ExpertRequest>, TranslateError> {
        let hidden = self.hidden as usize;
        if hidden == 0 || !self.rows.len().is_multiple_of(hidden) {
            return Err(TranslateError::Ragged {
                values: self.rows.len(),
                hidden: self.hidden,
            });
        }
        let count = self.rows.len() / hidden;
        self.experts
            .iter()
            .map(|(expert, indices)| {
                let mut rows = Vec::with_capacity(indices.len() * hidden);
                for &index in indices {
                    let i = index as usize;
                    if i >= count {
                        return Err(TranslateError::RowIndex {
                            expert: *expert,
                            index,
                            rows: count,
                        });
                    }
                    rows.extend_from_slice(&self.rows[i * hidden..(i + 1) * hidden]);
                }
                Ok(ExpertRequest {
                    expert: *expert as usize,
                    tokens: indices.iter().map(|&i| i as usize).collect(),
                    rows,
                })
            })
            .collect()
    }
}

impl Response {
    /// The response answering `request` with `partials`: one per expert of the request, in
    /// its order, each `hidden` values per listed row. Unsigned: the worker sends it through
    /// `Response::signed_frame`.
    pub fn from_partials(
        request: &Request,
        partials: &[Vec<f32>],
    ) -> Result<Response, TranslateError> {
        if partials.len() != request.experts.len() {
            return Err(TranslateError::PartialCount {
                expected: request.experts.len(),
                got: partials.len(),
            });
        }
        for ((expert, indices), partial) in request.experts.iter().zip(partials) {
            let expected = indices.len() * request.hidden as usize;
            if partial.len() != expected {
                return Err(TranslateError::PartialSize {
                    expert: *expert,
                    expected,
                    got: partial.len(),
                });
            }
        }
        Ok(Response::unsigned(request.id, partials.concat()))
    }
}

/// A response's partials split back per member of the request that
/// `Request::from_expert_requests(.., requests, members)` made: one `Vec` per member, each
/// the size of that member's rows.
pub fn split_partials(
    partials: &[f32],
    requests: &[ExpertRequest],
    members: &[usize],
) -> Result<Vec<Vec<f32>>, TranslateError> {
    let sizes = members
        .iter()
        .map(|&index| {
            requests
                .get(index)
                .map(|r| r.rows.len())
                .ok_or(TranslateError::NoSuchRequest {
                    index,
                    len: requests.len(),
                })
        })
        .collect::<Result<Vec<usize>, _>>()?;
    let expected = sizes.iter().sum();
    if partials.len() != expected {
        return Err(TranslateError::ResponseSize {
            expected,
            got: partials.len(),
        });
    }
    let mut rest = partials;
    Ok(sizes
        .into_iter()
        .map(|n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.to_vec()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Message;
    use proptest::prelude::*;

    fn expert(expert: usize, tokens: &[usize], hidden: usize) -> ExpertRequest {
        ExpertRequest {
            expert,
            tokens: tokens.to_vec(),
            rows: tokens
                .iter()
                .flat_map(|t| (0..hidden).map(move |c| (t * 10 + c) as f32))
                .collect(),
        }
    }

    fn build(requests: &[ExpertRequest], members: &[usize]) -> Result<Request, TranslateError> {
        Request::from_expert_requests(1, 2, (0, 3), RowFormat::F32, requests, members)
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn shared_tokens_travel_once() {
        let requests = [expert(1, &[4, 7], 3), expert(5, &[7, 9], 3)];
        let request = build(&requests, &[0, 1]).unwrap();
        assert_eq!(request.rows.len(), 3 * 3, "token 7 is sent once");
        assert_eq!(request.experts, vec![(1, vec![0, 1]), (5, vec![1, 2])]);
        assert_eq!(
            request.frame_len(),
            Message::Request(request).encode().len()
        );
    }

    #[test]
    fn inconsistent_expert_requests_are_errors() {
        let good = [expert(1, &[0], 3), expert(2, &[0, 1], 3)];
        assert_eq!(
            build(&good, &[0, 2]),
            Err(TranslateError::NoSuchRequest { index: 2, len: 2 })
        );
        assert_eq!(
            build(&good, &[1, 0]),
            Err(TranslateError::Order {
                previous: 2,
                expert: 1
            })
        );
        let mut short = expert(1, &[0, 1], 3);
        short.rows.pop();
        assert!(matches!(
            build(&[short], &[0]),
            Err(TranslateError::Rows { values: 5, .. })
        ));
        assert_eq!(
            build(&[expert(1, &[3, 3], 3)], &[0]),
            Err(TranslateError::RepeatedToken {
                expert: 1,
                token: 3
            })
        );
        let mut other_row = expert(2, &[0], 3);
        other_row.rows[1] = -1.0;
        assert_eq!(
            build(&[expert(1, &[0], 3), other_row], &[0, 1]),
            Err(TranslateError::TokenRows { token: 0 })
        );
        assert!(matches!(
            build(&[expert(70_000, &[0], 3)], &[0]),
            Err(TranslateError::OutOfRange { what: "expert", .. })
        ));
        assert!(matches!(
            Request::from_expert_requests(1, 2, (0, 0), RowFormat::F32, &[], &[]),
            Err(TranslateError::OutOfRange {
                what: "row width",
                ..
            })
        ));
        assert!(matches!(
            Request::from_expert_requests(1, 2, (1 << 20, 3), RowFormat::F32, &[], &[]),
            Err(TranslateError::OutOfRange { what: "layer", .. })
        ));
    }

    #[test]
    fn inconsistent_frames_and_partials_are_errors() {
        let request = build(&[expert(1, &[0, 1], 3)], &[0]).unwrap();
        let out_of_range = Request {
            experts: vec![(1, vec![2])],
            ..request.clone()
        };
        assert_eq!(
            out_of_range.to_expert_requests(),
            Err(TranslateError::RowIndex {
                expert: 1,
                index: 2,
                rows: 2
            })
        );
        let ragged = Request {
            rows: vec![0.0; 4],
            ..request.clone()
        };
        assert!(matches!(
            ragged.to_expert_requests(),
            Err(TranslateError::Ragged { values: 4, .. })
        ));
        assert_eq!(
            Response::from_partials(&request, &[]),
            Err(TranslateError::PartialCount {
                expected: 1,
                got: 0
            })
        );
        assert_eq!(
            Response::from_partials(&request, &[vec![0.0; 5]]),
            Err(TranslateError::PartialSize {
                expert: 1,
                expected: 6,
                got: 5
            })
        );
        let requests = [expert(1, &[0, 1], 3)];
        assert_eq!(
            split_partials(&[0.0; 7], &requests, &[0]),
            Err(TranslateError::ResponseSize {
                expected: 6,
                got: 7
            })
        );
        assert_eq!(
            split_partials(&[], &requests, &[1]),
            Err(TranslateError::NoSuchRequest { index: 1, len: 1 })
        );
    }

    /// A layer step: `hidden`, one row per token (any bits), and per expert (ascending ids)
    /// its tokens in any order.
    fn step() -> impl Strategy<Value = (usize, Vec<ExpertRequest>)> {
        (1usize..6, 1usize..10).prop_flat_map(|(hidden, tokens)| {
            let rows = proptest::collection::vec(any::<u32>(), hidden * tokens);
            let picks = proptest::collection::btree_map(
                any::<u16>(),
                proptest::collection::vec((0..tokens, any::<u32>()), 0..2 * tokens),
                0..6,
            );
            (Just(hidden), rows, picks).prop_map(|(hidden, row_bits, picks)| {
                let requests = picks
                    .into_iter()
                    .map(|(expert, mut picked)| {
                        // Distinct tokens, in an order set by the random keys.
                        picked.sort_by_key(|(token, _)| *token);
                        picked.dedup_by_key(|(token, _)| *token);
                        picked.sort_by_key(|(_, key)| *key);
                        let tokens: Vec<usize> = picked.into_iter().map(|(t, _)| t).collect();
                        let rows = tokens
                            .iter()
                            .flat_map(|t| &row_bits[t * hidden..(t + 1) * hidden])
                            .map(|b| f32::from_bits(*b))
                            .collect();
                        ExpertRequest {
                            expert: expert as usize,
                            tokens,
                            rows,
                        }
                    })
                    .collect();
                (hidden, requests)
            })
        })
    }

    proptest! {
        #[test]
        fn expert_requests_survive_the_wire_and_partials_come_back_per_member(
            (hidden, requests) in step(),
            chosen in proptest::collection::vec(any::<bool>(), 6),
            seed: u32,
        ) {
            let members: Vec<usize> = (0..requests.len()).filter(|i| chosen[*i]).collect();
            let request = Request::from_expert_requests(7, 9, (3, hidden), RowFormat::F32, &requests, &members).unwrap();
            let frame = Message::Request(request.clone()).encode();
            prop_assert_eq!(frame.len(), request.frame_len());
            let Ok(Message::Request(received)) = Message::decode(&frame) else {
                return Err(TestCaseError::fail("the request did not decode"));
            };
            let unpacked = received.to_expert_requests().unwrap();
            prop_assert_eq!(unpacked.len(), members.len());
            // Tokens come back as row indices: the same token, the same index, and only it.
            let mut index_of = HashMap::new();
            let mut token_of = HashMap::new();
            for (&i, got) in members.iter().zip(&unpacked) {
                let sent = &requests[i];
                prop_assert_eq!(got.expert, sent.expert);
                prop_assert_eq!(bits(&got.rows), bits(&sent.rows));
                prop_assert_eq!(got.tokens.len(), sent.tokens.len());
                for (token, index) in sent.tokens.iter().zip(&got.tokens) {
                    prop_assert_eq!(*index_of.entry(*token).or_insert(*index), *index);
                    prop_assert_eq!(*token_of.entry(*index).or_insert(*token), *token);
                }
            }

            // The worker's partials (any bits) back through a response to each member.
            let partials: Vec<Vec<f32>> = unpacked
                .iter()
                .enumerate()
                .map(|(m, r)| {
                    (0..r.rows.len())
                        .map(|v| f32::from_bits(seed.wrapping_mul(2_654_435_761).wrapping_add((m * 1000 + v) as u32)))
                        .collect()
                })
                .collect();
            let response = Response::from_partials(&received, &partials).unwrap();
            prop_assert_eq!(response.id, 9);
            let frame = Message::Response(response).encode();
            prop_assert_eq!(frame.len(), Response::frame_len(request.response_values()));
            let Ok(Message::Response(answer)) = Message::decode(&frame) else {
                return Err(TestCaseError::fail("the response did not decode"));
            };
            let split = split_partials(&answer.partials, &requests, &members).unwrap();
            prop_assert_eq!(split.len(), partials.len());
            for (got, sent) in split.iter().zip(&partials) {
                prop_assert_eq!(bits(got), bits(sent));
            }
        }
    }
}
