//! Relaying dispatch frames between the backbone and worker sessions, and which relayed
//! requests are still unanswered: an answer is metered (see `metering`) only if it answers
//! one of them in time. Everything a peer can grow here is bounded: unanswered requests per
//! session (past the cap the backbone gets a failure at once), how long one may wait (past its
//! deadline the backbone gets a failure, and a minute later the request is forgotten; an
//! answer in that minute is late, earns nothing and costs the worker nothing), the experts a
//! session and the whole hub may claim, and how often the directory is re-sent (changes are
//! coalesced).
//!
//! A session leaves the same way however it ends (`Links::remove_worker`): out of the
//! directory, its unanswered requests failed to the backbone. Its connection ends the loop
//! itself, or is told to by `Hub::expel` (its key may no longer serve, see `standing`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_ledger::Address;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Bytes;

use super::metering::{self, Answer, Asked, Metered};
use super::Hub;
use crate::bonds;
use crate::metrics::Exposition;
use kvasir_wire::{
    request_hash, response_body, AnswerScope, Directory, DirectoryEntry, ExpertId, Failure,
    Message, Relayed, RowFormat, PREVIOUS_VERSION,
};

#[cfg(fuzzing)]
pub mod fuzzing;

/// Requests one session may have unanswered at once: one per layer step per micro-batch in
/// flight is the most an honest backbone sends, far below this.
pub(super) const MAX_UNANSWERED: usize = 64;
/// Experts one session may claim (Qwen3.5-122B-A10B has 49 x 256 = 12,544).
pub(super) const MAX_CLAIMS_PER_SESSION: usize = 16_384;
/// Claims over every session together: keeps the directory a few MiB, well inside a frame.
pub(super) const MAX_CLAIMS: usize = 1 << 20;
/// Claims over every session of one key: five copies of the largest model above, and a
/// sixteenth of the hub, so that one bonded key cannot fill the directory and keep every
/// other worker out.
pub(super) const MAX_CLAIMS_PER_KEY: usize = MAX_CLAIMS / 16;
/// The directory is sent at most this often; joins and leaves in between are coalesced.
pub(super) const DIRECTORY_INTERVAL: Duration = Duration::from_millis(100);
/// How long past its deadline a request is remembered, so that a slow worker's late answer is
/// recognised as late (and not as an answer to nothing, which drops the worker).
const LATE_GRACE: Duration = Duration::from_secs(60);

/// A relayed request, and whether the backbone was already told it failed.
struct Waiting {
    asked: Asked,
    failed: bool,
    /// The backbone connection that asked.
    connection: u64,
}

#[derive(Default)]
pub(super) struct Links {
    workers: BTreeMap<u64, WorkerLink>,
    /// The attached backbone's connection number and where its frames go.
    backbone: Option<(u64, mpsc::UnboundedSender<Bytes>)>,
    backbone_connections: u64,
    /// The market order the attached backbone acts for (zero: none); each request carries it
    /// to the answer's metering. A session is metered under one order only (`Registry::meter`).
    order: u64,
    /// Ends the attached backbone's connection, with the reason (its order closed).
    backbone_stop: Option<tokio::sync::oneshot::Sender<String>>,
    /// Requests relayed and not yet answered: (session, request id) -> what answers them.
    outstanding: HashMap<(u64, u64), Waiting>,
    /// Claims of every connected session together.
    claims: usize,
    /// The directory changed since it was last sent.
    directory_changed: bool,
    counts: Counts,
}

/// What the relay has done since the hub started, for `/metrics`.
#[derive(Default)]
struct Counts {
    requests: u64,
    /// Bytes of every frame relayed, either way.
    relayed_bytes: u64,
    metered_bytes: u64,
    refused_answers: u64,
    late_answers: u64,
    failed_requests: u64,
    /// Sessions dropped while connected because their key may no longer serve.
    expelled: u64,
}

pub(super) struct WorkerLink {
    entry: DirectoryEntry,
    tx: mpsc::UnboundedSender<Bytes>,
    /// Its entries in `outstanding`.
    unanswered: usize,
    /// Tells the session's connection, by `Hub::expel`, that the hub dropped it and why.
    /// Dropped unsent when the connection itself ended the session.
    expelled: oneshot::Sender<bonds::Refused>,
    /// A worker of the previous protocol version (admitted in its window), which reads
    /// `f32` rows only.
    previous_version: bool,
}

/// Why a worker is not admitted.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error("a session may claim at most {MAX_CLAIMS_PER_SESSION} experts, this hello claims {0}")]
    TooManyClaims(usize),
    #[error("the hub holds its maximum of {MAX_CLAIMS} claimed experts; try another hub or later")]
    HubFull,
    #[error("this key's sessions would claim {0} experts, over the {MAX_CLAIMS_PER_KEY} one key may claim")]
    KeyFull(usize),
}

