//! The network executor: per layer step it sends one request per worker first, computes the
//! local experts while those are in flight, then collects the answers. A worker that fails,
//! leaves or stalls past the timeout, or whose answer is of the wrong size or not signed by
//! the worker the directory names for exactly the request sent (`kvasir_wire::AnswerScope`), has its
//! experts computed locally instead (every expert is also held locally), so the output never
//! changes and nothing hangs; a stalled session is not used again, and a worker that
//! reconnects is a new session and is used again. Each answer used comes with what an audit
//! needs (`SignedAnswer`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use kvasir_api::generation::{AuditReport, DispatchCounts};
use kvasir_inference::config::Config;
use kvasir_inference::kernels::quant;
use kvasir_inference::moe::{ExpertError, ExpertExecutor, ExpertRequest, LocalExperts};
use kvasir_ledger::answer::AnswerClaim;
use kvasir_ledger::keys::{Address, Keypair, Signature};
use tokio_tungstenite::tungstenite::Bytes;

use super::audit::{Auditor, Disputed};
use super::choice::{Choice, SHUN};
use super::hub_link::{maintain_link, HubLink, InFlight};
use super::placements::Placements;
use super::provable::{join_rows, provable_groups, split_rows, EVIDENCE_BODIES};
use crate::backbone::lock;
use crate::bonds::BondCheck;
use crate::metrics::Histogram;
use kvasir_wire::model_id;
use kvasir_wire::spec::ExpertSpec;
use kvasir_wire::{
    request_body, request_hash, response_body, split_partials, AnswerScope, Challenge, Message,
    Request, RowFormat, TranslateError, WireError,
};

/// An expert executor that sends the `remote` experts to workers through the hub.
pub struct RemoteExperts {
    local: LocalExperts,
    hidden: usize,
    timeout: Duration,
    link: HubLink,
    /// Who serves each expert.
    choice: Choice,
    auditor: Auditor,
    /// What a request's and its response's bodies may take together, so that any answer
    /// fits in an evidence transaction (`provable`).
    provable_bytes: usize,
    /// The layers whose rows go as Q8_0 blocks: a quarter of the bytes, the same answers.
    quantized_rows: BTreeSet<usize>,
    stats: Mutex<DispatchCounts>,
    /// From sending a request to its answer, for the answers that came.
    pub round_trip: Histogram,
}

/// Whether two answers are the same bits (not merely equal floats: -0.0 is not 0.0, and a
/// NaN is itself).
/// The first of `a`'s partials whose bits differ from `b`'s (or that `b` lacks), if any.
fn first_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<usize> {
    let same = |x: &Vec<f32>, y: &Vec<f32>| {
        x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
    };
    (0..a.len().max(b.len())).find(|&i| !a.get(i).zip(b.get(i)).is_some_and(|(x, y)| same(x, y)))
}

/// One worker's share of a layer step.
struct Dispatch {
    session: u64,
    id: u64,
    sent: Instant,
    /// Indices into the step's requests.
    members: Vec<usize>,
    /// The request that went out, if one did.
    in_flight: Option<InFlight>,
}

/// A remote answer that verified and was used, with what an audit needs to recompute it and,
/// on a mismatch, to quote it in an Evidence transaction: the request and response bodies
/// (the frames as sent and received, kept without copying) and the worker's signature of
/// `claim`.
#[derive(Clone, Debug)]
pub struct SignedAnswer {
    pub worker: Address,
    /// What the signature was verified for: hub, session, request id, model and the blake3
    /// of both bodies.
    pub claim: AnswerClaim,
    pub signature: Signature,
    challenge: Arc<Challenge>,
    request: Bytes,
    response: Bytes,
}

impl SignedAnswer {
    pub fn session(&self) -> u64 {
        self.claim.session
    }

    pub fn request_id(&self) -> u64 {
        self.claim.request_id
    }

    /// The chain the claim is signed on (as the hub's challenge named it).
    pub fn chain_id(&self) -> &str {
        &self.challenge.chain_id
    }

