//! The network executor: per layer step it sends one request per worker first, computes the
//! local experts while those are in flight, then collects the answers. A worker that fails,
//! leaves or stalls past the timeout has its experts computed locally instead (every expert
//! is also held locally), so the output never changes and nothing hangs; a stalled session is
//! not used again, and a worker that reconnects is a new session and is used again.

use std::collections::{BTreeMap, HashSet};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use kvasir_api::generation::DispatchCounts;
use kvasir_inference::config::Config;
use kvasir_inference::moe::{ExpertError, ExpertExecutor, ExpertRequest, LocalExperts};
use kvasir_ledger::keys::Keypair;

use super::hub_link::{maintain_link, LinkState};
use super::lock;
use crate::engine::model_id;
use crate::metrics::Histogram;
use crate::spec::ExpertSpec;
use crate::wire::{split_partials, DirectoryEntry, Message, Request};

/// An expert executor that sends the `remote` experts to workers through the hub.
pub struct RemoteExperts {
    local: LocalExperts,
    remote: ExpertSpec,
    model_id: String,
    hidden: usize,
    timeout: Duration,
    link: Arc<Mutex<LinkState>>,
    shunned: Mutex<HashSet<u64>>,
    stats: Mutex<DispatchCounts>,
    /// From sending a request to its answer, for the answers that came.
    pub round_trip: Histogram,
}

/// One worker's share of a layer step.
struct Dispatch {
    session: u64,
    sent: Instant,
    /// Indices into the step's requests.
    members: Vec<usize>,
    answer: Option<std_mpsc::Receiver<Result<Vec<f32>, String>>>,
    id: u64,
}

impl RemoteExperts {
    /// The live session that serves `(layer, expert)`: the lowest-numbered one holding it.
    fn session_for(
        &self,
        directory: &[DirectoryEntry],
        layer: usize,
        expert: usize,
    ) -> Option<u64> {
        if !self.remote.contains(layer, expert) {
            return None;
        }
        let shunned = lock(&self.shunned);
        directory
            .iter()
            .filter(|e| e.model_id == self.model_id && !shunned.contains(&e.session))
            .filter(|e| e.experts.contains(&(layer as u16, expert as u16)))
            .map(|e| e.session)
            .min()
    }

    /// Dials the hub at `hub_url` as the backbone `key` (the link is kept up on `runtime`,
    /// redialled when it drops) and dispatches the `remote` experts; `local` holds every
    /// expert, for the fallback.
    pub fn attach(
        runtime: &tokio::runtime::Runtime,
        hub_url: &str,
        key: Keypair,
        model_dir: &std::path::Path,
        local: LocalExperts,
        remote: ExpertSpec,
        timeout: Duration,
    ) -> Result<RemoteExperts> {
        let config = Config::load(model_dir)?;
        let link = Arc::new(Mutex::new(LinkState::new()));
        let experts = RemoteExperts {
            local,
            remote,
            model_id: model_id(model_dir)?,
            hidden: config.hidden_size,
            timeout,
            link: link.clone(),
            shunned: Mutex::new(HashSet::new()),
            stats: Mutex::new(DispatchCounts::default()),
            round_trip: Histogram::default(),
        };
        runtime.spawn(maintain_link(
            hub_url.to_string(),
            key,
            experts.model_id.clone(),
            link,
        ));
        Ok(experts)
    }