/// `claims` without repeats, in order, if within the per-session cap.
pub(super) fn distinct_claims(claims: Vec<ExpertId>) -> Result<Vec<ExpertId>, Refused> {
    let distinct: BTreeSet<ExpertId> = claims.into_iter().collect();
    if distinct.len() > MAX_CLAIMS_PER_SESSION {
        return Err(Refused::TooManyClaims(distinct.len()));
    }
    Ok(distinct.into_iter().collect())
}

impl Links {
    fn to_backbone(&self, frame: Bytes) {
        if let Some((_, tx)) = &self.backbone {
            let _ = tx.send(frame);
        }
    }

    fn fail(&mut self, id: u64, message: String) {
        self.counts.failed_requests += 1;
        let failure = Failure::new(id, message);
        self.to_backbone(Message::Failure(failure).encode().into());
    }

    /// Marks session `session` as a worker of the previous protocol version (under the same
    /// lock as `add_worker`, before any request can reach it).
    pub fn of_previous_version(&mut self, session: u64) {
        if let Some(worker) = self.workers.get_mut(&session) {
            worker.previous_version = true;
        }
    }

    /// Admits worker `entry` (its claims already distinct) if the hub has room for its claims.
    /// What the returned receiver gets is why the hub expelled the session (`Hub::expel`); its
    /// connection must then end.
    pub fn add_worker(
        &mut self,
        entry: DirectoryEntry,
        tx: mpsc::UnboundedSender<Bytes>,
    ) -> Result<oneshot::Receiver<bonds::Refused>, Refused> {
        let claims = self.claims.saturating_add(entry.experts.len());
        if claims > MAX_CLAIMS {
            return Err(Refused::HubFull);
        }
        let of_key: usize = (self.workers.values())
            .filter(|w| w.entry.worker == entry.worker)
            .map(|w| w.entry.experts.len())
            .sum();
        let of_key = of_key.saturating_add(entry.experts.len());
        if of_key > MAX_CLAIMS_PER_KEY {
            return Err(Refused::KeyFull(of_key));
        }
        self.claims = claims;
        let session = entry.session;
        let (expelled, why) = oneshot::channel();
        let link = WorkerLink {
            entry,
            tx,
            unanswered: 0,
            expelled,
            previous_version: false,
        };
        self.workers.insert(session, link);
        self.directory_changed = true;
        Ok(why)
    }

    /// Each connected session and the key it serves with.
    pub fn sessions(&self) -> Vec<(u64, Address)> {
        let key = |(session, link): (&u64, &WorkerLink)| (*session, link.entry.worker);
        self.workers.iter().map(key).collect()
    }

    /// Takes `session` out of the directory and fails its unanswered requests to the backbone
    /// (it computes them locally); its link, if it was connected.
    fn remove_worker(&mut self, session: u64) -> Option<WorkerLink> {
        let worker = self.workers.remove(&session);
        if let Some(worker) = &worker {
            self.claims = self.claims.saturating_sub(worker.entry.experts.len());
            self.directory_changed = true;
        }
        let lost: Vec<u64> = self
            .outstanding
            .keys()
            .filter(|(s, _)| *s == session)
            .map(|(_, id)| *id)
            .collect();
        for id in lost {
            self.outstanding.remove(&(session, id));
            self.fail(id, format!("session {session} left"));
        }
        worker
    }

    /// Attaches a backbone connection acting for market `order` (zero: none), replacing any
    /// other, whose frames go to `tx` and which `stop` ends; sends it the directory. Returns
    /// the connection's number, which tags the requests it sends.
    pub fn attach_backbone(
        &mut self,
        tx: mpsc::UnboundedSender<Bytes>,
        order: u64,
        stop: tokio::sync::oneshot::Sender<String>,
    ) -> u64 {
        self.backbone_connections += 1;
        let connection = self.backbone_connections;
        self.backbone = Some((connection, tx));
        self.order = order;
        self.backbone_stop = Some(stop);
        self.send_directory();
        connection
    }

    /// Backbone connection `connection` has ended (see `orphan`), and it is detached unless
    /// a newer connection replaced it.
    pub fn detach_backbone(&mut self, connection: u64, now: Instant) {
        self.orphan(connection, now);
        if self
            .backbone
            .as_ref()
            .is_some_and(|(c, _)| *c == connection)
        {
            self.backbone = None;
            self.backbone_stop = None;
            self.order = 0;
        }
    }

