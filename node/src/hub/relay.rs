//! Relaying dispatch frames between the backbone and worker sessions, and which relayed
//! requests are still unanswered: an answer is metered (see `metering`) only if it answers
//! one of them.

use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;

use anyhow::{bail, Result};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Bytes;

use super::metering::{self, Answer, Asked};
use super::Hub;
use crate::wire::{Directory, DirectoryEntry, Failure, Message, Relayed};

#[derive(Default)]
pub(super) struct Links {
    pub workers: BTreeMap<u64, WorkerLink>,
    pub backbone: Option<(u64, mpsc::UnboundedSender<Bytes>)>,
    pub backbone_connections: u64,
    /// Requests relayed and not yet answered: (session, request id) -> what answers them.
    outstanding: HashMap<(u64, u64), Asked>,
}

pub(super) struct WorkerLink {
    pub entry: DirectoryEntry,
    pub tx: mpsc::UnboundedSender<Bytes>,
}

impl Links {
    fn to_backbone(&self, frame: Bytes) {
        if let Some((_, tx)) = &self.backbone {
            let _ = tx.send(frame);
        }
    }

    pub fn send_directory(&self) {
        let sessions = self.workers.values().map(|w| w.entry.clone()).collect();
        self.to_backbone(Message::Directory(Directory { sessions }).encode().into());
    }
}

impl Hub {
    pub(super) fn links(&self) -> MutexGuard<'_, Links> {
        // A panic while holding the lock is a bug elsewhere; the maps stay usable.
        self.links.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A frame from worker `session`: a response or failure answering a relayed request,
    /// metered as `metering` decides. An answer refused (or not metered) for a request the
    /// backbone is waiting for becomes a failure at once, so the backbone computes it locally
    /// without waiting out its deadline; then the worker is dropped.
    pub(super) fn relay_answer(&self, session: u64, frame: Bytes) -> Result<()> {
        let (id, answer) = match Message::inspect(&frame)? {
            Relayed::Response { id, values } => (
                id,
                Answer::Response {
                    values,
                    bytes: frame.len() as u64,
                },
            ),
            Relayed::Failure { id } => (id, Answer::Failure),
            _ => bail!("a worker may only send responses and failures"),
        };
        let asked = self.links().outstanding.remove(&(session, id));
        let verdict = metering::metered(id, asked, answer)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| match bytes {
                0 => Ok(()),
                bytes => self.registry.meter(session, bytes).map(drop),
            });
        if let Err(e) = verdict {
            if asked.is_some() {
                let failure = Failure::new(id, format!("session {session}: {e:#}"));
                self.links()
                    .to_backbone(Message::Failure(failure).encode().into());
            }
            return Err(e);
        }
        self.links().to_backbone(frame);
        Ok(())
    }

    /// A frame from the backbone: a request for one worker session.
    pub(super) fn relay_request(&self, frame: Bytes) -> Result<()> {
        let Relayed::Request {
            session,
            id,
            response_values,
        } = Message::inspect(&frame)?
        else {
            bail!("a backbone may only send requests");
        };
        let mut links = self.links();
        let Some(worker) = links.workers.get(&session) else {
            let message = format!("session {session} is not connected");
            links.to_backbone(Message::Failure(Failure { id, message }).encode().into());
            return Ok(());
        };
        let _ = worker.tx.send(frame.clone());
        links.outstanding.insert(
            (session, id),
            Asked {
                request_bytes: frame.len() as u64,
                response_values,
            },
        );
        Ok(())
    }

    pub(super) fn remove_worker(&self, session: u64) {
        let mut links = self.links();
        links.workers.remove(&session);
        let lost: Vec<u64> = links
            .outstanding
            .keys()
            .filter(|(s, _)| *s == session)
            .map(|(_, id)| *id)
            .collect();
        for id in lost {
            links.outstanding.remove(&(session, id));
            let message = format!("session {session} left");
            links.to_backbone(Message::Failure(Failure { id, message }).encode().into());
        }
        links.send_directory();
    }
}
