//! `GET /receipts` on the registry listener: every session's cumulative count, signed by the
//! hub as a receipt the gateway can put in a Credit transaction.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State as AxumState};
use axum::http::StatusCode;
use axum::Json;
use kvasir_api::registry::{ReceiptEntry, ReceiptListing, ReceiptQuery};
use kvasir_api::ErrorBody;
use kvasir_ledger::tx::{Receipt, SignedReceipt};

use super::registry::SessionRecord;
use super::Hub;

impl SessionRecord {
    /// This session's cumulative count as a receipt signed by `hub`.
    fn signed_receipt(&self, hub: &Hub, session_id: u64) -> SignedReceipt {
        Receipt {
            chain_id: hub.chain_id.clone(),
            hub: hub.key.address(),
            session_id,
            worker: self.worker,
            order: self.order,
            cumulative_bytes: self.cumulative_bytes,
        }
        .sign(&hub.key)
    }
}

/// The OpenAPI description of the registry endpoint.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Kvasir hub registry",
        description = "Signed cumulative receipts per session."
    ),
    paths(receipts)
)]
pub(super) struct RegistryDoc;

/// `GET /receipts?after=ID&limit=N` or `?since=MARK&limit=N`: a page of the sessions that
/// metered something (all of them by id, or only those whose count rose after a mark), each
/// with its signed cumulative receipt. An unreadable record is logged and left out, so one
/// cannot stall crediting for everyone.
#[utoipa::path(get, path = "/receipts", description = "A page of the sessions that metered something, each with its cumulative bytes signed by the hub as a receipt, at most `limit` (default 1,000, at most 10,000): in id order, ids above `after` (`next_after` continues), or, with `since`, only those whose count rose after that `mark` of an earlier listing, in the order they changed (`next_since` continues; `after` then only filters by id). Every listing's `mark` is where the next `since` listing starts.", params(ReceiptQuery), responses((status = 200, body = ReceiptListing), (status = 400, description = "A bad `after`, `since` or `limit`", body = ErrorBody), (status = 500, description = "The registry could not be read", body = ErrorBody)))]
pub(super) async fn receipts(
    AxumState(hub): AxumState<Arc<Hub>>,
    query: Result<Query<ReceiptQuery>, QueryRejection>,
) -> Result<Json<ReceiptListing>, (StatusCode, Json<ErrorBody>)> {
    let failed = |status: StatusCode, error: &str, message: String| {
        let body = ErrorBody {
            error: error.into(),
            message,
        };
        (status, Json(body))
    };
    let Query(page) =
        query.map_err(|e| failed(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let internal = |e: anyhow::Error| {
        failed(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("{e:#}"),
        )
    };
    let reader = hub.clone();
    let limit = page.limit();
    let after = page.after.unwrap_or(0);
    let read = move || match page.since {
        // With `since`, `after` only filters: the listing pages by change.
        Some(since) => reader.registry.changed(since, limit).map(|mut changed| {
            changed.sessions.retain(|(session, _)| *session > after);
            changed
        }),
        None => reader.registry.page(after, limit),
    };
    let by_change = page.since.is_some();
    let page = tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| internal(e.into()))?
        .map_err(internal)?;
    let receipts = page
        .sessions
        .into_iter()
        .filter_map(|(session_id, record)| match record {
            Ok(record) => Some(record.signed_receipt(&hub, session_id)),
            Err(e) => {
                tracing::error!("{e}");
                None
            }
        })
        .map(|signed| ReceiptEntry::new(&signed))
        .collect();
    Ok(Json(ReceiptListing {
        chain_id: hub.chain_id.clone(),
        hub: hub.key.address(),
        receipts,
        next_after: page.next.filter(|_| !by_change),
        next_since: page.next.filter(|_| by_change),
        mark: Some(page.mark),
    }))
}