    /// The order of the attached backbone while it can still be stopped (zero: none).
    pub fn backbone_order(&self) -> u64 {
        match self.backbone_stop {
            Some(_) => self.order,
            None => 0,
        }
    }

    /// Tells the backbone acting for `order`, if it still is attached, why it is dropped, and
    /// ends its connection; whether one was.
    pub fn stop_backbone(&mut self, order: u64, why: &str) -> bool {
        if self.order != order {
            return false;
        }
        // Requests already relayed keep their order (`Asked::order`): their answers are
        // metered for it, and the ledger's grace after a close pays them.
        if let Some((_, tx)) = &self.backbone {
            let failure = Failure::new(0, why.to_string());
            let _ = tx.send(Message::Failure(failure).encode().into());
        }
        let Some(stop) = self.backbone_stop.take() else {
            return false;
        };
        let _ = stop.send(why.to_string());
        true
    }

    /// Backbone connection `connection` has ended: what it asked is past its deadline at
    /// `now`. Nobody waits for those answers any more, and nobody would audit them: an
    /// answer that comes is late (not paid, not relayed; the worker is not blamed), and no
    /// failure goes to a backbone that did not ask.
    fn orphan(&mut self, connection: u64, now: Instant) {
        for waiting in self.outstanding.values_mut() {
            if waiting.connection == connection {
                waiting.asked.deadline = waiting.asked.deadline.min(now);
                waiting.failed = true;
            }
        }
    }

    /// The whole directory, now (a backbone that just attached must not wait for it).
    pub fn send_directory(&mut self) {
        let sessions = self.workers.values().map(|w| w.entry.clone()).collect();
        self.to_backbone(Message::Directory(Directory { sessions }).encode().into());
        self.directory_changed = false;
    }

