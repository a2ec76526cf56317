//! The ledger's REST API (axum), over the typed bodies of `kvasir_api::ledger`. Amounts
//! travel as base-unit strings next to their exact decimal; errors are `{error, message}`
//! with a fitting status; bodies are size-limited; transactions are decoded with the ledger's
//! canonical, size-checked decoder.
//!
//! - `GET  /healthz`
//! - `GET  /head`: the head block, and which validators' precommits committed it
//! - `GET  /params`: the genesis parameters (rewards, challenge window, bonds, slashing)
//! - `GET  /fees`: what a transaction pays in the next block, and a tip that gets it in
//! - `GET  /validators`: the validator set, its voting power and the quorum
//! - `GET  /accounts/{address}`: settled balance, pending rewards with settle heights and
//!   sessions, nonce, bond, unbonding amounts with release heights, jail
//! - `GET  /accounts/{address}/history`: the account's transfers and credits, newest first
//! - `GET  /blocks/{height}`, `GET /blocks/by-hash/{hash}`: with its commit certificate
//! - `POST /txs` `{"tx": hex of the borsh-encoded signed transaction}` -> `{"hash"}`
//! - `POST /txs/batch[?forwarded=true]` `{"txs": [hex, ...]}` -> `{"results": [{"hash"} or {"error", "message"}]}`
//! - `GET  /txs/{hash}`: pending, committed (height, index) or rejected (reason)
//! - `GET  /sessions/{hub}/{session}`: the receipt high-water mark of a hub session
//! - `GET  /sessions/{hub}`: every credited session of a hub, with its mark
//! - `GET  /offers`, `/orders`, `/placements` (filtered, paged), `/offers/{id}`,
//!   `/orders/{id}`, `/placements/{id}`, `/coverage/{model}`: the market (`market_api`)
//! - `GET  /metrics`: Prometheus text
//! - `GET  /openapi.json`: this list as an OpenAPI document, every body with its schema

use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvasir_api::ledger::{
    AccountView, Batch, BatchVerdicts, BlockView, CertificateView, CommitSignatureView,
    ConvictionView, CreditedSession, Direction, ErrorBody, FeesView, Head, History, HistoryEntry,
    HistoryEvent, HubSessions, OrderQuery, PageQuery, ParamsView, PendingView, PinnedModelView,
    SessionMark, SessionRef, Submission, Submitted, TxState, TxStatus, UnbondingView,
    ValidatorView, ValidatorsView, Verdict,
};
use kvasir_api::schema::{AddressText, HashText};
use kvasir_api::Object;
use kvasir_ledger::certificate::ValidatorSet;
use kvasir_ledger::fees::FeeParams;
use kvasir_ledger::fraction::Fraction;
use kvasir_ledger::mempool::MempoolError;
use kvasir_ledger::state::{MeterKey, SessionKey};
use kvasir_ledger::store::{Storage, TxLocation};
use kvasir_ledger::tx::Evidence;
use kvasir_ledger::{Address, Amount, Block, Certificate, Hash, SignedTx, TxKind};
use utoipa::OpenApi;

use super::{Ledger, Refusal};
use crate::metrics::Exposition;

/// The OpenAPI description of this API, generated from the handlers' annotations.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Kvasir ledger",
        description = "Accounts, blocks, transactions and credits of a Kvasir chain."
    ),
    paths(
        healthz,
        head,
        params,
        fees,
        validators,
        account,
        block_by_height,
        block_by_hash,
        submit,
        submit_batch,
        tx_status,
        history,
        session,
        sessions,
        metrics,
        super::market_api::offers,
        super::market_api::offer,
        super::market_api::orders,
        super::market_api::order,
        super::market_api::placements,
        super::market_api::placement,
        super::market_api::coverage
    )
)]
pub struct ApiDoc;

/// Largest request body: a signed transaction is well under a kilobyte.
const MAX_BODY: usize = 64 << 10;
/// Most transactions in one batch, and the largest batch body.
const MAX_BATCH: usize = 10_000;
const MAX_BATCH_BODY: usize = 16 << 20;

pub(super) type Reply<T> = Result<Json<T>, ApiError>;

pub struct ApiError(StatusCode, &'static str, String);

impl ApiError {
    fn body(self) -> (StatusCode, ErrorBody) {
        let ApiError(status, error, message) = self;
        let body = ErrorBody {
            error: error.to_string(),
            message,
        };
        (status, body)
    }
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let (status, body) = self.body();
        (status, Json(body)).into_response()
    }
}

