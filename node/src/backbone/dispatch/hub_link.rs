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
use kvasir_ledger::keys::{Address, Keypair};
use tokio::sync::mpsc;
use tokio_rustls::rustls::ClientConfig;
use tokio_tungstenite::tungstenite::Bytes;

use crate::backbone::lock;
use kvasir_wire::link::{self, next_frame, Connected, Identity};
use kvasir_wire::tls;
use kvasir_wire::{Challenge, DirectoryEntry, Message, Relayed, Request, Role};

/// What comes back for a request: the response frame as received, or the failure's message.
pub(super) type Answer = Result<Bytes, String>;

/// The backbone's end of its hub link: a handle shared by the link task, which brings it up
/// and down, keeps its directory and routes answers, and the executor, which reads the
/// directory and sends requests. Its state is reached only through these methods.
#[derive(Clone)]
pub(super) struct HubLink(Arc<Mutex<LinkState>>);

struct LinkState {
    tx: Option<mpsc::UnboundedSender<Bytes>>,
    /// The challenge of the link now up (`None` while it is down).
    challenge: Option<Arc<Challenge>>,
    directory: Vec<DirectoryEntry>,
    /// Where each request's answer goes, by request id.
    pending: HashMap<u64, std_mpsc::Sender<Answer>>,
    next_id: u64,
}

/// A request sent, and what its answer must be signed for.
pub(super) struct InFlight {
    pub answer: std_mpsc::Receiver<Answer>,
    /// The worker the directory names for the session.
    pub worker: Address,
    /// The request frame as sent (shared with the link's writer, not copied): the worker
    /// signs the hash of its body.
    pub request: Bytes,
    /// The challenge of the link it went out on: the chain and hub the answer is signed for.
    pub challenge: Arc<Challenge>,
}

impl HubLink {
    /// A link that is down. Request ids start at a random point: a worker may still answer a
    /// request of a backbone process that has since been restarted, and that late answer
    /// must not match a new request that happens to reuse its id.
    pub fn new() -> HubLink {
        HubLink(Arc::new(Mutex::new(LinkState {
            tx: None,
            challenge: None,
            directory: Vec::new(),
            pending: HashMap::new(),
            next_id: rand::random::<u64>() >> 1,
        })))
    }

    /// Whether requests can go out now.
    pub fn is_up(&self) -> bool {
        let link = lock(&self.0);
        link.tx.is_some() && link.challenge.is_some()
    }

    /// `read` of the hub's directory of worker sessions as it is now.
    pub fn read_directory<T>(&self, read: impl FnOnce(&[DirectoryEntry]) -> T) -> T {
        read(&lock(&self.0).directory)
    }

    /// The sessions in the directory, with their workers.
    pub fn sessions(&self) -> Vec<(u64, Address)> {
        self.read_directory(|d| d.iter().map(|e| (e.session, e.worker)).collect())
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        let mut link = lock(&self.0);
        link.next_id = link.next_id.wrapping_add(1);
        link.next_id
    }

    /// Sends `request` (number `id`, to `worker`'s session), registering where its answer
    /// goes; what it is then waiting for, or `None` if the link is down (nothing will answer).
    pub fn send(&self, worker: Address, id: u64, request: Request) -> Option<InFlight> {
        let frame = Bytes::from(Message::Request(request).encode());
        let mut link = lock(&self.0);
        let (Some(tx), Some(challenge)) = (&link.tx, &link.challenge) else {
            return None;
        };
        if tx.send(frame.clone()).is_err() {
            return None;
        }
        let challenge = challenge.clone();
        let (answer_tx, answer) = std_mpsc::channel();
        link.pending.insert(id, answer_tx);
        Some(InFlight {
            answer,
            worker,
            request: frame,
            challenge,
        })
    }

    /// Stops waiting for request `id`'s answer (taken, or given up on).
    pub fn forget(&self, id: u64) {
        lock(&self.0).pending.remove(&id);
    }

    /// The link is up, writing to `tx`, authenticated by `challenge`.
    pub fn up(&self, tx: mpsc::UnboundedSender<Bytes>, challenge: Challenge) {
        let mut link = lock(&self.0);
        link.tx = Some(tx);
        link.challenge = Some(Arc::new(challenge));
    }

    /// The link is down: no directory, and every waiting step is told to compute locally
    /// (its sender dropped).
    pub fn down(&self) {
        let mut link = lock(&self.0);
        link.tx = None;
        link.challenge = None;
        link.directory.clear();
        link.pending.clear();
    }

    /// The hub's directory, as it last sent it.
    pub fn set_directory(&self, directory: Vec<DirectoryEntry>) {
        lock(&self.0).directory = directory;
    }

    /// Hands request `id`'s answer to the step waiting for it, if one still is.
    pub fn route(&self, id: u64, answer: Answer) {
        if let Some(waiting) = lock(&self.0).pending.remove(&id) {
            let _ = waiting.send(answer);
        }
    }
}

/// Keeps the hub link up: dial, authenticate, read answers and directories, redial.
pub(super) async fn maintain_link(
    url: String,
    key: Keypair,
    model_id: String,
    order: u64,
    link: HubLink,
) {
    let mut backoff = Duration::from_millis(100);
    let tls = match tls::client(None) {
        Ok(tls) => tls,
        Err(e) => return tracing::error!("TLS setup: {e:#}"),
    };
    loop {
        match hub_session(&url, &tls, &key, &model_id, order, &link).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => tracing::warn!("hub link: {e:#}"),
        }
        link.down();
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
    link: &HubLink,
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
        notice,
        ..
    } = link::connect(url, tls, identity).await?;
    link.up(tx, challenge);
    tracing::info!("attached to the hub at {url}");
    if !notice.is_empty() {
        // Debug-quoted: the text is the hub's, and must not write lines of its own.
        tracing::warn!("the hub says: {notice:?}");
    }
    loop {
        let frame = next_frame(&mut source).await?;
        // A response is checked here but not copied: the step waiting for it decodes it and
        // keeps the frame (its signed body) for an audit.
        if let Relayed::Response { id, .. } = Message::inspect(&frame)? {
            link.route(id, Ok(frame));
            continue;
        }
        match Message::decode(&frame)? {
            Message::Directory(directory) => link.set_directory(directory.sessions),
            // Id 0 answers no request: it is the hub telling this link why it ends.
            Message::Failure(failure) if failure.id == 0 => {
                tracing::warn!("the hub: {}", failure.message)
            }
            Message::Failure(failure) => link.route(failure.id, Err(failure.message)),
            _ => bail!("unexpected message from the hub"),
        }
    }
}