    /// Forgets `(session, id)`; what was asked, if it was.
    fn take(&mut self, session: u64, id: u64) -> Option<Asked> {
        let waiting = self.outstanding.remove(&(session, id))?;
        if let Some(worker) = self.workers.get_mut(&session) {
            worker.unanswered = worker.unanswered.saturating_sub(1);
        }
        Some(waiting.asked)
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
    /// without waiting out its deadline; then the worker is dropped. That includes a response
    /// whose answer signature does not verify for this hub, session, request and the model of
    /// the worker's hello: it is neither paid nor relayed, exactly as a wrong-sized one. A
    /// late answer is dropped quietly: the worker is slow, not lying.
    pub(super) fn relay_answer(&self, session: u64, frame: Bytes) -> Result<()> {
        let (id, answer, signature) = match Message::inspect(&frame)? {
            Relayed::Response {
                id,
                values,
                signature,
            } => {
                let bytes = frame.len() as u64;
                (id, Answer::Response { values, bytes }, Some(signature))
            }
            Relayed::Failure { id } => (id, Answer::Failure, None),
            _ => bail!("a worker may only send responses and failures"),
        };
        let (asked, worker) = {
            let mut links = self.links();
            // Who signs this session's answers, and for which model (its hello's).
            let worker = links
                .workers
                .get(&session)
                .map(|w| (w.entry.worker, w.entry.model_id.clone()));
            (links.take(session, id), worker)
        };
        let order = asked.as_ref().map_or(0, |a| a.order);
        // Outside the lock: one blake3 of the response body and one signature check.
        let signed = |asked: &Asked| {
            let (Some((key, model_id)), Some(signature)) = (&worker, &signature) else {
                return false;
            };
            let scope = AnswerScope {
                chain_id: &self.chain_id,
                hub: self.key.address(),
                session,
                model_id,
            };
            let body = response_body(&frame);
            scope
                .verify(key, id, asked.request_hash, body, signature)
                .is_ok()
        };
        let verdict = metering::metered(id, asked, answer, Instant::now(), signed)
            .map_err(anyhow::Error::from)
            .and_then(|metered| match (metered, &worker) {
                (Metered::Bytes(0) | Metered::Late, _) => Ok(metered),
                (Metered::Bytes(bytes), Some((worker, _))) => self
                    .registry
                    .meter(session, *worker, order, bytes)
                    .map(|_| metered),
                (Metered::Bytes(_), None) => bail!("session {session} has left"),
            });
        let mut links = self.links();
        match verdict {
            Ok(Metered::Bytes(bytes)) => {
                links.counts.metered_bytes += bytes;
                links.counts.relayed_bytes += frame.len() as u64;
                links.to_backbone(frame);
            }
            Ok(Metered::Late) => {
                links.counts.late_answers += 1;
                tracing::debug!(session, id, "answer after its deadline: not metered")
            }
            Err(e) => {
                links.counts.refused_answers += 1;
                if asked.is_some() {
                    links.fail(id, format!("session {session}: {e:#}"));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A frame from backbone connection `connection`: a request for one worker session.
    pub(super) fn relay_request(&self, connection: u64, frame: Bytes) -> Result<()> {
        let Relayed::Request {
            session,
            id,
            response_values,
            format,
        } = Message::inspect(&frame)?
        else {
            bail!("a backbone may only send requests");
        };
        // Before taking the lock: the hash is the one cost here that grows with the rows.
        let request_hash = request_hash(&frame);
        let mut links = self.links();
        let order = links.order;
        let Some(worker) = links.workers.get_mut(&session) else {
            links.fail(id, format!("session {session} is not connected"));
            return Ok(());
        };
        if worker.previous_version && format != RowFormat::F32 {
            let message = format!(
                "session {session} speaks protocol version {PREVIOUS_VERSION}, whose requests carry f32 rows only"
            );
            links.fail(id, message);
            return Ok(());
        }
        if worker.unanswered >= MAX_UNANSWERED {
            let message = format!("session {session} has {MAX_UNANSWERED} requests unanswered");
            links.fail(id, message);
            return Ok(());
        }
        let asked = Asked {
            request_bytes: frame.len() as u64,
            response_values,
            request_hash,
            deadline: Instant::now() + self.answer_deadline,
            order,
        };
        let bytes = frame.len() as u64;
        if worker.tx.send(frame).is_err() {
            links.fail(id, format!("session {session} is leaving"));
            return Ok(());
        }
        worker.unanswered += 1;
        links.counts.requests += 1;
        links.counts.relayed_bytes += bytes;
        // A repeated id replaces the entry: the count above then over-counts by one until the
        // session answers or leaves, which only makes the cap stricter.
        let waiting = Waiting {
            asked,
            failed: false,
            connection,
        };
        links.outstanding.insert((session, id), waiting);
        Ok(())
    }

    /// Session `session` ended (its connection closed, failed or lied).
    pub(super) fn remove_worker(&self, session: u64) {
        self.links().remove_worker(session);
    }

    /// Drops `session`, whose key may no longer serve, as if it had disconnected
    /// (`Links::remove_worker`), and tells the worker `why` in a failure with id 0, the frame
    /// a refused hello gets, so that it logs the reason; then its connection ends (the writer
    /// sends the failure before it closes the socket). False if it was not connected.
    pub(super) fn expel(&self, session: u64, why: bonds::Refused) -> bool {
        let mut links = self.links();
        let Some(worker) = links.remove_worker(session) else {
            return false;
        };
        links.counts.expelled += 1;
        let failure = Failure::new(0, why.to_string());
        let _ = worker.tx.send(Message::Failure(failure).encode().into());
        let _ = worker.expelled.send(why);
        true
    }

    /// Fails every request past its deadline (the backbone computes it locally), forgets those
    /// past their grace, and sends the directory if it changed: the hub's clock task, each
    /// tick.
    pub(super) fn tick(&self, now: Instant) {
        let mut links = self.links();
        let mut late = Vec::new();
        let mut forgotten = Vec::new();
        for (key, waiting) in links.outstanding.iter_mut() {
            if now > waiting.asked.deadline + LATE_GRACE {
                forgotten.push(*key);
            } else if now > waiting.asked.deadline && !waiting.failed {
                waiting.failed = true;
                late.push(*key);
            }
        }
        for (session, id) in late {
            links.fail(id, format!("session {session} did not answer in time"));
        }
        for (session, id) in forgotten {
            links.take(session, id);
        }
        if links.directory_changed {
            links.send_directory();
        }
    }

    /// Requests waiting for an answer (all sessions).
    #[cfg(test)]
    pub(super) fn unanswered(&self) -> usize {
        self.links().outstanding.len()
    }

    /// `/metrics` on the registry listener, as Prometheus text.
    pub(super) fn metrics_text(&self) -> String {
        let links = self.links();
        let c = &links.counts;
        Exposition::default()
            .gauge(
                "kvasir_hub_sessions",
                "Worker sessions connected.",
                links.workers.len() as u64,
            )
            .gauge(
                "kvasir_hub_claimed_experts",
                "Experts claimed by connected sessions.",
                links.claims as u64,
            )
            .gauge(
                "kvasir_hub_unanswered_requests",
                "Requests relayed to a session and not answered yet.",
                links.outstanding.len() as u64,
            )
            .counter(
                "kvasir_hub_requests_total",
                "Requests relayed from the backbone to a session.",
                c.requests,
            )
            .counter(
                "kvasir_hub_relayed_bytes_total",
                "Bytes of dispatch frames relayed between the backbone and sessions, either way.",
                c.relayed_bytes,
            )
            .counter(
                "kvasir_hub_metered_bytes_total",
                "Bytes of well-formed dispatch traffic metered (requests and their answers).",
                c.metered_bytes,
            )
            .counter(
                "kvasir_hub_refused_answers_total",
                "Answers refused and dropped (wrong size, unasked, badly signed): each also dropped its worker.",
                c.refused_answers,
            )
            .counter(
                "kvasir_hub_late_answers_total",
                "Answers after their deadline: dropped, neither relayed nor metered.",
                c.late_answers,
            )
            .counter(
                "kvasir_hub_failed_requests_total",
                "Failures sent to the backbone (session gone, over its cap, too slow, lied).",
                c.failed_requests,
            )
            .counter(
                "kvasir_hub_standing_drops_total",
                "Worker sessions dropped while connected because the ledger no longer says their key may serve (bonded below min_bond, jailed, or unreadable past the grace).",
                c.expelled,
            )
            .text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::hash::Hash;
    use kvasir_ledger::Keypair;
    use kvasir_wire::{Request, Response};

    fn hub(dir: &std::path::Path, deadline: Duration) -> Hub {
        Hub::for_tests(dir, deadline)
    }

    fn request(session: u64, id: u64) -> Bytes {
        Message::Request(Request {
            session,
            id,
            layer: 0,
            hidden: 2,
            format: kvasir_wire::RowFormat::F32,
            rows: vec![1.0, 2.0],
            experts: vec![(0, vec![0])],
        })
        .encode()
        .into()
    }

    /// A worker session on `hub` and the frames relayed to it; the backbone's receiving end.
    fn attach(
        hub: &Hub,
        session: u64,
    ) -> (
        mpsc::UnboundedReceiver<Bytes>,
        mpsc::UnboundedReceiver<Bytes>,
    ) {
        attach_as(hub, session, &Keypair::generate())
    }

    /// `attach`, for a worker of key `key` whose hello declared model "m".
    fn attach_as(
        hub: &Hub,
        session: u64,
        key: &Keypair,
    ) -> (
        mpsc::UnboundedReceiver<Bytes>,
        mpsc::UnboundedReceiver<Bytes>,
    ) {
        let (backbone_tx, backbone_rx) = mpsc::unbounded_channel();
        let (worker_tx, worker_rx) = mpsc::unbounded_channel();
        let mut links = hub.links();
        links.backbone = Some((1, backbone_tx));
        let entry = DirectoryEntry {
            session,
            worker: key.address(),
            model_id: "m".into(),
            experts: vec![(0, 0)],
        };
        links.add_worker(entry, worker_tx).unwrap();
        (worker_rx, backbone_rx)
    }

    /// What `hub` expects session `session` to sign its answers in.
    fn scope(hub: &Hub, session: u64) -> AnswerScope<'_> {
        AnswerScope {
            chain_id: &hub.chain_id,
            hub: hub.key.address(),
            session,
            model_id: "m",
        }
    }

    /// The response to `request` (one value per listed row of width 2), signed by `key`.
    fn signed_answer(hub: &Hub, session: u64, key: &Keypair, request: &[u8]) -> Bytes {
        let Ok(Relayed::Request { id, .. }) = Message::inspect(request) else {
            panic!("not a request");
        };
        let response = Response::unsigned(id, vec![0.5; 2]);
        let frame = response.signed_frame(&scope(hub, session), request_hash(request), key);
        frame.into()
    }

    fn failures(rx: &mut mpsc::UnboundedReceiver<Bytes>) -> Vec<u64> {
        let mut ids = Vec::new();
        while let Ok(frame) = rx.try_recv() {
            if let Ok(Message::Failure(f)) = Message::decode(&frame) {
                ids.push(f.id);
            }
        }
        ids
    }

    /// A worker of the previous protocol version reads f32 rows only: a request with Q8_0
    /// rows for it is failed back to the backbone at once (which computes it itself), one
    /// with f32 rows is relayed, and a worker of this version gets both.
    #[test]
    fn q8_0_rows_do_not_go_to_a_worker_of_the_previous_version() {
        let q8 = |session: u64, id: u64| -> Bytes {
            Message::Request(Request {
                session,
                id,
                layer: 0,
                hidden: 32,
                format: kvasir_wire::RowFormat::Q8_0,
                rows: vec![0.5; 32],
                experts: vec![(0, vec![0])],
            })
            .encode()
            .into()
        };
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let (mut old, mut backbone) = attach(&hub, 1);
        hub.links().of_previous_version(1);
        hub.relay_request(1, q8(1, 10)).unwrap();
        hub.relay_request(1, request(1, 11)).unwrap();
        assert_eq!(failures(&mut backbone), [10]);
        assert_eq!(old.try_recv().unwrap(), request(1, 11));
        assert!(old.try_recv().is_err());
        let (mut current, mut backbone) = attach(&hub, 2);
        hub.relay_request(1, q8(2, 12)).unwrap();
        assert!(failures(&mut backbone).is_empty());
        assert_eq!(current.try_recv().unwrap(), q8(2, 12));
    }

    #[test]
    fn a_session_that_never_answers_holds_at_most_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let (mut worker, mut backbone) = attach(&hub, 1);
        for id in 0..(MAX_UNANSWERED as u64 + 10) {
            hub.relay_request(1, request(1, id)).unwrap();
        }
        assert_eq!(hub.unanswered(), MAX_UNANSWERED);
        let mut relayed = 0;
        while worker.try_recv().is_ok() {
            relayed += 1;
        }
        assert_eq!(relayed, MAX_UNANSWERED);
        // The ten over the cap were failed at once.
        let over: Vec<u64> = (MAX_UNANSWERED as u64..MAX_UNANSWERED as u64 + 10).collect();
        assert_eq!(failures(&mut backbone), over);
        let metrics = hub.metrics_text();
        for line in [
            format!("kvasir_hub_unanswered_requests {MAX_UNANSWERED}\n"),
            format!("kvasir_hub_requests_total {MAX_UNANSWERED}\n"),
            format!(
                "kvasir_hub_relayed_bytes_total {}\n",
                MAX_UNANSWERED * request(1, 0).len()
            ),
            "kvasir_hub_failed_requests_total 10\n".to_string(),
            "# HELP kvasir_hub_sessions Worker sessions connected.\n".to_string(),
        ] {
            assert!(metrics.contains(&line), "{line:?} missing: {metrics}");
        }
    }

    #[test]
    fn requests_past_their_deadline_are_failed_once_and_late_answers_earn_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_millis(10));
        let key = Keypair::generate();
        let (_worker, mut backbone) = attach_as(&hub, 1, &key);
        hub.relay_request(1, request(1, 7)).unwrap();
        let late = signed_answer(&hub, 1, &key, &request(1, 7));
        hub.tick(Instant::now() + Duration::from_millis(20));
        assert_eq!(failures(&mut backbone), vec![7]);
        // Failed once, not again.
        hub.tick(Instant::now() + Duration::from_millis(30));
        assert!(backbone.try_recv().is_err());
        // The answer that comes after: not relayed, not metered, and the worker stays.
        std::thread::sleep(Duration::from_millis(20));
        hub.relay_answer(1, late).unwrap();
        assert!(backbone.try_recv().is_err());
        assert!(hub.registry.sessions().unwrap().is_empty());
        assert_eq!(hub.unanswered(), 0);
        // One that is never answered is forgotten after its grace.
        hub.relay_request(1, request(1, 8)).unwrap();
        hub.tick(Instant::now() + LATE_GRACE + Duration::from_secs(1));
        assert_eq!(hub.unanswered(), 0);
    }

    /// When the backbone that asked is gone, an answer to what it asked is neither paid nor
    /// relayed (no backbone would audit it): a worker could otherwise send junk, correctly
    /// signed and sized, to requests nobody waits for. The worker is not blamed.
    #[test]
    fn answers_to_a_backbone_gone_earn_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let key = Keypair::generate();
        let (_worker, mut backbone) = attach_as(&hub, 1, &key);
        for id in [7, 8] {
            hub.relay_request(1, request(1, id)).unwrap();
        }
        hub.links().orphan(1, Instant::now());
        // A new connection of the backbone hears nothing of what the old one asked.
        let (again, mut heard) = mpsc::unbounded_channel();
        hub.links().backbone = Some((2, again));
        hub.tick(Instant::now() + Duration::from_secs(1));
        assert_eq!(failures(&mut heard), Vec::<u64>::new(), "no failures");
        std::thread::sleep(Duration::from_millis(2));
        for id in [7, 8] {
            let answer = signed_answer(&hub, 1, &key, &request(1, id));
            hub.relay_answer(1, answer).unwrap();
        }
        assert!(heard.try_recv().is_err());
        assert!(backbone.try_recv().is_err());
        assert!(
            hub.registry.sessions().unwrap().is_empty(),
            "nothing metered"
        );
        assert!(hub.links().workers.contains_key(&1), "the worker stays");
        // Asked by the connection still attached: paid as ever.
        hub.relay_request(1, request(1, 9)).unwrap();
        let answer = signed_answer(&hub, 1, &key, &request(1, 9));
        hub.relay_answer(1, answer).unwrap();
        assert!(heard.try_recv().is_ok());
        assert_eq!(hub.registry.sessions().unwrap().len(), 1);
    }

    #[test]
    fn only_an_answer_signed_for_exactly_what_was_asked_is_paid_and_relayed() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let key = Keypair::generate();
        let asked = request(1, 7);
        let honest = signed_answer(&hub, 1, &key, &asked);
        let resigned = |scope: AnswerScope<'_>, id: u64, hash: Hash, key: &Keypair| {
            let mut frame = honest.to_vec();
            scope.sign_frame(&mut frame, id, hash, key);
            Bytes::from(frame)
        };
        let here = scope(&hub, 1);
        let hash = request_hash(&asked);
        let other_rows = request_hash(&request(2, 7));
        let mut zeroed = honest.to_vec();
        let end = zeroed.len();
        zeroed[end - 64..].fill(0);
        let mut flipped = honest.to_vec();
        flipped[end - 1] ^= 1;
        let mut changed_partials = honest.to_vec();
        changed_partials[kvasir_wire::HEADER + 12] ^= 1;
        let forged: Vec<(&str, Bytes)> = vec![
            ("no signature", zeroed.into()),
            ("a corrupted signature", flipped.into()),
            ("partials changed after signing", changed_partials.into()),
            ("another key", resigned(here, 7, hash, &Keypair::generate())),
            ("another request id", resigned(here, 8, hash, &key)),
            ("another request body", resigned(here, 7, other_rows, &key)),
            (
                "another session",
                resigned(AnswerScope { session: 2, ..here }, 7, hash, &key),
            ),
            (
                "another model",
                resigned(
                    AnswerScope {
                        model_id: "n",
                        ..here
                    },
                    7,
                    hash,
                    &key,
                ),
            ),
            (
                "another chain",
                resigned(
                    AnswerScope {
                        chain_id: "other",
                        ..here
                    },
                    7,
                    hash,
                    &key,
                ),
            ),
            (
                "another hub",
                resigned(
                    AnswerScope {
                        hub: key.address(),
                        ..here
                    },
                    7,
                    hash,
                    &key,
                ),
            ),
        ];
        for (what, frame) in forged {
            let (_worker, mut backbone) = attach_as(&hub, 1, &key);
            hub.relay_request(1, asked.clone()).unwrap();
            let refused = hub.relay_answer(1, frame).expect_err(what);
            let why = format!("{refused:#}");
            assert!(why.contains("is not signed by the worker"), "{what}: {why}");
            // The backbone hears at once that request 7 failed, and gets no answer.
            assert_eq!(failures(&mut backbone), vec![7], "{what}");
            assert!(hub.registry.sessions().unwrap().is_empty(), "{what}: paid");
            // As the connection loop does with a worker that lied.
            hub.remove_worker(1);
        }
        assert!(hub
            .metrics_text()
            .contains("kvasir_hub_refused_answers_total 10\n"));
        // The honest answer is paid, request and response bytes, and relayed as it came.
        let (_worker, mut backbone) = attach_as(&hub, 1, &key);
        hub.relay_request(1, asked.clone()).unwrap();
        hub.relay_answer(1, honest.clone()).unwrap();
        assert_eq!(backbone.try_recv().ok(), Some(honest.clone()));
        let paid = hub.registry.sessions().unwrap();
        assert_eq!(paid.len(), 1);
        assert_eq!(paid[0].0, 1);
        assert_eq!(paid[0].1.worker, key.address());
        let owed = (asked.len() + honest.len()) as u64;
        assert_eq!(paid[0].1.cumulative_bytes, owed);
    }

    #[test]
    fn an_expelled_session_leaves_as_a_disconnect_does_and_is_told_why() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let (_stays, mut backbone) = attach(&hub, 2);
        let key = Keypair::generate().address();
        let (tx, mut worker) = mpsc::unbounded_channel();
        let entry = DirectoryEntry {
            session: 1,
            worker: key,
            model_id: "m".into(),
            experts: vec![(0, 1)],
        };
        let mut expelled = hub.links().add_worker(entry, tx).unwrap();
        hub.relay_request(1, request(1, 7)).unwrap();
        hub.relay_request(1, request(2, 8)).unwrap();
        assert_eq!(worker.try_recv().ok(), Some(request(1, 7)));
        let why = bonds::Refused::Jailed { key, until: 9 };
        assert!(hub.expel(1, why.clone()));
        // Out of the directory, its claims freed, its unanswered request failed.
        let left: Vec<u64> = hub.links().sessions().iter().map(|(s, _)| *s).collect();
        assert_eq!(left, vec![2]);
        assert_eq!(hub.links().claims, 1);
        assert_eq!(failures(&mut backbone), vec![7]);
        assert_eq!(hub.unanswered(), 1);
        // The worker hears why, as a refused hello would; its connection is told to end.
        let Ok(Message::Failure(told)) = Message::decode(&worker.try_recv().unwrap()) else {
            panic!("the worker was not told why");
        };
        assert_eq!((told.id, told.message), (0, why.to_string()));
        assert_eq!(expelled.try_recv(), Ok(why.clone()));
        // Gone already: expelling it again does nothing, and nor does its connection's leave.
        assert!(!hub.expel(1, why));
        hub.remove_worker(1);
        assert!(backbone.try_recv().is_err());
        let metrics = hub.metrics_text();
        assert!(
            metrics.contains("kvasir_hub_standing_drops_total 1\n"),
            "{metrics}"
        );
    }

    #[test]
    fn claims_are_deduplicated_and_capped() {
        let claims = vec![(0, 1), (0, 1), (2, 3)];
        assert_eq!(distinct_claims(claims).unwrap(), vec![(0, 1), (2, 3)]);
        let many: Vec<ExpertId> = (0..=MAX_CLAIMS_PER_SESSION as u32)
            .map(|i| ((i / 256) as u16, (i % 256) as u16))
            .collect();
        assert!(matches!(
            distinct_claims(many),
            Err(Refused::TooManyClaims(_))
        ));
    }

    #[test]
    fn the_hub_refuses_claims_beyond_its_total_or_a_keys_share_and_frees_them_on_leave() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let (tx, _rx) = mpsc::unbounded_channel();
        let claims = |key: u32| -> Vec<ExpertId> {
            let first = key * MAX_CLAIMS_PER_KEY as u32;
            (first..first + MAX_CLAIMS_PER_KEY as u32)
                .map(|i| ((i >> 16) as u16, i as u16))
                .collect()
        };
        let entry = |session, worker: &Keypair, experts| DirectoryEntry {
            session,
            worker: worker.address(),
            model_id: "m".into(),
            experts,
        };
        let keys: Vec<Keypair> = (0..17).map(|_| Keypair::generate()).collect();
        // One key may claim its share, in one session or several, and no more.
        let mut half = claims(0);
        let rest = half.split_off(MAX_CLAIMS_PER_KEY / 2);
        hub.links()
            .add_worker(entry(1, &keys[0], half), tx.clone())
            .unwrap();
        hub.links()
            .add_worker(entry(2, &keys[0], rest), tx.clone())
            .unwrap();
        assert!(matches!(
            hub.links().add_worker(entry(3, &keys[0], vec![(0, 0)]), tx.clone()),
            Err(Refused::KeyFull(n)) if n == MAX_CLAIMS_PER_KEY + 1
        ));
        // Sixteen keys fill the hub; the seventeenth finds it full.
        for key in 1..16 {
            let session = 100 + u64::from(key);
            let claimed = entry(session, &keys[key as usize], claims(key));
            hub.links().add_worker(claimed, tx.clone()).unwrap();
        }
        assert!(matches!(
            hub.links()
                .add_worker(entry(3, &keys[16], vec![(0, 0)]), tx.clone()),
            Err(Refused::HubFull)
        ));
        hub.remove_worker(101);
        hub.links()
            .add_worker(entry(3, &keys[16], vec![(0, 0)]), tx)
            .unwrap();
    }

    #[test]
    fn directory_changes_are_coalesced_into_one_send_per_tick() {
        let dir = tempfile::tempdir().unwrap();
        let hub = hub(dir.path(), Duration::from_secs(60));
        let (_worker, mut backbone) = attach(&hub, 1);
        for session in 2..20 {
            let (tx, _rx) = mpsc::unbounded_channel();
            let entry = DirectoryEntry {
                session,
                worker: Keypair::generate().address(),
                model_id: "m".into(),
                experts: vec![(0, 0)],
            };
            hub.links().add_worker(entry, tx).unwrap();
        }
        assert!(backbone.try_recv().is_err(), "sent before the tick");
        hub.tick(Instant::now());
        hub.tick(Instant::now());
        let mut directories = 0;
        while let Ok(frame) = backbone.try_recv() {
            if let Ok(Message::Directory(d)) = Message::decode(&frame) {
                assert_eq!(d.sessions.len(), 19);
                directories += 1;
            }
        }
        assert_eq!(directories, 1);
    }
}
