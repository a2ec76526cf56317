//! Requests small enough to be proven wrong. Evidence carries a request's body and its
//! response's body in one transaction of at most `MAX_EVIDENCE_TX_BYTES`: a worker lying only
//! on bigger requests (a long prompt's prefill on a wide model) could be caught by an audit
//! but never slashed. So the backbone sends no request whose two bodies could exceed
//! `EVIDENCE_BODIES`: an expert's rows beyond that are split into pieces (`split_rows`, joined
//! back by `join_rows`), and the experts going to one worker are grouped into requests that
//! each fit (`provable_groups`). An expert's output row depends on its input row alone, so
//! the split changes no bit.

use kvasir_inference::moe::ExpertRequest;
use kvasir_ledger::tx::MAX_EVIDENCE_TX_BYTES;

/// What a request's and its response's bodies may take together: the evidence transaction
/// less room for the rest of it (addresses, ids, model id, signatures, framing).
pub(super) const EVIDENCE_BODIES: usize = MAX_EVIDENCE_TX_BYTES - (64 << 10);

/// Room for a request's and a response's fixed fields (ids, layer, width, counts).
const FIXED: usize = 64;

/// An upper bound on what one token of one expert adds to the two bodies: its row in the
/// request (shared rows are counted per expert, so this over-counts), its index, and its
/// partial in the response.
fn per_token(hidden: usize) -> usize {
    hidden.saturating_mul(8).saturating_add(4)
}

/// An upper bound on what `request` adds to the two bodies (its expert id and count too).
fn cost(request: &ExpertRequest, hidden: usize) -> usize {
    request
        .tokens
        .len()
        .saturating_mul(per_token(hidden))
        .saturating_add(8)
}

/// `requests` with every one whose rows alone would not fit `budget` cut into pieces of
/// consecutive tokens that do; with each piece, the index of the request it came from.
/// None when every request fits as it is (the common case: nothing is copied).
pub(super) fn split_rows(
    requests: &[ExpertRequest],
    hidden: usize,
    budget: usize,
) -> Option<(Vec<ExpertRequest>, Vec<usize>)> {
    let room = budget.saturating_sub(FIXED + 8);
    if requests.iter().all(|r| cost(r, hidden) + FIXED <= budget) {
        return None;
    }
    // At least one token per piece: a single row over the budget cannot be made smaller
    // (it is over the frame limit long before).
    let tokens_per_piece = (room / per_token(hidden)).max(1);
    let mut pieces = Vec::new();
    let mut origin = Vec::new();
    for (index, request) in requests.iter().enumerate() {
        for (chunk, tokens) in request.tokens.chunks(tokens_per_piece).enumerate() {
            let start = chunk * tokens_per_piece * hidden;
            let rows = request.rows[start..start + tokens.len() * hidden].to_vec();
            pieces.push(ExpertRequest {
                expert: request.expert,
                tokens: tokens.to_vec(),
                rows,
            });
            origin.push(index);
        }
        if request.tokens.is_empty() {
            pieces.push(request.clone());
            origin.push(index);
        }
    }
    Some((pieces, origin))
}

/// The partials of `count` requests from those of their pieces, in order (`split_rows`).
pub(super) fn join_rows(pieces: Vec<Vec<f32>>, origin: &[usize], count: usize) -> Vec<Vec<f32>> {
    let mut joined = vec![Vec::new(); count];
    for (partial, &index) in pieces.into_iter().zip(origin) {
        joined[index].extend(partial);
    }
    joined
}

/// `members` (indices into `requests`, all for one worker) in consecutive groups whose
/// requests each fit `budget`; each member fits alone after `split_rows`.
pub(super) fn provable_groups(
    members: Vec<usize>,
    requests: &[ExpertRequest],
    hidden: usize,
    budget: usize,
) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut used = FIXED;
    for member in members {
        let cost = cost(&requests[member], hidden);
        match groups.last_mut() {
            Some(group) if used.saturating_add(cost) <= budget => group.push(member),
            _ => {
                groups.push(vec![member]);
                used = FIXED;
            }
        }
        used = used.saturating_add(cost);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_wire::{Message, Request, Response};

    fn expert(expert: usize, tokens: std::ops::Range<usize>, hidden: usize) -> ExpertRequest {
        let tokens: Vec<usize> = tokens.collect();
        ExpertRequest {
            expert,
            rows: tokens
                .iter()
                .flat_map(|t| (0..hidden).map(move |c| (t * hidden + c) as f32))
                .collect(),
            tokens,
        }
    }

    /// The bytes the two bodies of `members` of `requests` really take on the wire.
    fn bodies(requests: &[ExpertRequest], members: &[usize], hidden: usize) -> usize {
        let request = Request::from_expert_requests(
            1,
            2,
            (0, hidden),
            kvasir_wire::RowFormat::F32,
            requests,
            members,
        )
        .unwrap();
        let values = request.response_values();
        let frame = Message::Request(request).encode();
        kvasir_wire::request_body(&frame).len() + Response::frame_len(values)
            - kvasir_wire::HEADER
            - kvasir_wire::SIGNATURE
    }

    #[test]
    fn requests_that_fit_are_left_as_they_are() {
        let requests = [expert(0, 0..3, 4), expert(5, 1..2, 4)];
        assert!(split_rows(&requests, 4, 1024).is_none());
        assert_eq!(
            provable_groups(vec![0, 1], &requests, 4, 1024),
            vec![vec![0, 1]]
        );
    }

    #[test]
    fn long_rows_are_cut_into_pieces_that_fit_and_join_back_in_order() {
        let hidden = 4;
        let budget = 400;
        let requests = [
            expert(0, 0..2, hidden),
            expert(3, 0..20, hidden),
            expert(4, 5..6, hidden),
        ];
        let (pieces, origin) = split_rows(&requests, hidden, budget).unwrap();
        assert!(pieces.len() > 3);
        for (i, piece) in pieces.iter().enumerate() {
            assert_eq!(piece.expert, requests[origin[i]].expert);
            assert!(bodies(&pieces, &[i], hidden) <= budget, "piece {i}");
        }
        // Stand-in partials: the rows themselves, so joining must give each request's rows.
        let partials = pieces.iter().map(|p| p.rows.clone()).collect();
        let joined = join_rows(partials, &origin, requests.len());
        let rows: Vec<Vec<f32>> = requests.iter().map(|r| r.rows.clone()).collect();
        assert_eq!(joined, rows);
        // Grouped for one worker, every request still fits.
        let members: Vec<usize> = (0..pieces.len()).collect();
        let groups = provable_groups(members.clone(), &pieces, hidden, budget);
        assert!(groups.len() > 1);
        assert_eq!(groups.concat(), members);
        for group in &groups {
            assert!(bodies(&pieces, group, hidden) <= budget, "{group:?}");
        }
    }

    #[test]
    fn the_default_budget_leaves_room_in_an_evidence_transaction() {
        let hidden = 4096;
        let requests = [expert(0, 0..400, hidden)];
        let (pieces, _) = split_rows(&requests, hidden, EVIDENCE_BODIES).unwrap();
        for i in 0..pieces.len() {
            assert!(bodies(&pieces, &[i], hidden) <= EVIDENCE_BODIES);
        }
    }
}