pub(super) fn bad_request(message: impl ToString) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, "bad_request", message.to_string())
}

pub(super) fn not_found(message: impl ToString) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "not_found", message.to_string())
}

pub(super) fn internal(message: impl ToString) -> ApiError {
    ApiError(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        message.to_string(),
    )
}

/// A path parameter, or a 400 in the API's own form when it is not text (`%FF`).
pub(super) fn path_text<T>(path: Result<Path<T>, PathRejection>) -> Result<T, ApiError> {
    path.map(|Path(value)| value)
        .map_err(|e| bad_request(e.body_text()))
}

/// A body that is not the JSON asked for, with axum's status for it: 400 (not JSON), 413
/// (over the size limit), 415 (not `application/json`) or 422 (JSON of another shape).
fn bad_body(rejection: JsonRejection) -> ApiError {
    let status = rejection.status();
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        _ => "bad_request",
    };
    ApiError(status, kind, rejection.body_text())
}

/// Batch bodies over `MAX_BATCH_BODY` (evidence carrying a large pinned expert, on a chain
/// that pins one) are read two at a time at most, the rest refused with 503: each may take
/// hundreds of MiB while it is read, and anyone may send them. A body that does not say its
/// length counts as large.
async fn one_large_body_at_a_time(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    static LARGE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
    let length = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if length.is_some_and(|l| l <= MAX_BATCH_BODY) {
        return next.run(request).await;
    }
    let Ok(_permit) = LARGE.try_acquire() else {
        return axum::response::IntoResponse::into_response(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            "two large batches are being read; send this one again shortly".into(),
        ));
    };
    next.run(request).await
}