    /// The request body exactly as sent (see `kvasir_wire::request_body`).
    pub fn request_body(&self) -> &[u8] {
        request_body(&self.request)
    }

    /// The signed response body exactly as received (see `kvasir_wire::response_body`).
    pub fn response_body(&self) -> &[u8] {
        response_body(&self.response)
    }
}

/// Why a remote answer was not used.
#[derive(Debug, thiserror::Error)]
enum Rejected {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("not a response")]
    NotAResponse,
    #[error(transparent)]
    Shape(#[from] TranslateError),
    #[error("not signed by {0} as its answer to this request")]
    BadSignature(Address),
}

impl Dispatch {
    /// The answer `frame` checked as `collect` uses it: a response, of the size the request
    /// implies, signed by the directory's worker for exactly the request sent (chain, hub,
    /// session, id, model `model_id`, both bodies); its partials split per member, and the
    /// signed answer.
    fn accept(
        &self,
        in_flight: &InFlight,
        model_id: &str,
        frame: Bytes,
        requests: &[ExpertRequest],
    ) -> Result<(Vec<Vec<f32>>, SignedAnswer), Rejected> {
        let Message::Response(response) = Message::decode(&frame)? else {
            return Err(Rejected::NotAResponse);
        };
        let split = split_partials(&response.partials, requests, &self.members)?;
        let scope = AnswerScope::new(&in_flight.challenge, self.session, model_id);
        let claim = scope
            .verify(
                &in_flight.worker,
                self.id,
                request_hash(&in_flight.request),
                response_body(&frame),
                &response.signature,
            )
            .map_err(|_| Rejected::BadSignature(in_flight.worker))?;
        let signed = SignedAnswer {
            worker: in_flight.worker,
            claim,
            signature: response.signature,
            challenge: in_flight.challenge.clone(),
            request: in_flight.request.clone(),
            response: frame,
        };
        Ok((split, signed))
    }
}

impl RemoteExperts {
    /// The executor before any link: `local` holds every expert, for the fallback.
    fn new(
        local: LocalExperts,
        remote: ExpertSpec,
        model_id: String,
        hidden: usize,
        timeout: Duration,
    ) -> RemoteExperts {
        let quantized_rows = match hidden.is_multiple_of(quant::BLOCK) {
            true => local.layers_quantizing_input(),
            false => BTreeSet::new(),
        };
        RemoteExperts {
            quantized_rows,
            local,
            choice: Choice::new(remote, model_id),
            hidden,
            timeout,
            link: HubLink::new(),
            auditor: Auditor::new(0.0, 0, None),
            provable_bytes: EVIDENCE_BODIES,
            stats: Mutex::new(DispatchCounts::default()),
            round_trip: Histogram::default(),
        }
    }

