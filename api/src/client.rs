//! A blocking client of the ledger REST API (a ledger node, or the gateway in front of one)
//! and of the hub's registry. Every reply is decoded into its typed body; errors name what
//! went wrong in one line: the node unreachable, a reply that is not the documented body, or
//! the API's own `{error, message}`.
//!
//! A client may be given several nodes of one chain, comma-separated
//! (`http://a:7200,http://b:7200`): a request that cannot reach one is sent to the next, and
//! the client stays with the node that answered.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvasir_ledger::fees::Lane;
use kvasir_ledger::{Address, Amount, Hash, Keypair, SignedTx, TxKind};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::ledger::{
    AccountView, Batch, BatchVerdicts, BlockView, CreditedSession, ErrorBody, FeesView, Head,
    History, HubSessions, ParamsView, SessionMark, Submission, Submitted, TxState, TxStatus,
    Verdict, PAGE_MAX,
};
use crate::market::{
    percent, CoverageView, MarketQuery, OfferPage, OfferView, OrderPage, OrderView, PlacementPage,
    PlacementView,
};
use crate::registry::ReceiptListing;

/// Most bytes of a reply read (ureq's own default): a peer cannot make the client allocate
/// without bound.
const MAX_REPLY: u64 = 10 << 20;
/// Placements of one order read at most (`Client::order_placements`).
pub const MAX_ORDER_PLACEMENTS: usize = 100_000;
/// How long one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{message} ({error}, HTTP {status})")]
    Api {
        status: u16,
        error: String,
        message: String,
    },
    #[error("unexpected reply from {url}: {reason}")]
    BadReply { url: String, reason: String },
    #[error("transaction {hash} was rejected: {reason}")]
    Rejected { hash: Hash, reason: String },
    #[error("transaction {0} was not committed in time")]
    Timeout(Hash),
    #[error("certificate file {path}: {reason}")]
    Ca { path: String, reason: String },
}

/// A signed transaction as the API takes it: borsh bytes in hex.
pub fn tx_hex(tx: &SignedTx) -> String {
    hex::encode(tx.to_bytes())
}

pub struct Client {
    /// The nodes, in the order they are tried.
    bases: Vec<String>,
    /// The one that answered last.
    current: AtomicUsize,
    agent: ureq::Agent,
}

impl Client {
    /// A client of the API at `base`, e.g. `http://127.0.0.1:7200`, or of any of several
    /// comma-separated nodes; an `https://` base is verified against the public web roots.
    pub fn new(base: &str) -> Client {
        Client::with_agent(base, ureq::Agent::config_builder())
    }