pub fn router(ledger: Arc<Ledger>) -> Router {
    // A batch must fit the largest evidence this chain takes, in hex, with room for the JSON.
    let batch_body =
        MAX_BATCH_BODY.max(2 * ledger.state().genesis().max_evidence_bytes() + (64 << 10));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/head", get(head))
        .route("/params", get(params))
        .route("/fees", get(fees))
        .route("/validators", get(validators))
        .route("/accounts/{address}", get(account))
        .route("/accounts/{address}/history", get(history))
        .route("/blocks/{height}", get(block_by_height))
        .route("/blocks/by-hash/{hash}", get(block_by_hash))
        .route("/txs", post(submit))
        .route(
            "/txs/batch",
            post(submit_batch)
                .layer(DefaultBodyLimit::max(batch_body))
                .layer(axum::middleware::from_fn(one_large_body_at_a_time)),
        )
        .route("/txs/{hash}", get(tx_status))
        .route("/sessions/{hub}/{session}", get(session))
        .route("/sessions/{hub}", get(sessions))
        .route("/metrics", get(metrics))
        .merge(super::market_api::routes())
        .route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
        .fallback(|| async { not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this endpoint takes another method".into(),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(ledger)
}

#[utoipa::path(get, path = "/healthz", description = "Liveness: the text `ok`.", responses((status = 200, description = "ok", body = String, content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok"
}

#[utoipa::path(get, path = "/head", description = "The head block: chain id, height, hash, state root, and the validators whose precommits committed it.", responses((status = 200, body = Head), (status = 500, body = ErrorBody)))]
async fn head(State(ledger): State<Arc<Ledger>>) -> Reply<Head> {
    let state = ledger.state();
    let certificate = ledger.store.certificate(state.height()).map_err(internal)?;
    Ok(Json(Head {
        chain_id: state.chain_id().to_string(),
        height: state.height(),
        hash: state.block_hash(),
        state_root: state.root(),
        timestamp_ms: state.timestamp_ms(),
        signers: certificate.map_or_else(Vec::new, |c| {
            c.signatures.iter().map(|s| s.validator).collect()
        }),
    }))
}

#[utoipa::path(get, path = "/validators", description = "The chain's validator set from genesis, each with its voting power, and the power a commit certificate needs (more than 2/3 of the total).", responses((status = 200, body = ValidatorsView)))]
async fn validators(State(ledger): State<Arc<Ledger>>) -> Json<ValidatorsView> {
    let state = ledger.state();
    let set = ValidatorSet::of(state.genesis());
    let total_voting_power = set.total_power();
    Json(ValidatorsView {
        validators: set
            .members()
            .into_iter()
            .map(|(address, voting_power)| ValidatorView {
                address,
                voting_power,
            })
            .collect(),
        total_voting_power,
        quorum: total_voting_power * 2 / 3 + 1,
    })
}

#[utoipa::path(get, path = "/params", description = "The chain's genesis parameters: rewards, challenge window, block limits, the bond a worker must hold (zero: no bonds), the unbonding delay and what accepted evidence slashes.", responses((status = 200, body = ParamsView)))]
async fn params(State(ledger): State<Arc<Ledger>>) -> Json<ParamsView> {
    let state = ledger.state();
    let genesis = state.genesis();
    let p = &genesis.params;
    Json(ParamsView {
        chain_id: state.chain_id().to_string(),
        format: p.format,
        genesis_hash: genesis.hash(),
        unit_bytes: p.unit_bytes,
        reward_per_unit: p.reward_per_unit.into(),
        challenge_window: p.challenge_window,
        block_interval_ms: p.block_interval_ms,
        max_block_txs: p.max_block_txs,
        max_block_bytes: p.max_block_bytes,
        min_new_account: p.min_new_account.into(),
        min_bond: p.min_bond.into(),
        unbonding_blocks: p.unbonding_blocks,
        slash_fraction: p.slash_fraction,
        reporter_share: p.reporter_share,
        jail_blocks: p.jail_blocks,
        models: genesis
            .models
            .iter()
            .map(|m| PinnedModelView {
                id: m.id.clone(),
                config_hash: m.config_hash,
                experts_root: m.experts_root,
                name: m.name.clone(),
                layers: m.shape.map(|s| s.layers),
                experts: m.shape.map(|s| s.experts),
                arithmetic: m.arithmetic,
            })
            .collect(),
    })
}

#[utoipa::path(get, path = "/fees", description = "What a transaction pays in the next block, per byte of its encoding: the open lane's base fee (burned; it follows block fullness), the reserved lane's fixed price (credits and evidence), and a tip per byte that gets a transaction in ahead of what waits now. On a chain without fees (format 1), `charged` is false and every price zero.", responses((status = 200, body = FeesView)))]
async fn fees(State(ledger): State<Arc<Ledger>>) -> Json<FeesView> {
    let state = ledger.state();
    let p = &state.genesis().params;
    let rules = p.fees.unwrap_or(FeeParams {
        min_base_fee: Amount::ZERO,
        lane_fee: Amount::ZERO,
        lane_share: Fraction::ZERO,
        evidence_deposit: Amount::ZERO,
    });
    let (_, room) = kvasir_ledger::fees::open_lane(&rules, p.max_block_bytes, p.max_block_txs);
    let suggested_tip = match p.fees {
        Some(_) => ledger.suggested_tip(room as usize),
        None => Amount::ZERO,
    };
    Json(FeesView {
        height: state.height(),
        charged: p.fees.is_some(),
        base_fee: state.base_fee().into(),
        min_base_fee: rules.min_base_fee.into(),
        lane_fee: rules.lane_fee.into(),
        lane_share: rules.lane_share,
        suggested_tip: suggested_tip.into(),
        evidence_deposit: rules.evidence_deposit.into(),
    })
}

#[utoipa::path(get, path = "/accounts/{address}", description = "Settled balance, pending rewards with settle heights and sessions, nonce, bond, unbonding amounts with release heights, and whether the key is jailed.", params(("address" = AddressText, Path, description = "A kvr1... address")), responses((status = 200, body = AccountView), (status = 400, body = ErrorBody)))]
async fn account(
    State(ledger): State<Arc<Ledger>>,
    address: Result<Path<String>, PathRejection>,
) -> Reply<AccountView> {
    let address = path_text(address)?;
    let address = Address::from_str(&address).map_err(bad_request)?;
    let state = ledger.state();
    let account = state.account(&address);
    // Owed claims paid when the pool refilled are kept under the pool's key: no session.
    let pool = state.genesis().rewards_pool_address();
    Ok(Json(AccountView {
        address,
        balance: account.balance.into(),
        pending: account
            .pending
            .iter()
            .map(|p| PendingView {
                amount: p.amount.into(),
                settle_height: p.settle_height,
                session: (p.session.hub != pool).then_some(SessionRef {
                    hub: p.session.hub,
                    session_id: p.session.session_id,
                }),
                order: (p.order != 0).then_some(p.order),
            })
            .collect(),
        pending_total: account.pending_total().into(),
        owed: account.owed.into(),
        nonce: account.nonce,
        bonded: account.bonded.into(),
        unbonding: account
            .unbonding
            .iter()
            .map(|u| UnbondingView {
                amount: u.amount.into(),
                release_height: u.release_height,
            })
            .collect(),
        unbonding_total: account.unbonding_total().into(),
        jailed_until: account.jailed_until,
        // As credits judge it (`tx::credit`): the block being built is the one after the head.
        jailed: account.is_jailed(state.height().saturating_add(1)),
        convictions: account
            .convictions
            .iter()
            .map(ConvictionView::from)
            .collect(),
    }))
}

/// Entries one history request returns at most.
const HISTORY_ENTRIES: usize = 100;

/// `?before=HEIGHT.INDEX` (or `HEIGHT`) pages back through a long history.
#[derive(serde::Deserialize)]
struct HistoryQuery {
    before: Option<String>,
}

/// Decimal digits and nothing else, at most `max_digits` of them (`str::parse` would also take
/// `+7`, which the document does not allow).
pub(super) fn decimal<T: FromStr>(text: &str, max_digits: usize) -> Option<T> {
    let digits = !text.is_empty() && text.len() <= max_digits;
    (digits && text.bytes().all(|b| b.is_ascii_digit()))
        .then(|| text.parse().ok())
        .flatten()
}

/// Digits of the largest u64 (and of a u32 index, for `before`) that the document admits.
pub(super) const U64_DIGITS: usize = 20;

/// `12.3` is transaction 3 of block 12; `12` is the start of block 12. At most 19 and 9
/// digits, as the document's pattern says, so every text it admits parses.
fn parse_location(text: &str) -> Result<TxLocation, ApiError> {
    let bad = || bad_request(format!("{text:?} is not HEIGHT or HEIGHT.INDEX"));
    let (height, index) = text.split_once('.').unwrap_or((text, "0"));
    Ok(TxLocation {
        height: decimal(height, 19).ok_or_else(bad)?,
        index: decimal(index, 9).ok_or_else(bad)?,
    })
}

#[utoipa::path(get, path = "/accounts/{address}/history", description = "The transactions the account is a party to, newest first, at most 100: transfers in and out and credits it received. `before` lists those before a location; `next_before` is its value for the next page (absent on the last).", params(("address" = AddressText, Path, description = "A kvr1... address"), ("before" = Option<String>, Query, pattern = "^[0-9]{1,19}(\\.[0-9]{1,9})?$", description = "HEIGHT.INDEX or HEIGHT: only entries before it")), responses((status = 200, body = History), (status = 400, body = ErrorBody), (status = 500, body = ErrorBody)))]
async fn history(
    State(ledger): State<Arc<Ledger>>,
    address: Result<Path<String>, PathRejection>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Reply<History> {
    let address = path_text(address)?;
    let address = Address::from_str(&address).map_err(bad_request)?;
    let Query(query) = query.map_err(bad_request)?;
    let before = query.before.as_deref().map(parse_location).transpose()?;
    let entries = tokio::task::spawn_blocking(move || -> Result<Vec<HistoryEntry>, ApiError> {
        let locations = ledger
            .store
            .history(&address, before, HISTORY_ENTRIES)
            .map_err(internal)?;
        let mut block: Option<Block> = None;
        let mut entries = Vec::with_capacity(locations.len());
        for location in locations {
            if block.as_ref().map(|b| b.header.height) != Some(location.height) {
                block = ledger.store.block(location.height).map_err(internal)?;
            }
            let tx = block
                .as_ref()
                .and_then(|b| b.txs.get(location.index as usize))
                .ok_or_else(|| {
                    internal(format!(
                        "history names a missing transaction at {location:?}"
                    ))
                })?;
            entries.push(history_entry(tx, &address, location));
        }
        Ok(entries)
    })
    .await
    .map_err(internal)??;
    let next_before = match entries.len() {
        HISTORY_ENTRIES => entries.last().map(HistoryEntry::location),
        _ => None,
    };
    Ok(Json(History {
        address,
        entries,
        next_before,
    }))
}

fn evidence_event(reporter: &Address, evidence: &Evidence) -> HistoryEvent {
    HistoryEvent::Evidence {
        reporter: *reporter,
        worker: evidence.worker,
        hub: evidence.hub,
        session_id: evidence.session,
        request_id: evidence.request_id,
    }
}

/// One line of an account's history, as `address` sees `tx`.
fn history_entry(tx: &SignedTx, address: &Address, location: TxLocation) -> HistoryEntry {
    let t = &tx.tx;
    let event = match &t.kind {
        TxKind::Transfer { to, amount } => HistoryEvent::Transfer {
            direction: if t.sender == *address {
                Direction::Out
            } else {
                Direction::In
            },
            from: t.sender,
            to: *to,
            amount: (*amount).into(),
        },
        TxKind::Credit(signed) => HistoryEvent::Credit {
            worker: signed.receipt.worker,
            gateway: t.sender,
            hub: signed.receipt.hub,
            session_id: signed.receipt.session_id,
            order: signed.receipt.order,
            cumulative_bytes: signed.receipt.cumulative_bytes,
        },
        TxKind::Bond { amount } => HistoryEvent::Bond {
            amount: (*amount).into(),
        },
        TxKind::Unbond { amount } => HistoryEvent::Unbond {
            amount: (*amount).into(),
        },
        TxKind::Evidence(evidence) => evidence_event(&t.sender, evidence),
        TxKind::ExpertEvidence(e) => evidence_event(&t.sender, &e.evidence),
        TxKind::OfferCreate(new) => HistoryEvent::OfferCreate {
            model: new.model.clone(),
            experts: new.experts.to_string(),
            price: new.price.into(),
            expiry_height: new.expiry_height,
        },
        TxKind::OfferWithdraw { offer } => HistoryEvent::OfferWithdraw { offer: *offer },
        TxKind::OrderCreate(new) => HistoryEvent::OrderCreate {
            model: new.model.clone(),
            experts: new.experts.to_string(),
            replicas: new.replicas,
            max_price: new.max_price.into(),
            deposit: new.deposit.into(),
            end_height: new.end_height,
        },
        TxKind::OrderDeposit { order, amount } => HistoryEvent::OrderDeposit {
            order: *order,
            amount: (*amount).into(),
        },
        TxKind::OrderClose { order } => HistoryEvent::OrderClose { order: *order },
    };
    HistoryEntry {
        height: location.height,
        index: location.index,
        hash: tx.hash(),
        event,
    }
}

fn block_view(block: &Block, certificate: Option<Certificate>) -> BlockView {
    let h = &block.header;
    BlockView {
        height: h.height,
        hash: block.hash(),
        prev_hash: h.prev_hash,
        timestamp_ms: h.timestamp_ms,
        tx_root: h.tx_root,
        state_root: h.state_root,
        proposer: h.proposer,
        txs: block.txs.iter().map(SignedTx::hash).collect(),
        certificate: certificate.map(|c| CertificateView {
            round: c.round,
            signatures: c
                .signatures
                .into_iter()
                .map(|s| CommitSignatureView {
                    validator: s.validator,
                    signature: hex::encode(s.signature.0),
                })
                .collect(),
        }),
    }
}

fn stored_block(ledger: &Ledger, height: u64) -> Reply<BlockView> {
    match ledger.store.block(height).map_err(internal)? {
        Some(block) => {
            let certificate = ledger.store.certificate(height).map_err(internal)?;
            Ok(Json(block_view(&block, certificate)))
        }
        None => Err(not_found(format!("no block at height {height}"))),
    }
}

#[utoipa::path(get, path = "/blocks/{height}", description = "A block by height.", params(("height" = u64, Path, maximum = 18446744073709551615u64, description = "Block height")), responses((status = 200, body = BlockView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 500, body = ErrorBody)))]
async fn block_by_height(
    State(ledger): State<Arc<Ledger>>,
    height: Result<Path<String>, PathRejection>,
) -> Reply<BlockView> {
    let height = path_text(height)?;
    let height: u64 = decimal(&height, U64_DIGITS)
        .ok_or_else(|| bad_request(format!("{height:?} is not a block height")))?;
    stored_block(&ledger, height)
}

#[utoipa::path(get, path = "/blocks/by-hash/{hash}", description = "A block by hash.", params(("hash" = HashText, Path, description = "Block hash, hex")), responses((status = 200, body = BlockView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 500, body = ErrorBody)))]
async fn block_by_hash(
    State(ledger): State<Arc<Ledger>>,
    hash: Result<Path<String>, PathRejection>,
) -> Reply<BlockView> {
    let hash = path_text(hash)?;
    let hash = Hash::from_str(&hash).map_err(bad_request)?;
    match ledger.store.height_of(&hash).map_err(internal)? {
        Some(height) => stored_block(&ledger, height),
        None => Err(not_found(format!("no block {hash}"))),
    }
}

/// Hex of a transaction's canonical bytes, decoded by the ledger's own size-checked decoder
/// (no trailing bytes, nothing over `MAX_TX_BYTES`): what is admitted is exactly what is
/// hashed and signed.
fn decode_tx(text: &str) -> Result<SignedTx, ApiError> {
    let bytes = hex::decode(text).map_err(|e| bad_request(format!("tx is not hex: {e}")))?;
    SignedTx::from_bytes(&bytes).map_err(|e| bad_request(format!("tx: {e}")))
}

fn refusal(refusal: Refusal) -> ApiError {
    let (status, kind) = match &refusal {
        Refusal::Invalid(_) | Refusal::Mempool(MempoolError::Invalid(_)) => {
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid_tx")
        }
        Refusal::Mempool(MempoolError::EvidenceNotNext { .. }) => {
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid_tx")
        }
        Refusal::Mempool(MempoolError::Full(_) | MempoolError::FullBytes(_)) => {
            (StatusCode::SERVICE_UNAVAILABLE, "mempool_full")
        }
        Refusal::Mempool(
            MempoolError::NonceTooFarAhead { .. } | MempoolError::SenderFull { .. },
        ) => (StatusCode::TOO_MANY_REQUESTS, "sender_limit"),
        Refusal::Mempool(
            MempoolError::Duplicate(_)
            | MempoolError::NonceTaken(..)
            | MempoolError::EvidenceWaiting { .. },
        ) => (StatusCode::CONFLICT, "conflict"),
        Refusal::EvidenceBusy | Refusal::Mempool(MempoolError::EvidenceFull(_)) => {
            (StatusCode::TOO_MANY_REQUESTS, "evidence_busy")
        }
    };
    ApiError(status, kind, refusal.to_string())
}

#[utoipa::path(post, path = "/txs", description = "Submit one signed transaction: {\"tx\": hex of its borsh bytes}.", request_body = Submission, responses((status = 202, description = "Admitted to the mempool", body = Submitted), (status = 400, description = "Not JSON, not hex, or not a canonical signed transaction", body = ErrorBody), (status = 409, description = "Already pending, or its nonce is taken, or evidence against the same session is already waiting", body = ErrorBody), (status = 413, description = "Body over 64 KiB", body = ErrorBody), (status = 415, description = "Not application/json", body = ErrorBody), (status = 422, description = "JSON of another shape, or a transaction failing a check (signature, nonce, funds, authority, ...)", body = ErrorBody), (status = 429, description = "Its sender has as many transactions waiting as it may, or its nonce is further ahead than that; or it is evidence that could not take its turn to be recomputed soon (evidence_busy: submit it again)", body = ErrorBody), (status = 500, body = ErrorBody), (status = 503, description = "The mempool is full", body = ErrorBody)))]
async fn submit(
    State(ledger): State<Arc<Ledger>>,
    body: Result<Json<Object<Submission>>, JsonRejection>,
) -> Result<(StatusCode, Json<Submitted>), ApiError> {
    let Json(Object(submission)) = body.map_err(bad_body)?;
    let tx = decode_tx(&submission.tx)?;
    let verdict = tokio::task::spawn_blocking(move || ledger.submit(vec![tx], false))
        .await
        .map_err(internal)?
        .pop()
        .ok_or_else(|| internal("no verdict"))?;
    let hash = verdict.map_err(refusal)?;
    Ok((StatusCode::ACCEPTED, Json(Submitted { hash })))
}

/// `?forwarded=true`: the batch comes from another node, which forwarded it already.
#[derive(serde::Deserialize)]
struct BatchQuery {
    forwarded: Option<bool>,
}

/// Many transactions in one request (what the gateway's crediting sends): one verdict each,
/// in order; the request fails only when the batch itself is malformed.
#[utoipa::path(post, path = "/txs/batch", description = "Submit up to 10,000 signed transactions: {\"txs\": [hex, ...]}; one verdict each, in order.", params(("forwarded" = Option<bool>, Query, description = "true when another node forwards what its clients submitted: admitted here, not forwarded again")), request_body = Batch, responses((status = 202, description = "One verdict per transaction", body = BatchVerdicts), (status = 400, description = "Not JSON, over 10,000 transactions, one is not a canonical signed transaction, or `forwarded` is not true or false", body = ErrorBody), (status = 413, description = "Body over 16 MiB", body = ErrorBody), (status = 415, description = "Not application/json", body = ErrorBody), (status = 422, description = "JSON of another shape", body = ErrorBody), (status = 500, body = ErrorBody)))]
async fn submit_batch(
    State(ledger): State<Arc<Ledger>>,
    query: Result<Query<BatchQuery>, QueryRejection>,
    body: Result<Json<Object<Batch>>, JsonRejection>,
) -> Result<(StatusCode, Json<BatchVerdicts>), ApiError> {
    let Query(query) = query.map_err(bad_request)?;
    let forwarded = query.forwarded.unwrap_or(false);
    let Json(Object(batch)) = body.map_err(bad_body)?;
    if batch.txs.len() > MAX_BATCH {
        return Err(bad_request(format!(
            "a batch holds at most {MAX_BATCH} transactions"
        )));
    }
    let txs = batch
        .txs
        .iter()
        .map(|t| decode_tx(t))
        .collect::<Result<Vec<_>, _>>()?;
    let verdicts = tokio::task::spawn_blocking(move || ledger.submit(txs, forwarded))
        .await
        .map_err(internal)?;
    let results = verdicts
        .into_iter()
        .map(|verdict| match verdict {
            Ok(hash) => Verdict::Admitted(Submitted { hash }),
            Err(e) => Verdict::Refused(refusal(e).body().1),
        })
        .collect();
    Ok((StatusCode::ACCEPTED, Json(BatchVerdicts { results })))
}

#[utoipa::path(get, path = "/txs/{hash}", description = "A transaction: pending, committed (height, index) or rejected (reason).", params(("hash" = HashText, Path, description = "Transaction hash, hex")), responses((status = 200, body = TxStatus), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 500, body = ErrorBody)))]
async fn tx_status(
    State(ledger): State<Arc<Ledger>>,
    hash: Result<Path<String>, PathRejection>,
) -> Reply<TxStatus> {
    let hash = path_text(hash)?;
    let hash = Hash::from_str(&hash).map_err(bad_request)?;
    // The head first: a block is written to the store before the head moves to it, and a
    // transaction reported committed must be visible in what every other read serves (in
    // between it is still pending).
    let head = ledger.state().height();
    let state = match ledger.store.tx_location(&hash).map_err(internal)? {
        Some(location) if location.height <= head => TxState::Committed {
            height: location.height,
            index: location.index,
        },
        Some(_) => TxState::Pending,
        None if ledger.is_pending(&hash) => TxState::Pending,
        None => match ledger.rejection(&hash) {
            Some(rejection) => TxState::Rejected {
                reason: rejection.0,
            },
            None => return Err(not_found(format!("no transaction {hash}"))),
        },
    };
    Ok(Json(TxStatus { hash, state }))
}

#[utoipa::path(get, path = "/sessions/{hub}/{session}", description = "The receipt high-water mark of one hub session's traffic for an order (`order`, default 0: outside any order; 0 bytes and no worker if never credited), and what accepted evidence against the session did, if any.", params(("hub" = AddressText, Path, description = "The hub address"), ("session" = u64, Path, maximum = 18446744073709551615u64, description = "Session id"), OrderQuery), responses((status = 200, body = SessionMark), (status = 400, body = ErrorBody)))]
async fn session(
    State(ledger): State<Arc<Ledger>>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<OrderQuery>, QueryRejection>,
) -> Reply<SessionMark> {
    let Query(query) = query.map_err(bad_request)?;
    let order = query.order.unwrap_or(0);
    let (hub, session) = path_text(path)?;
    let hub = Address::from_str(&hub).map_err(bad_request)?;
    let session_id: u64 = decimal(&session, U64_DIGITS)
        .ok_or_else(|| bad_request(format!("{session:?} is not a session id")))?;
    let state = ledger.state();
    let key = SessionKey { hub, session_id };
    let worker = state.session_worker(&key);
    let mark = state.receipt_mark(&MeterKey {
        session: key,
        order,
    });
    let conviction = worker.and_then(|w| {
        let worker = state.account(&w);
        let found = worker.convictions.iter().find(|c| c.session == key);
        found.map(ConvictionView::from)
    });
    Ok(Json(SessionMark {
        hub,
        session_id,
        order,
        worker,
        cumulative_bytes: mark.map_or(0, |m| m.cumulative_bytes),
        conviction,
    }))
}

#[utoipa::path(get, path = "/sessions/{hub}", description = "A page of a hub's credited sessions, in id order: those with an id above `after`, at most `limit` (default 1,000, at most 10,000); `next_after` continues.", params(("hub" = AddressText, Path, description = "The hub address"), PageQuery), responses((status = 200, body = HubSessions), (status = 400, body = ErrorBody)))]
async fn sessions(
    State(ledger): State<Arc<Ledger>>,
    hub: Result<Path<String>, PathRejection>,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Reply<HubSessions> {
    let hub = path_text(hub)?;
    let hub = Address::from_str(&hub).map_err(bad_request)?;
    let Query(page) = query.map_err(bad_request)?;
    let (after, limit) = (page.after.unwrap_or(0), page.limit());
    let state = ledger.state();
    let mut sessions: Vec<CreditedSession> = state
        .receipts()
        .filter(|(key, _)| key.session.hub == hub && key.session.session_id > after)
        .take(limit + 1)
        .map(|(key, mark)| CreditedSession {
            session_id: key.session.session_id,
            order: key.order,
            worker: mark.worker,
            cumulative_bytes: mark.cumulative_bytes,
        })
        .collect();
    let next_after = (sessions.len() > limit).then(|| {
        sessions.truncate(limit);
        sessions.last().map_or(after, |s| s.session_id)
    });
    Ok(Json(HubSessions {
        hub,
        sessions,
        next_after,
    }))
}

#[utoipa::path(get, path = "/metrics", description = "Prometheus text: height, blocks produced, mempool, credited sessions.", responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(ledger): State<Arc<Ledger>>) -> String {
    let state = ledger.state();
    let credits = state.receipts().count() as u64;
    let refusals = ledger.refusals();
    Exposition::default()
        .gauge("kvasir_height", "Height of the head block.", state.height())
        .counter(
            "kvasir_blocks_produced_total",
            "Blocks this node made since it started.",
            ledger.blocks_produced.load(Ordering::Relaxed),
        )
        .histogram(
            "kvasir_block_interval_seconds",
            "Time between consecutive blocks made by this node.",
            &ledger.block_interval,
        )
        .gauge(
            "kvasir_mempool_transactions",
            "Transactions waiting for a block.",
            ledger.mempool_len() as u64,
        )
        .labelled_counter(
            "kvasir_refused_transactions_total",
            "Transactions refused at admission or dropped from a block, by reason.",
            "reason",
            refusals.iter().map(|(why, n)| (why.as_str(), *n)),
        )
        .gauge(
            "kvasir_credited_sessions",
            "Hub sessions with a credited receipt.",
            credits,
        )
        .text()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use super::*;

    /// Two large batch bodies are read at once; a third, or one that does not say its length,
    /// is refused at once with 503 while they are; a small one is never held back.
    #[test]
    fn large_batch_bodies_are_read_two_at_a_time() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/",
            post(|body: axum::body::Bytes| async move { body.len().to_string() })
                .layer(DefaultBodyLimit::disable())
                .layer(axum::middleware::from_fn(one_large_body_at_a_time)),
        );
        runtime.spawn(async move { axum::serve(listener, app).await });
        let send = |head: &str| {
            let mut stream = TcpStream::connect(addr).unwrap();
            // A reply that never comes fails the test instead of hanging it.
            let patience = Some(std::time::Duration::from_secs(10));
            stream.set_read_timeout(patience).unwrap();
            stream.write_all(head.as_bytes()).unwrap();
            stream.write_all(b"x").unwrap();
            stream
        };
        let status = |stream: &mut TcpStream| {
            let mut reply = [0u8; 12];
            stream.read_exact(&mut reply).unwrap();
            String::from_utf8_lossy(&reply[9..12]).to_string()
        };
        let large = format!(
            "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            MAX_BATCH_BODY + 1
        );
        // Two large bodies, still being sent, hold both places.
        let _held = [send(&large), send(&large)];
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(status(&mut send(&large)), "503");
        let chunked = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(status(&mut send(chunked)), "503");
        let mut small = send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n");
        assert_eq!(status(&mut small), "200");
    }
}