    /// Dials the hub at `hub_url` as the backbone `key` acting for market `order` (zero: none;
    /// the link is kept up on `runtime`, redialled when it drops) and dispatches the `remote`
    /// experts; `local` holds every expert, for the fallback.
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        runtime: &tokio::runtime::Runtime,
        hub_url: &str,
        key: Keypair,
        order: u64,
        model_dir: &std::path::Path,
        local: LocalExperts,
        remote: ExpertSpec,
        timeout: Duration,
    ) -> Result<RemoteExperts> {
        let config = Config::load(model_dir)?;
        let id = model_id(model_dir)?;
        let experts = RemoteExperts::new(local, remote, id, config.hidden_size, timeout);
        runtime.spawn(maintain_link(
            hub_url.to_string(),
            key,
            experts.choice.model_id().to_string(),
            order,
            experts.link.clone(),
        ));
        Ok(experts)
    }

    /// An executor with no link: `local` evaluates every expert.
    #[cfg(test)]
    pub(in crate::backbone) fn unlinked(local: LocalExperts, hidden: usize) -> RemoteExperts {
        let remote: ExpertSpec = "*:*".parse().unwrap_or_else(|_| unreachable!());
        RemoteExperts::new(local, remote, String::new(), hidden, Duration::ZERO)
    }

    /// This executor, auditing answers with `auditor` (by default none is audited).
    pub fn with_auditor(mut self, auditor: Auditor) -> RemoteExperts {
        self.auditor = auditor;
        self
    }

    /// This executor, dispatching only to sessions whose worker `bonds` says may serve
    /// (checked on a thread of its own; a session not yet checked is not dispatched to).
    pub fn with_bond_check(mut self, bonds: BondCheck) -> RemoteExperts {
        self.choice = self.choice.with_bond_check(self.link.clone(), bonds);
        self
    }

    /// This executor, dispatching only to workers placed for the order `placements` reads
    /// (followed on a thread of its own; until the first reading, nothing is dispatched).
    pub fn with_placements(mut self, placements: Placements) -> RemoteExperts {
        self.choice = self.choice.with_placements(placements);
        self
    }

    pub fn auditor(&self) -> &Auditor {
        &self.auditor
    }

    /// What the audits found so far.
    pub fn audit_report(&self) -> AuditReport {
        self.auditor.report()
    }

    /// What the audits found, once every piece of evidence is committed or given up on.
    pub fn finish_audits(&self) -> AuditReport {
        self.auditor.finish()
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
        self.link.read_directory(|directory| {
            self.choice.remote().resolve(config).iter().all(|(l, e)| {
                self.choice
                    .session_for(directory, *l as usize, *e as usize)
                    .is_some()
            })
        })
    }

    /// How layer `layer`'s rows go to workers: as Q8_0 blocks where its experts take their
    /// input quantized anyway (a quantized GGUF file), so that the worker computes the same
    /// bits from a little over a quarter of the bytes; as `f32` otherwise.
    fn row_format(&self, layer: usize) -> RowFormat {
        match self.quantized_rows.contains(&layer) {
            true => RowFormat::Q8_0,
            false => RowFormat::F32,
        }
    }

    /// Sends each worker its share; returns the shares and the requests left to do locally.
    fn send(&self, layer: usize, requests: &[ExpertRequest]) -> (Vec<Dispatch>, Vec<usize>) {
        let up = self.link.is_up();
        let mut groups: BTreeMap<u64, (Address, Vec<usize>)> = BTreeMap::new();
        let mut local = Vec::new();
        self.link.read_directory(|directory| {
            for (i, request) in requests.iter().enumerate() {
                match self.choice.session_for(directory, layer, request.expert) {
                    Some((session, worker)) if up => {
                        let (_, members) = groups.entry(session).or_insert((worker, Vec::new()));
                        members.push(i);
                    }
                    _ => local.push(i),
                }
            }
        });
        let mut dispatches = Vec::new();
        let groups = groups.into_iter().flat_map(|(session, (worker, members))| {
            provable_groups(members, requests, self.hidden, self.provable_bytes)
                .into_iter()
                .map(move |members| (session, worker, members))
        });
        for (session, worker, members) in groups {
            let id = self.link.next_id();
            let request = Request::from_expert_requests(
                session,
                id,
                (layer, self.hidden),
                self.row_format(layer),
                requests,
                &members,
            );
            let in_flight = match request {
                Ok(request) => self.link.send(worker, id, request),
                Err(e) => {
                    tracing::warn!("layer {layer}: no request for session {session}: {e}");
                    None
                }
            };
            dispatches.push(Dispatch {
                session,
                id,
                sent: Instant::now(),
                members,
                in_flight,
            });
        }
        (dispatches, local)
    }

    /// Waits for one worker's answer until `deadline`; its partials, split per member, and
    /// the signed answer they came in.
    fn collect(
        &self,
        dispatch: &Dispatch,
        requests: &[ExpertRequest],
        deadline: Instant,
    ) -> Option<(Vec<Vec<f32>>, SignedAnswer)> {
        let in_flight = dispatch.in_flight.as_ref()?;
        let left = deadline.saturating_duration_since(Instant::now());
        let waited = in_flight.answer.recv_timeout(left);
        self.link.forget(dispatch.id);
        let frame = match waited {
            Ok(Ok(frame)) => {
                self.round_trip.observe(dispatch.sent.elapsed());
                frame
            }
            Ok(Err(message)) => {
                tracing::warn!("worker failed request {}: {message}", dispatch.id);
                self.shun(dispatch.session, Some(SHUN));
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "session {} stalled on request {}",
                    dispatch.session,
                    dispatch.id
                );
                self.shun(dispatch.session, None);
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return None,
        };
        // A wrong size and a bad signature alike: computed locally, as any failed answer.
        match dispatch.accept(in_flight, self.choice.model_id(), frame, requests) {
            Ok(accepted) => Some(accepted),
            Err(e) => {
                let (session, id) = (dispatch.session, dispatch.id);
                tracing::warn!("session {session}'s answer to request {id} is not used: {e}");
                self.shun(session, Some(SHUN));
                None
            }
        }
    }

    fn shun(&self, session: u64, time: Option<Duration>) {
        self.choice.shun(session, time, &self.link.sessions());
    }

    pub fn stats(&self) -> DispatchCounts {
        *lock(&self.stats)
    }
}

