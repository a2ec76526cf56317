//! Forwarding: a transaction admitted here from a client is sent on to the other nodes of
//! the chain (`ledger --forward URL`), in batches, so that it waits in the mempool of
//! whichever validator proposes next, whichever node the client submitted it to. One hop:
//! a forwarded batch is marked so, and the node receiving it admits it without forwarding
//! it again. A transaction thus travels once to each node its first node names (every
//! validator), not once from every node to every other.
//!
//! One thread and one bounded queue per peer: a peer that is down or slow loses what does
//! not fit in its queue (its own clients' transactions, and the next proposers, still have
//! them) and never holds up the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_api::Client;
use kvasir_ledger::SignedTx;

/// Transactions waiting to be forwarded to one peer; beyond, they are dropped.
const QUEUE: usize = 65_536;
/// Most transactions, and bytes, in one forwarded batch (the batch route's limits, less
/// room for hex and JSON).
const BATCH_TXS: usize = 5_000;
const BATCH_BYTES: usize = 6 << 20;
/// How long a batch waits for more transactions after its first.
const GATHER: Duration = Duration::from_millis(20);

pub struct Forwarder {
    peers: Vec<SyncSender<SignedTx>>,
    /// Transactions dropped because a peer's queue was full.
    pub dropped: Arc<AtomicU64>,
}

impl Forwarder {
    /// Starts one forwarding thread per node URL in `peers`.
    pub fn start(peers: &[String]) -> Forwarder {
        let senders = peers
            .iter()
            .map(|url| {
                let (sender, queue) = sync_channel(QUEUE);
                let client = Client::new(url);
                let url = url.clone();
                std::thread::spawn(move || forward(&url, &client, queue));
                sender
            })
            .collect();
        Forwarder {
            peers: senders,
            dropped: Arc::default(),
        }
    }

    pub fn send(&self, tx: &SignedTx) {
        for peer in &self.peers {
            if let Err(TrySendError::Full(_)) = peer.try_send(tx.clone()) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Sends what `queue` brings to the node at `url`, a batch at a time, until the node's
/// forwarder is dropped.
fn forward(url: &str, client: &Client, queue: Receiver<SignedTx>) {
    while let Ok(first) = queue.recv() {
        let mut bytes = first.to_bytes().len();
        let mut batch = vec![first];
        let deadline = Instant::now() + GATHER;
        while batch.len() < BATCH_TXS && bytes < BATCH_BYTES {
            match queue.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(tx) => {
                    bytes += tx.to_bytes().len();
                    batch.push(tx);
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        if let Err(e) = client.forward_batch(&batch) {
            tracing::debug!("forwarding {} transactions to {url}: {e}", batch.len());
        }
    }
}