    /// Waits until every remote expert of `config` is held by a live worker; false if that
    /// has not happened within `wait`.
    pub fn wait_until_covered(&self, config: &Config, wait: Duration) -> bool {
        let start = Instant::now();
        while !self.covered(config) {
            if start.elapsed() > wait {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    fn covered(&self, config: &Config) -> bool {
        let link = lock(&self.link);
        self.remote.resolve(config).iter().all(|(l, e)| {
            self.session_for(&link.directory, *l as usize, *e as usize)
                .is_some()
        })
    }

    /// Sends each worker its share; returns the shares and the requests left to do locally.
    fn send(&self, layer: usize, requests: &[ExpertRequest]) -> (Vec<Dispatch>, Vec<usize>) {
        let mut link = lock(&self.link);
        let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let mut local = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.session_for(&link.directory, layer, request.expert) {
                Some(session) if link.tx.is_some() => groups.entry(session).or_default().push(i),
                _ => local.push(i),
            }
        }
        let mut dispatches = Vec::new();
        for (session, members) in groups {
            link.next_id += 1;
            let id = link.next_id;
            let request =
                Request::from_expert_requests(session, id, layer, self.hidden, requests, &members);
            let answer = match request {
                Ok(request) => {
                    let (answer_tx, answer) = std_mpsc::channel();
                    link.pending.insert(id, answer_tx);
                    let frame = Message::Request(request).encode();
                    let sent = link
                        .tx
                        .as_ref()
                        .is_some_and(|tx| tx.send(frame.into()).is_ok());
                    if !sent {
                        // Nothing will answer it: its waiting place must not outlive it.
                        link.pending.remove(&id);
                    }
                    sent.then_some(answer)
                }
                Err(e) => {
                    tracing::warn!("layer {layer}: no request for session {session}: {e}");
                    None
                }
            };
            dispatches.push(Dispatch {
                session,
                sent: Instant::now(),
                members,
                answer,
                id,
            });
        }
        (dispatches, local)
    }

    /// Waits for one worker's answer until `deadline`; its partials, split per member.
    fn collect(
        &self,
        dispatch: &Dispatch,
        requests: &[ExpertRequest],
        deadline: Instant,
    ) -> Option<Vec<Vec<f32>>> {
        let answer = dispatch.answer.as_ref()?;
        let waited = answer.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        lock(&self.link).pending.remove(&dispatch.id);
        let partials = match waited {
            Ok(Ok(partials)) => {
                self.round_trip.observe(dispatch.sent.elapsed());
                partials
            }
            Ok(Err(message)) => {
                tracing::warn!("worker failed request {}: {message}", dispatch.id);
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.shunned).insert(dispatch.session);
                tracing::warn!(
                    "session {} stalled on request {}; not using it again",
                    dispatch.session,
                    dispatch.id
                );
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return None,
        };
        match split_partials(&partials, requests, &dispatch.members) {
            Ok(split) => Some(split),
            Err(e) => {
                tracing::warn!("answer to request {}: {e}", dispatch.id);
                None
            }
        }
    }

    pub fn stats(&self) -> DispatchCounts {
        *lock(&self.stats)
    }
}

impl ExpertExecutor for RemoteExperts {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.local.holds(layer, expert)
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let deadline = Instant::now() + self.timeout;
        let (dispatches, local) = self.send(layer, requests);
        let mut results: Vec<Option<Vec<f32>>> = vec![None; requests.len()];
        let subset = |members: &[usize]| -> Vec<ExpertRequest> {
            members.iter().map(|&i| requests[i].clone()).collect()
        };
        // Local experts while the remote ones are in flight.
        for (i, partial) in local
            .iter()
            .zip(self.local.evaluate(layer, &subset(&local))?)
        {
            results[*i] = Some(partial);
        }
        let mut stats = DispatchCounts::default();
        for dispatch in &dispatches {
            stats.remote_requests += 1;
            let partials = match self.collect(dispatch, requests, deadline) {
                Some(partials) => {
                    stats.remote_evaluations += dispatch.members.len() as u64;
                    partials
                }
                None => {
                    stats.fallbacks += 1;
                    self.local.evaluate(layer, &subset(&dispatch.members))?
                }
            };
            for (i, partial) in dispatch.members.iter().zip(partials) {
                results[*i] = Some(partial);
            }
        }
        let mut total = lock(&self.stats);
        total.remote_requests += stats.remote_requests;
        total.remote_evaluations += stats.remote_evaluations;
        total.fallbacks += stats.fallbacks;
        Ok(results.into_iter().map(Option::unwrap_or_default).collect())
    }
}
