//! `GET /receipts` on the registry listener: every session's cumulative count, signed by the
//! hub as a receipt the gateway can put in a Credit transaction.

use std::sync::Arc;

use axum::extract::State as AxumState;
use axum::http::StatusCode;
use axum::Json;
use kvasir_api::registry::{ReceiptEntry, ReceiptListing};
use kvasir_api::ErrorBody;
use kvasir_ledger::tx::Receipt;

use super::Hub;

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

/// `GET /receipts`: every session's signed cumulative receipt.
#[utoipa::path(get, path = "/receipts", description = "Every session's cumulative metered bytes, signed by the hub as a receipt.", responses((status = 200, body = ReceiptListing), (status = 500, description = "The registry could not be read", body = ErrorBody)))]
pub(super) async fn receipts(
    AxumState(hub): AxumState<Arc<Hub>>,
) -> Result<Json<ReceiptListing>, (StatusCode, Json<ErrorBody>)> {
    let internal = |e: anyhow::Error| {
        let body = ErrorBody {
            error: "internal".into(),
            message: format!("{e:#}"),
        };
        (StatusCode::INTERNAL_SERVER_ERROR, Json(body))
    };
    let signer = hub.clone();
    let sessions = tokio::task::spawn_blocking(move || signer.registry.sessions())
        .await
        .map_err(|e| internal(e.into()))?
        .map_err(internal)?;
    let receipts = sessions
        .into_iter()
        .map(|(session_id, record)| {
            let signed = Receipt {
                chain_id: hub.chain_id.clone(),
                hub: hub.key.address(),
                session_id,
                worker: record.worker,
                cumulative_bytes: record.cumulative_bytes,
            }
            .sign(&hub.key);
            ReceiptEntry::new(&signed)
        })
        .collect();
    Ok(Json(ReceiptListing {
        chain_id: hub.chain_id.clone(),
        hub: hub.key.address(),
        receipts,
    }))
}