impl RemoteExperts {
    /// `partials`, the answer `signed` carried, if an audit does not find it wrong; if it
    /// does, the executor's own result, and the worker is not dispatched to again.
    fn audit(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
        partials: Vec<Vec<f32>>,
        signed: &SignedAnswer,
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        if !self.auditor.should_audit(&signed.worker) {
            return Ok(partials);
        }
        let own = self.local.evaluate(layer, requests)?;
        // The expert a wrong answer got wrong first: the one its evidence carries.
        let wrong = first_difference(&partials, &own).map(|i| Disputed {
            layer,
            expert: requests.get(i).map_or(0, |r| r.expert),
        });
        self.auditor.audited(signed, wrong);
        if wrong.is_none() {
            return Ok(partials);
        }
        // Every session of its key, for good.
        self.choice.catch(signed.worker);
        Ok(own)
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
        match split_rows(requests, self.hidden, self.provable_bytes) {
            None => self.evaluate_provable(layer, requests),
            Some((pieces, origin)) => {
                let partials = self.evaluate_provable(layer, &pieces)?;
                Ok(join_rows(partials, &origin, requests.len()))
            }
        }
    }
}

impl RemoteExperts {
    /// `evaluate` of requests each small enough to go in one provable request.
    fn evaluate_provable(
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
                Some((partials, signed)) => {
                    stats.remote_evaluations += dispatch.members.len() as u64;
                    self.audit(layer, &subset(&dispatch.members), partials, &signed)?
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    use kvasir_inference::checkpoint::Checkpoint;
    use kvasir_ledger::answer::body_hash;
    use tokio::sync::mpsc;

    use kvasir_wire::Response;

    const SESSION: u64 = 5;
    const MODEL: &str = "m";

    fn tiny() -> PathBuf {
        crate::engine::tiny_checkpoint()
    }

    fn every_expert() -> LocalExperts {
        let dir = tiny();
        let config = Config::load(&dir).unwrap();
        LocalExperts::load(&Checkpoint::open(&dir).unwrap(), &config, |_, _| true).unwrap()
    }

    /// Rows go as Q8_0 blocks for a layer whose experts are of block formats (the GGUF
    /// fixture's MoE layer), as f32 for one whose are not (the f32 checkpoint's).
    #[test]
    fn rows_go_quantized_only_where_the_experts_quantize_them() {
        let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../inference/tests/data/gguf/tiny-qwen3moe-q8_0.gguf");
        let config = Config::load(&fixture).unwrap();
        let checkpoint = Checkpoint::open(&fixture).unwrap();
        let local = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
        let quantized = RemoteExperts::unlinked(local, config.hidden_size);
        assert_eq!(quantized.row_format(1), RowFormat::Q8_0);
        assert_eq!(quantized.row_format(0), RowFormat::F32, "a dense layer");
        let plain = RemoteExperts::unlinked(every_expert(), 64);
        assert!((0..3).all(|layer| plain.row_format(layer) == RowFormat::F32));
    }

    fn challenge() -> Challenge {
        Challenge {
            nonce: [1; 32],
            hub: Keypair::from_seed(&[5; 32]).address(),
            chain_id: "kvasir-test".into(),
        }
    }

    /// How the stand-in worker signs.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Signing {
        Honest,
        /// No answer: a failure instead.
        Fails,
        Unsigned,
        OtherKey,
        OtherRequestId,
        OtherSession,
        OtherModel,
        OtherRequestBody,
        OtherChain,
        OtherHub,
    }

    /// A worker holding every expert answering the request `frame`, signed as `signing`
    /// says. A dishonest one also answers wrong partials (one more than the true ones): were
    /// they used, the output would change.
    fn answer(local: &LocalExperts, key: &Keypair, frame: &[u8], signing: Signing) -> Bytes {
        let Ok(Message::Request(request)) = Message::decode(frame) else {
            panic!("not a request");
        };
        let rows = request.to_expert_requests().unwrap();
        let mut partials = local.evaluate(request.layer as usize, &rows).unwrap();
        if signing != Signing::Honest {
            partials.iter_mut().flatten().for_each(|v| *v += 1.0);
        }
        let response = Response::from_partials(&request, &partials).unwrap();
        let mut out = Message::Response(response).encode();
        let challenge = challenge();
        let honest = AnswerScope::new(&challenge, SESSION, MODEL);
        let (id, hash) = (request.id, request_hash(frame));
        let out_of = |scope: AnswerScope<'_>, out: &mut Vec<u8>| {
            scope.sign_frame(out, id, hash, key);
        };
        match signing {
            Signing::Honest => out_of(honest, &mut out),
            Signing::Unsigned | Signing::Fails => {}
            Signing::OtherKey => honest.sign_frame(&mut out, id, hash, &Keypair::generate()),
            Signing::OtherRequestId => honest.sign_frame(&mut out, id + 1, hash, key),
            Signing::OtherSession => out_of(
                AnswerScope {
                    session: SESSION + 1,
                    ..honest
                },
                &mut out,
            ),
            Signing::OtherModel => out_of(
                AnswerScope {
                    model_id: "n",
                    ..honest
                },
                &mut out,
            ),
            Signing::OtherRequestBody => {
                honest.sign_frame(&mut out, id, body_hash(b"other rows"), key)
            }
            Signing::OtherChain => out_of(
                AnswerScope {
                    chain_id: "other",
                    ..honest
                },
                &mut out,
            ),
            Signing::OtherHub => out_of(
                AnswerScope {
                    hub: key.address(),
                    ..honest
                },
                &mut out,
            ),
        }
        out.into()
    }

