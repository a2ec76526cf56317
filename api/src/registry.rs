//! The hub's registry endpoint (`GET /receipts` on `--registry-listen`), polled by the
//! gateway's crediting: every session's cumulative count, signed by the hub.

use borsh::BorshDeserialize;
use kvasir_ledger::{Address, SignedReceipt};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::schema::AddressText;

/// A signed receipt is about 200 bytes; anything far larger is not one.
const MAX_SIGNED_HEX: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
/// `GET /receipts?after=ID&limit=N`: a page of the sessions that metered something, in id
/// order.
pub struct ReceiptListing {
    pub chain_id: String,
    #[schema(value_type = AddressText)]
    pub hub: Address,
    pub receipts: Vec<ReceiptEntry>,
    /// `after` for the next page of an id listing; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
    /// `since` for the next page of a change listing; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_since: Option<u64>,
    /// Pass as `since` to list only the sessions whose count rose after this page was read
    /// (of a change listing: after its last change). Absent from a hub without change
    /// listings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mark: Option<u64>,
}

/// `?after=ID&limit=N` (in session-id order) or `?since=MARK&limit=N` (only sessions whose
/// count rose after `MARK`, a listing's `mark`, in the order they changed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReceiptQuery {
    /// Only sessions with a greater id (the previous page's `next_after`).
    #[param(maximum = 18446744073709551615u64)]
    pub after: Option<u64>,
    /// Only sessions whose count rose after this mark; `after` then only filters by id.
    #[param(maximum = 18446744073709551615u64)]
    pub since: Option<u64>,
    /// At most this many (default 1,000; more is read as 10,000).
    #[param(maximum = 18446744073709551615u64)]
    pub limit: Option<u64>,
}

impl ReceiptQuery {
    pub fn limit(&self) -> usize {
        crate::ledger::PageQuery {
            after: None,
            limit: self.limit,
        }
        .limit()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReceiptEntry {
    pub session_id: u64,
    /// The market order the session's traffic was for; zero (the default) for none.
    #[serde(default)]
    pub order: u64,
    #[schema(value_type = AddressText)]
    pub worker: Address,
    pub cumulative_bytes: u64,
    /// The signed receipt, borsh-encoded, in hex: what a Credit transaction carries.
    pub signed: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    #[error("signed receipt is {0} hex digits, more than any receipt")]
    TooLong(usize),
    #[error("signed receipt is not hex: {0}")]
    Hex(#[from] hex::FromHexError),
    #[error("not a signed receipt: {0}")]
    Decode(std::io::Error),
    #[error("the signed receipt says session {got}, the listing {listed}")]
    Mismatch { listed: u64, got: u64 },
}

impl ReceiptEntry {
    pub fn new(signed: &SignedReceipt) -> ReceiptEntry {
        let r = &signed.receipt;
        ReceiptEntry {
            session_id: r.session_id,
            order: r.order,
            worker: r.worker,
            cumulative_bytes: r.cumulative_bytes,
            // Writing borsh into a Vec cannot fail.
            signed: hex::encode(borsh::to_vec(signed).unwrap_or_default()),
        }
    }

    /// The signed receipt it carries, checked to say what the listing says. Its signature is
    /// the ledger's to check.
    pub fn signed_receipt(&self) -> Result<SignedReceipt, ReceiptError> {
        if self.signed.len() > MAX_SIGNED_HEX {
            return Err(ReceiptError::TooLong(self.signed.len()));
        }
        let bytes = hex::decode(&self.signed)?;
        let signed = SignedReceipt::try_from_slice(&bytes).map_err(ReceiptError::Decode)?;
        let r = &signed.receipt;
        if (r.session_id, r.worker, r.order, r.cumulative_bytes)
            != (
                self.session_id,
                self.worker,
                self.order,
                self.cumulative_bytes,
            )
        {
            return Err(ReceiptError::Mismatch {
                listed: self.session_id,
                got: r.session_id,
            });
        }
        Ok(signed)
    }
}