    /// A client that trusts the PEM certificate(s) in `ca` over HTTPS, in place of the web's
    /// roots (a self-signed gateway).
    pub fn with_ca(base: &str, ca: Option<&Path>) -> Result<Client, ClientError> {
        let Some(path) = ca else {
            return Ok(Client::new(base));
        };
        let error = |reason: String| ClientError::Ca {
            path: path.display().to_string(),
            reason,
        };
        let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
        let mut certs = Vec::new();
        for item in ureq::tls::parse_pem(&pem) {
            if let ureq::tls::PemItem::Certificate(cert) = item.map_err(|e| error(e.to_string()))? {
                certs.push(cert);
            }
        }
        if certs.is_empty() {
            return Err(error("no PEM certificate in it".into()));
        }
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::new_with_certs(&certs))
            .build();
        Ok(Client::with_agent(
            base,
            ureq::Agent::config_builder().tls_config(tls),
        ))
    }

    fn with_agent(
        base: &str,
        config: ureq::config::ConfigBuilder<ureq::typestate::AgentScope>,
    ) -> Client {
        let agent = config
            .http_status_as_error(false)
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build()
            .into();
        Client {
            bases: base
                .split(',')
                .map(|b| b.trim().trim_end_matches('/').to_string())
                .filter(|b| !b.is_empty())
                .collect(),
            current: AtomicUsize::new(0),
            agent,
        }
    }

    /// The node answering now.
    fn base(&self) -> &str {
        let current = self.current.load(Ordering::Relaxed);
        self.bases.get(current).map_or("", String::as_str)
    }

    /// Sends `call` (given the agent and the full URL of `path`) to the current node, and to
    /// each next one while a node cannot be reached; the reply's body as text on a 2xx
    /// status, else the API's error.
    fn send(
        &self,
        path: &str,
        call: impl Fn(&ureq::Agent, &str) -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<String, ClientError> {
        let first = self.current.load(Ordering::Relaxed);
        let mut unreachable = None;
        for offset in 0..self.bases.len().max(1) {
            let index = (first + offset) % self.bases.len().max(1);
            let base = self.bases.get(index).map_or("", String::as_str);
            let url = format!("{base}{path}");
            match call(&self.agent, &url) {
                Ok(response) => {
                    self.current.store(index, Ordering::Relaxed);
                    return self.reply_text(&url, response);
                }
                Err(e) => {
                    unreachable = Some(ClientError::Unreachable {
                        url: base.to_string(),
                        reason: e.to_string(),
                    })
                }
            }
        }
        Err(unreachable.unwrap_or_else(|| ClientError::Unreachable {
            url: String::new(),
            reason: "no node URL given".into(),
        }))
    }

    /// The reply `text` of `url` as `T`.
    fn decode<T: DeserializeOwned>(url: &str, text: &str) -> Result<T, ClientError> {
        serde_json::from_str(text).map_err(|e| ClientError::BadReply {
            url: url.to_string(),
            reason: format!("{e}: {}", text.chars().take(200).collect::<String>()),
        })
    }

    /// The reply's body as text on a 2xx status, else the API's error.
    fn reply_text(
        &self,
        url: &str,
        mut response: ureq::http::Response<ureq::Body>,
    ) -> Result<String, ClientError> {
        let status = response.status().as_u16();
        let bad = |reason: String| ClientError::BadReply {
            url: url.to_string(),
            reason,
        };
        let text = response
            .body_mut()
            .with_config()
            .limit(MAX_REPLY)
            .read_to_string()
            .map_err(|e| bad(e.to_string()))?;
        let excerpt = || text.chars().take(200).collect::<String>();
        if (200..300).contains(&status) {
            return Ok(text);
        }
        let body: ErrorBody = serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "HTTP {status} without an error body ({e}): {}",
                excerpt()
            ))
        })?;
        Err(ClientError::Api {
            status,
            error: body.error,
            message: body.message,
        })
    }

    /// `GET path`, decoded as `T`.
    pub fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let text = self.send(path, |agent, url| agent.get(url).call())?;
        Client::decode(&format!("{}{path}", self.base()), &text)
    }

    /// `POST path` with a JSON body, the reply decoded as `T`.
    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let text = self.send(path, |agent, url| agent.post(url).send_json(body))?;
        Client::decode(&format!("{}{path}", self.base()), &text)
    }

    /// `GET /metrics`: Prometheus text.
    pub fn metrics(&self) -> Result<String, ClientError> {
        self.send("/metrics", |agent, url| agent.get(url).call())
    }

    pub fn head(&self) -> Result<Head, ClientError> {
        self.get("/head")
    }

    /// `GET /params`: the chain's genesis parameters.
    pub fn params(&self) -> Result<ParamsView, ClientError> {
        self.get("/params")
    }

    /// `GET /fees`: what a transaction pays in the next block.
    pub fn fees(&self) -> Result<FeesView, ClientError> {
        self.get("/fees")
    }

    /// `kind` as `key`'s next transaction on the chain `chain_id` (which the caller has
    /// checked is this node's), bidding the suggested fee (`FeesView::bid`) and `tip` per
    /// byte.
    pub fn sign_next(
        &self,
        chain_id: &str,
        kind: TxKind,
        key: &Keypair,
        tip: Amount,
    ) -> Result<SignedTx, ClientError> {
        let fee = self.fees()?.bid(Lane::of(&kind), tip);
        let nonce = self.account(&key.address())?.nonce;
        Ok(kind.signed_paying(chain_id, fee, key, nonce))
    }

    pub fn account(&self, address: &Address) -> Result<AccountView, ClientError> {
        self.get(&format!("/accounts/{address}"))
    }

    /// A page of the account's history, newest first; `before` is a `HEIGHT.INDEX` or
    /// `HEIGHT` from an earlier page's `next_before`.
    pub fn history(&self, address: &Address, before: Option<&str>) -> Result<History, ClientError> {
        match before {
            Some(before) => self.get(&format!("/accounts/{address}/history?before={before}")),
            None => self.get(&format!("/accounts/{address}/history")),
        }
    }

    pub fn block(&self, height: u64) -> Result<BlockView, ClientError> {
        self.get(&format!("/blocks/{height}"))
    }

    pub fn block_by_hash(&self, hash: &Hash) -> Result<BlockView, ClientError> {
        self.get(&format!("/blocks/by-hash/{hash}"))
    }

    pub fn tx_status(&self, hash: &Hash) -> Result<TxStatus, ClientError> {
        self.get(&format!("/txs/{hash}"))
    }

    /// The ledger's mark of a hub session's traffic for `order` (zero: outside any order).
    pub fn session(
        &self,
        hub: &Address,
        session_id: u64,
        order: u64,
    ) -> Result<SessionMark, ClientError> {
        self.get(&format!("/sessions/{hub}/{session_id}?order={order}"))
    }

    /// A page of offers that pass `query`'s filters.
    pub fn offers(&self, query: &MarketQuery) -> Result<OfferPage, ClientError> {
        self.get(&format!("/offers{}", query.to_query()))
    }

    pub fn offer(&self, id: u64) -> Result<OfferView, ClientError> {
        self.get(&format!("/offers/{id}"))
    }

    /// A page of orders that pass `query`'s filters.
    pub fn orders(&self, query: &MarketQuery) -> Result<OrderPage, ClientError> {
        self.get(&format!("/orders{}", query.to_query()))
    }

    pub fn order(&self, id: u64) -> Result<OrderView, ClientError> {
        self.get(&format!("/orders/{id}"))
    }

    /// A page of placements that pass `query`'s filters.
    pub fn placements(&self, query: &MarketQuery) -> Result<PlacementPage, ClientError> {
        self.get(&format!("/placements{}", query.to_query()))
    }

    pub fn placement(&self, id: u64) -> Result<PlacementView, ClientError> {
        self.get(&format!("/placements/{id}"))
    }

    /// How `model` is served, optionally in one layer.
    pub fn coverage(&self, model: &str, layer: Option<u16>) -> Result<CoverageView, ClientError> {
        let layer = layer.map_or_else(String::new, |l| format!("?layer={l}"));
        self.get(&format!("/coverage/{}{layer}", percent(model)))
    }

    /// A page of the hub's credited sessions with ids above `after`.
    pub fn sessions(
        &self,
        hub: &Address,
        after: u64,
        limit: usize,
    ) -> Result<HubSessions, ClientError> {
        self.get(&format!("/sessions/{hub}?after={after}&limit={limit}"))
    }

    /// Every placement of `order` (only the live ones with `live`), walking the pages; a
    /// page that does not move forward ends the walk, and more than `MAX_ORDER_PLACEMENTS`
    /// is refused as a bad reply (an operator holds one per order: no real order has as many).
    pub fn order_placements(
        &self,
        order: u64,
        live: bool,
    ) -> Result<Vec<PlacementView>, ClientError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let query = MarketQuery {
                order: Some(order),
                state: live.then(|| "live".to_string()),
                after,
                limit: Some(PAGE_MAX as u64),
                ..MarketQuery::default()
            };
            let page = self.placements(&query)?;
            all.extend(page.placements);
            if all.len() > MAX_ORDER_PLACEMENTS {
                return Err(ClientError::BadReply {
                    url: self.base().to_string(),
                    reason: format!("order {order} has over {MAX_ORDER_PLACEMENTS} placements"),
                });
            }
            match page.next_after {
                Some(next) if after.is_none_or(|a| next > a) => after = Some(next),
                _ => return Ok(all),
            }
        }
    }

    /// Every credited session of the hub, walking the pages.
    pub fn all_sessions(&self, hub: &Address) -> Result<Vec<CreditedSession>, ClientError> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let page = self.sessions(hub, after, PAGE_MAX)?;
            all.extend(page.sessions);
            match page.next_after {
                Some(next) if next > after => after = next,
                _ => return Ok(all),
            }
        }
    }

    /// Every receipt of the hub registry, walking the pages (this client pointed at
    /// `--registry-listen`).
    pub fn all_receipts(&self) -> Result<ReceiptListing, ClientError> {
        let mut listing = self.receipts(0, PAGE_MAX)?;
        while let Some(after) = listing.next_after.take() {
            let page = self.receipts(after, PAGE_MAX)?;
            // Every page must move forward, or a registry could keep this loop (and the list)
            // going for ever.
            let last = page.receipts.last().map(|r| r.session_id);
            let stalls = page
                .next_after
                .is_some_and(|next| next <= after || Some(next) < last);
            if stalls || page.receipts.first().is_some_and(|r| r.session_id <= after) {
                return Err(ClientError::BadReply {
                    url: format!("{}/receipts", self.base()),
                    reason: format!("the page after {after} goes back"),
                });
            }
            listing.receipts.extend(page.receipts);
            listing.next_after = page.next_after;
        }
        Ok(listing)
    }

    /// A page of the hub registry's signed receipts, ids above `after` (this client pointed
    /// at `--registry-listen`).
    pub fn receipts(&self, after: u64, limit: usize) -> Result<ReceiptListing, ClientError> {
        self.get(&format!("/receipts?after={after}&limit={limit}"))
    }

    /// A page of the signed receipts of the sessions whose count rose after `since` (a
    /// listing's `mark`), in the order they changed.
    pub fn receipts_since(&self, since: u64, limit: usize) -> Result<ReceiptListing, ClientError> {
        self.get(&format!("/receipts?since={since}&limit={limit}"))
    }

    /// Submits a signed transaction; its hash.
    pub fn submit(&self, tx: &SignedTx) -> Result<Hash, ClientError> {
        let submitted: Submitted = self.post("/txs", &Submission { tx: tx_hex(tx) })?;
        self.own_hash(tx, submitted.hash)
    }

    /// Submits many signed transactions in one request; per transaction, its hash or the
    /// ledger's reason for refusing it.
    pub fn submit_batch(
        &self,
        txs: &[SignedTx],
    ) -> Result<Vec<Result<Hash, ErrorBody>>, ClientError> {
        self.post_batch("/txs/batch", txs)
    }

    /// As `submit_batch`, for a node forwarding what its clients submitted: the receiving
    /// node admits them without forwarding them again.
    pub fn forward_batch(
        &self,
        txs: &[SignedTx],
    ) -> Result<Vec<Result<Hash, ErrorBody>>, ClientError> {
        self.post_batch("/txs/batch?forwarded=true", txs)
    }

    fn post_batch(
        &self,
        path: &str,
        txs: &[SignedTx],
    ) -> Result<Vec<Result<Hash, ErrorBody>>, ClientError> {
        let batch = Batch {
            txs: txs.iter().map(tx_hex).collect(),
        };
        let verdicts: BatchVerdicts = self.post(path, &batch)?;
        if verdicts.results.len() != txs.len() {
            return Err(ClientError::BadReply {
                url: format!("{}{path}", self.base()),
                reason: format!(
                    "{} verdicts for {} transactions",
                    verdicts.results.len(),
                    txs.len()
                ),
            });
        }
        verdicts
            .results
            .into_iter()
            .zip(txs)
            .map(|(verdict, tx)| match verdict {
                Verdict::Admitted(submitted) => self.own_hash(tx, submitted.hash).map(Ok),
                Verdict::Refused(error) => Ok(Err(error)),
            })
            .collect()
    }

    /// `hash` if it is `tx`'s own: a node must not make a client wait on another transaction.
    fn own_hash(&self, tx: &SignedTx, hash: Hash) -> Result<Hash, ClientError> {
        if hash != tx.hash() {
            return Err(ClientError::BadReply {
                url: self.base().to_string(),
                reason: format!("admitted {} as {hash}", tx.hash()),
            });
        }
        Ok(hash)
    }

    /// Waits until transaction `hash` is committed; its height.
    pub fn wait_committed(&self, hash: &Hash, timeout: Duration) -> Result<u64, ClientError> {
        let start = Instant::now();
        loop {
            match self.tx_status(hash) {
                Ok(TxStatus {
                    state: TxState::Committed { height, .. },
                    ..
                }) => return Ok(height),
                Ok(TxStatus {
                    state: TxState::Rejected { reason },
                    ..
                }) => {
                    return Err(ClientError::Rejected {
                        hash: *hash,
                        reason,
                    })
                }
                Ok(_) | Err(ClientError::Api { status: 404, .. }) => {}
                Err(e) => return Err(e),
            }
            if start.elapsed() > timeout {
                return Err(ClientError::Timeout(*hash));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