    /// The directory's entry for `key`'s session, holding all of layer 0.
    fn entry(key: &Keypair) -> kvasir_wire::DirectoryEntry {
        kvasir_wire::DirectoryEntry {
            session: SESSION,
            worker: key.address(),
            model_id: MODEL.into(),
            experts: (0..8).map(|e| (0, e)).collect(),
        }
    }

    /// A network executor for layer 0 whose link is up, with one worker session of `key`
    /// holding all of layer 0, served by a thread that answers as `signing` says; the thread
    /// and every request frame it was sent.
    fn swarm(
        key: &Keypair,
        signing: Signing,
    ) -> (RemoteExperts, std::thread::JoinHandle<Vec<Bytes>>) {
        let remote = RemoteExperts::new(
            every_expert(),
            "0:*".parse().unwrap(),
            MODEL.into(),
            Config::load(&tiny()).unwrap().hidden_size,
            Duration::from_secs(30),
        );
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        remote.link.up(tx, challenge());
        remote.link.set_directory(vec![entry(key)]);
        let (link, key) = (remote.link.clone(), key.clone());
        let worker = std::thread::spawn(move || {
            let local = every_expert();
            let mut seen = Vec::new();
            while let Some(frame) = rx.blocking_recv() {
                let Ok(kvasir_wire::Relayed::Request { id, .. }) = Message::inspect(&frame) else {
                    panic!("the backbone sent something other than a request");
                };
                let answer = match signing {
                    Signing::Fails => Err("cannot".to_string()),
                    _ => Ok(answer(&local, &key, &frame, signing)),
                };
                link.route(id, answer);
                seen.push(frame);
            }
            seen
        });
        (remote, worker)
    }

