//! A blocking client of the ledger REST API (`kvasir-node ledger`, or the gateway in front
//! of it). Errors name what went wrong in one line: the node unreachable, or the API's own
//! `{error, message}`.

use std::path::Path;
use std::time::{Duration, Instant};

use kvasir_ledger::SignedTx;
use serde_json::Value;

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
    Rejected { hash: String, reason: String },
    #[error("transaction {0} was not committed in time")]
    Timeout(String),
    #[error("certificate file {path}: {reason}")]
    Ca { path: String, reason: String },
}

/// A signed transaction as the API takes it: borsh bytes in hex (writing to a Vec cannot fail).
fn hex_of(tx: &SignedTx) -> String {
    hex::encode(borsh::to_vec(tx).unwrap_or_default())
}

pub struct Client {
    base: String,
    agent: ureq::Agent,
}

impl Client {
    /// A client of the API at `base`, e.g. `http://127.0.0.1:7200`; an `https://` base is
    /// verified against the public web roots.
    pub fn new(base: &str) -> Client {
        Client::with_agent(base, ureq::Agent::config_builder())
    }

    /// A client that also trusts the PEM certificate(s) in `ca` over HTTPS.
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
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Client {
            base: base.trim_end_matches('/').to_string(),
            agent,
        }
    }

    fn reply(
        &self,
        url: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, ClientError> {
        let mut response = response.map_err(|e| ClientError::Unreachable {
            url: self.base.clone(),
            reason: e.to_string(),
        })?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| ClientError::BadReply {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ClientError::BadReply {
            url: url.to_string(),
            reason: format!("{e}: {}", text.chars().take(200).collect::<String>()),
        })?;
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let field = |name: &str| value[name].as_str().unwrap_or("").to_string();
        Err(ClientError::Api {
            status,
            error: field("error"),
            message: field("message"),
        })
    }

    /// `GET path`, as JSON.
    pub fn get(&self, path: &str) -> Result<Value, ClientError> {
        let url = format!("{}{path}", self.base);
        let response = self.agent.get(&url).call();
        self.reply(&url, response)
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        let url = format!("{}{path}", self.base);
        let response = self.agent.post(&url).send_json(body);
        self.reply(&url, response)
    }

    /// Submits a signed transaction; its hash.
    pub fn submit(&self, tx: &SignedTx) -> Result<String, ClientError> {
        let reply = self.post("/txs", &serde_json::json!({"tx": hex_of(tx)}))?;
        Ok(reply["hash"].as_str().unwrap_or_default().to_string())
    }

    /// Submits many signed transactions in one request; per transaction, its hash or the
    /// ledger's reason for refusing it.
    pub fn submit_batch(
        &self,
        txs: &[SignedTx],
    ) -> Result<Vec<Result<String, String>>, ClientError> {
        let hexes: Vec<String> = txs.iter().map(hex_of).collect();
        let reply = self.post("/txs/batch", &serde_json::json!({"txs": hexes}))?;
        let results = reply["results"].as_array().cloned().unwrap_or_default();
        if results.len() != txs.len() {
            return Err(ClientError::BadReply {
                url: format!("{}/txs/batch", self.base),
                reason: format!("{} verdicts for {} transactions", results.len(), txs.len()),
            });
        }
        Ok(results
            .into_iter()
            .map(|r| match r["hash"].as_str() {
                Some(hash) => Ok(hash.to_string()),
                None => Err(r["message"].as_str().unwrap_or("refused").to_string()),
            })
            .collect())
    }

    /// Waits until transaction `hash` is committed; its height.
    pub fn wait_committed(&self, hash: &str, timeout: Duration) -> Result<u64, ClientError> {
        let start = Instant::now();
        loop {
            match self.get(&format!("/txs/{hash}")) {
                Ok(status) if status["status"] == "committed" => {
                    return Ok(status["height"].as_u64().unwrap_or_default())
                }
                Ok(status) if status["status"] == "rejected" => {
                    return Err(ClientError::Rejected {
                        hash: hash.to_string(),
                        reason: status["reason"].as_str().unwrap_or("").to_string(),
                    })
                }
                Ok(_) | Err(ClientError::Api { status: 404, .. }) => {}
                Err(e) => return Err(e),
            }
            if start.elapsed() > timeout {
                return Err(ClientError::Timeout(hash.to_string()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `kvr1...: settled 1 KVR, pending 0.008945664 KVR (0.008945664 KVR settling at height 12)`.
pub fn balance_text(account: &serde_json::Value) -> String {
    let kvr = |v: &serde_json::Value| format!("{} KVR", v["kvr"].as_str().unwrap_or("?"));
    let pending: Vec<String> = account["pending"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|p| {
                    format!(
                        "{} settling at height {}",
                        kvr(&p["amount"]),
                        p["settle_height"]
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let detail = if pending.is_empty() {
        String::new()
    } else {
        format!(" ({})", pending.join(", "))
    };
    format!(
        "{}: settled {}, pending {}{detail}",
        account["address"].as_str().unwrap_or("?"),
        kvr(&account["balance"]),
        kvr(&account["pending_total"]),
    )
}
