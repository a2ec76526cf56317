//! The backbone's link to the hub: dialled and authenticated as the backbone, redialled
//! with backoff when it drops. It keeps the hub's directory of worker sessions and the hub's
//! challenge (whose chain id and key every answer on this link is signed for), and routes each
//! answer, as the frame that came, to the layer step waiting for it (which checks its
//! signature); a dropped link tells every waiting step to compute locally.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Result};
use kvasir_ledger::keys::Keypair;
use tokio::sync::mpsc;
use tokio_rustls::rustls::ClientConfig;
use tokio_tungstenite::tungstenite::Bytes;

use super::lock;
use crate::link::{self, next_frame, Connected, Identity};
use crate::tls;
use crate::wire::{Challenge, DirectoryEntry, Message, Relayed, Role};

/// What comes back for a request: the response frame as received, or the failure's message.
pub(super) type Answer = Result<Bytes, String>;

/// The backbone's end of its hub link, shared by the link task and the executor.
pub(super) struct LinkState {
    pub tx: Option<mpsc::UnboundedSender<Bytes>>,
    /// The challenge of the link now up (`None` while it is down).
    pub challenge: Option<Arc<Challenge>>,
    pub directory: Vec<DirectoryEntry>,
    pub pending: HashMap<u64, std_mpsc::Sender<Answer>>,
    pub next_id: u64,
}

impl LinkState {
    /// Request ids start at a random point: a worker may still answer a request of a
    /// backbone process that has since been restarted, and that late answer must not match
    /// a new request that happens to reuse its id.
    pub fn new() -> LinkState {
        LinkState {
            tx: None,
            challenge: None,
            directory: Vec::new(),
            pending: HashMap::new(),
            next_id: rand::random::<u64>() >> 1,
        }
    }
}

/// Keeps the hub link up: dial, authenticate, read answers and directories, redial.
pub(super) async fn maintain_link(
    url: String,
    key: Keypair,
    model_id: String,
    order: u64,
    state: Arc<Mutex<LinkState>>,
) {
    let mut backoff = Duration::from_millis(100);
    let tls = match tls::client(None) {
        Ok(tls) => tls,
        Err(e) => return tracing::error!("TLS setup: {e:#}"),
    };
    loop {
        match hub_session(&url, &tls, &key, &model_id, order, &state).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => tracing::warn!("hub link: {e:#}"),
        }
        {
            let mut link = lock(&state);
            link.tx = None;
            link.challenge = None;
            link.directory.clear();
            // Dropping the senders tells every waiting step to compute locally.
            link.pending.clear();
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn hub_session(
    url: &str,
    tls: &Arc<ClientConfig>,
    key: &Keypair,
    model_id: &str,
    order: u64,
    state: &Arc<Mutex<LinkState>>,
) -> Result<()> {
    let identity = Identity {
        key,
        role: Role::Backbone,
        model_id: model_id.into(),
        backend: "cpu".into(),
        experts: vec![],
        order,
    };
    let Connected {
        tx,
        mut source,
        challenge,
        ..
    } = link::connect(url, tls, identity).await?;
    {
        let mut link = lock(state);
        link.tx = Some(tx);
        link.challenge = Some(Arc::new(challenge));
    }
    tracing::info!("attached to the hub at {url}");
    let route = |id: u64, answer: Answer| {
        if let Some(waiting) = lock(state).pending.remove(&id) {
            let _ = waiting.send(answer);
        }
    };
    loop {
        let frame = next_frame(&mut source).await?;
        // A response is checked here but not copied: the step waiting for it decodes it and
        // keeps the frame (its signed body) for an audit.
        if let Relayed::Response { id, .. } = Message::inspect(&frame)? {
            route(id, Ok(frame));
            continue;
        }
        match Message::decode(&frame)? {
            Message::Directory(directory) => lock(state).directory = directory.sessions,
            // Id 0 answers no request: it is the hub telling this link why it ends.
            Message::Failure(failure) if failure.id == 0 => {
                tracing::warn!("the hub: {}", failure.message)
            }
            Message::Failure(failure) => route(failure.id, Err(failure.message)),
            _ => bail!("unexpected message from the hub"),
        }
    }
}