    /// One layer step: three experts, sharing tokens.
    fn step(hidden: usize) -> Vec<ExpertRequest> {
        let row = |t: usize| (0..hidden).map(move |c| ((t * hidden + c) % 17) as f32 * 0.125 - 1.0);
        [(1, vec![0, 1]), (3, vec![1, 2]), (6, vec![0])]
            .into_iter()
            .map(|(expert, tokens): (usize, Vec<usize>)| ExpertRequest {
                expert,
                rows: tokens.iter().flat_map(|&t| row(t)).collect(),
                tokens,
            })
            .collect()
    }

    fn bits(partials: &[Vec<f32>]) -> Vec<Vec<u32>> {
        let row = |p: &Vec<f32>| p.iter().map(|v| v.to_bits()).collect();
        partials.iter().map(row).collect()
    }

    /// Ends the stand-in worker (its channel closes with the link); the frames it was sent.
    fn stop(remote: &RemoteExperts, worker: std::thread::JoinHandle<Vec<Bytes>>) -> Vec<Bytes> {
        remote.link.down();
        worker.join().unwrap()
    }

    #[test]
    fn a_well_signed_answer_is_used_and_kept_with_what_an_audit_needs() {
        let key = Keypair::from_seed(&[8; 32]);
        let (remote, worker) = swarm(&key, Signing::Honest);
        let requests = step(remote.hidden);
        let local = remote.local.evaluate(0, &requests).unwrap();

        let (dispatches, here) = remote.send(0, &requests);
        assert!(here.is_empty());
        assert_eq!(dispatches.len(), 1);
        let deadline = Instant::now() + remote.timeout;
        let (partials, signed) = remote.collect(&dispatches[0], &requests, deadline).unwrap();
        assert_eq!(bits(&partials), bits(&local));
        let sent = stop(&remote, worker);
        assert_eq!(sent.len(), 1);

        // What was sent and what came back, byte for byte, and the claim that binds them.
        assert_eq!(signed.worker, key.address());
        assert_eq!(
            (signed.session(), signed.request_id()),
            (SESSION, dispatches[0].id)
        );
        assert_eq!(signed.chain_id(), "kvasir-test");
        assert_eq!(signed.request_body(), request_body(&sent[0]));
        let challenge = challenge();
        let honest = AnswerScope::new(&challenge, SESSION, MODEL);
        let expected = honest.claim(
            dispatches[0].id,
            body_hash(signed.request_body()),
            signed.response_body(),
        );
        assert_eq!(signed.claim, expected);
        assert!(signed
            .claim
            .verify(signed.chain_id(), &signed.worker, &signed.signature)
            .is_ok());
        let Ok(Message::Response(response)) =
            Message::decode(&answer(&remote.local, &key, &sent[0], Signing::Honest))
        else {
            panic!("a response");
        };
        assert_eq!(response.signature, signed.signature);

        // Through `evaluate` too: all remote, nothing computed locally.
        let (remote, worker) = swarm(&key, Signing::Honest);
        assert_eq!(bits(&remote.evaluate(0, &requests).unwrap()), bits(&local));
        stop(&remote, worker);
        let stats = remote.stats();
        assert_eq!((stats.remote_evaluations, stats.fallbacks), (3, 0));
    }

    #[test]
    fn long_rows_go_out_in_requests_small_enough_for_evidence_and_the_output_is_unchanged() {
        let key = Keypair::from_seed(&[8; 32]);
        let (mut remote, worker) = swarm(&key, Signing::Honest);
        // Room for three tokens of one expert per request, at this model's width.
        remote.provable_bytes = 72 + 3 * (8 * remote.hidden + 4);
        let hidden = remote.hidden;
        let row = |t: usize| (0..hidden).map(move |c| ((t + c) % 13) as f32 * 0.25 - 1.5);
        let requests: Vec<ExpertRequest> = [(2, (0..10).collect()), (5, vec![3, 4])]
            .into_iter()
            .map(|(expert, tokens): (usize, Vec<usize>)| ExpertRequest {
                expert,
                rows: tokens.iter().flat_map(|&t| row(t)).collect(),
                tokens,
            })
            .collect();
        let local = remote.local.evaluate(0, &requests).unwrap();
        assert_eq!(bits(&remote.evaluate(0, &requests).unwrap()), bits(&local));
        let sent = stop(&remote, worker);
        // Ten tokens in four pieces, and the other expert's two alone: five requests.
        assert_eq!(sent.len(), 5);
        for frame in &sent {
            let Ok(Message::Request(request)) = Message::decode(frame) else {
                panic!("not a request");
            };
            let response = Response::frame_len(request.response_values());
            let bodies =
                request_body(frame).len() + response - kvasir_wire::HEADER - kvasir_wire::SIGNATURE;
            assert!(bodies <= remote.provable_bytes, "{bodies}");
        }
        assert_eq!(remote.stats().fallbacks, 0);
    }

    #[test]
    fn a_badly_signed_answer_is_not_used_and_the_output_is_unchanged() {
        let key = Keypair::from_seed(&[8; 32]);
        for signing in [
            Signing::Unsigned,
            Signing::OtherKey,
            Signing::OtherRequestId,
            Signing::OtherSession,
            Signing::OtherModel,
            Signing::OtherRequestBody,
            Signing::OtherChain,
            Signing::OtherHub,
        ] {
            let (remote, worker) = swarm(&key, signing);
            let requests = step(remote.hidden);
            let local = remote.local.evaluate(0, &requests).unwrap();
            // Its partials are wrong too: used, they would change the output.
            let output = remote.evaluate(0, &requests).unwrap();
            stop(&remote, worker);
            assert_eq!(bits(&output), bits(&local), "{signing:?}");
            let stats = remote.stats();
            assert_eq!(
                (
                    stats.remote_requests,
                    stats.remote_evaluations,
                    stats.fallbacks
                ),
                (1, 0, 1),
                "{signing:?}"
            );
            assert!(
                remote.choice.is_shunned(SESSION),
                "{signing:?}: passed over"
            );
        }
    }

    /// A session that fails an answer is passed over for a while (the lowest session holding
    /// an expert is chosen, so one that always fails would keep the others from its
    /// experts): the next step is computed here without asking it, and once its time is up
    /// it is asked again.
    #[test]
    fn a_session_that_fails_is_passed_over_for_a_while() {
        let (remote, worker) = swarm(&Keypair::from_seed(&[8; 32]), Signing::Fails);
        let requests = step(remote.hidden);
        let local = remote.local.evaluate(0, &requests).unwrap();
        for _ in 0..2 {
            assert_eq!(bits(&remote.evaluate(0, &requests).unwrap()), bits(&local));
        }
        let stats = remote.stats();
        assert_eq!((stats.remote_requests, stats.fallbacks), (1, 1));
        remote.choice.forgive(SESSION);
        assert_eq!(bits(&remote.evaluate(0, &requests).unwrap()), bits(&local));
        assert_eq!(remote.stats().remote_requests, 2, "asked again");
        stop(&remote, worker);
    }

    #[test]
    fn an_answer_is_checked_against_the_worker_the_directory_named() {
        // Signed honestly, but by a key other than the session's in the directory.
        let (remote, worker) = swarm(&Keypair::from_seed(&[8; 32]), Signing::Honest);
        remote
            .link
            .set_directory(vec![entry(&Keypair::from_seed(&[9; 32]))]);
        let requests = step(remote.hidden);
        let local = remote.local.evaluate(0, &requests).unwrap();
        assert_eq!(bits(&remote.evaluate(0, &requests).unwrap()), bits(&local));
        stop(&remote, worker);
        assert_eq!(remote.stats().fallbacks, 1);
    }
}
