//! The fuzz entry for the hub's metering (built only with `--cfg fuzzing`, by `fuzz/run`):
//! fuzzed bytes are read as a script of backbone requests, worker answers, raw frames and
//! departures, played against a real hub with its sled registry, beside a model of what each
//! session is owed. At the end the registry must hold exactly what the model says: an
//! answer of the right size to a request relayed to that session, signed by that session's
//! worker for exactly that request, pays its request's bytes and its own, once; anything else
//! (among it answers signed by another key, for another request id, request body, session,
//! model, chain or hub, or not signed at all) pays nothing.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use kvasir_ledger::answer::body_hash;
use kvasir_ledger::keys::Keypair;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Bytes;

use super::{Hub, Links, MAX_UNANSWERED};
use kvasir_wire::{
    request_hash, AnswerScope, DirectoryEntry, Failure, Message, Relayed, Request, Response,
};

const SESSIONS: usize = 3;
const MAX_STEPS: usize = 256;

/// The fuzz input, read a byte at a time; zeros once it runs out.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> u8 {
        let (&first, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        first
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        taken.to_vec()
    }
}

struct Session {
    id: u64,
    worker: Keypair,
    frames: mpsc::UnboundedReceiver<Bytes>,
    /// Request id → (the request frame relayed, values the answer must carry), as the model
    /// expects.
    asked: HashMap<u64, (Bytes, usize)>,
    owed: u64,
}

/// Signs the response `frame` to request `id` (relayed as `request`) as the script says:
/// mostly honestly, so that payments happen, otherwise in one of the ways a worker might try
/// to be paid for an answer it did not give. Whether it signed honestly.
fn sign(
    script: &mut Script,
    hub: &Hub,
    s: &Session,
    id: u64,
    request: &[u8],
    frame: &mut [u8],
) -> bool {
    let honest = AnswerScope {
        chain_id: &hub.chain_id,
        hub: hub.key.address(),
        session: s.id,
        model_id: "m",
    };
    let hash = request_hash(request);
    let Some(forgery) = script.byte().checked_sub(160).map(|f| f / 8) else {
        honest.sign_frame(frame, id, hash, &s.worker);
        return true;
    };
    let stranger = Keypair::from_seed(&[9; 32]);
    let worker = &s.worker;
    match forgery {
        0 => honest.sign_frame(frame, id, hash, &stranger),
        // Ids are below 8, so this is always another one.
        1 => honest.sign_frame(frame, id ^ 8, hash, worker),
        2 => honest.sign_frame(frame, id, body_hash(b"other rows"), worker),
        3 => AnswerScope {
            session: s.id ^ 1,
            ..honest
        }
        .sign_frame(frame, id, hash, worker),
        4 => AnswerScope {
            model_id: "n",
            ..honest
        }
        .sign_frame(frame, id, hash, worker),
        5 => AnswerScope {
            chain_id: "other",
            ..honest
        }
        .sign_frame(frame, id, hash, worker),
        6 => AnswerScope {
            hub: stranger.address(),
            ..honest
        }
        .sign_frame(frame, id, hash, worker),
        // Left unsigned (zeros).
        7 => {}
        // Signed, then its partials or signature altered.
        _ => {
            honest.sign_frame(frame, id, hash, worker);
            let at = if forgery % 2 == 0 {
                frame.len() - 1
            } else {
                frame.len() / 2
            };
            if let Some(byte) = frame.get_mut(at) {
                *byte ^= 1;
            }
        }
    }
    false
}

fn hub() -> &'static Hub {
    static HUB: OnceLock<(tempfile::TempDir, Hub)> = OnceLock::new();
    let (_, hub) = HUB.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let hub = Hub::for_tests(dir.path(), Duration::from_secs(600));
        (dir, hub)
    });
    hub
}

/// A well-formed request for `session`, shaped by the script.
fn request(script: &mut Script, session: u64) -> Bytes {
    let rows = u32::from(script.byte() % 4);
    let hidden = 1 + u32::from(script.byte() % 3);
    let experts = (0..script.byte() % 3)
        .map(|expert| {
            let listed = (0..script.byte() % 4)
                .map(|_| u32::from(script.byte()) % rows.max(1))
                .collect();
            (u16::from(expert), listed)
        })
        .collect();
    Message::Request(Request {
        session,
        id: u64::from(script.byte() % 8),
        layer: 0,
        hidden,
        format: kvasir_wire::RowFormat::F32,
        rows: vec![0.5; (rows * hidden) as usize],
        experts,
    })
    .encode()
    .into()
}

/// Plays one script; panics if the hub pays what the model does not.
pub fn relay_script(data: &[u8]) {
    let hub = hub();
    let (backbone_tx, mut backbone) = mpsc::unbounded_channel();
    *hub.links() = Links::default();
    hub.links().backbone = Some((1, backbone_tx));
    let mut sessions: Vec<Session> = (0..SESSIONS)
        .map(|_| {
            let (tx, frames) = mpsc::unbounded_channel();
            let id = hub.registry.new_session().expect("a session id");
            let worker = Keypair::generate();
            let entry = DirectoryEntry {
                session: id,
                worker: worker.address(),
                model_id: "m".into(),
                experts: vec![(0, 0)],
            };
            hub.links()
                .add_worker(entry, tx)
                .expect("room for a session");
            Session {
                id,
                worker,
                frames,
                asked: HashMap::new(),
                owed: 0,
            }
        })
        .collect();
    let mut script = Script(data);
    for _ in 0..MAX_STEPS {
        if script.0.is_empty() {
            break;
        }
        let op = script.byte();
        let at = usize::from(script.byte()) % SESSIONS;
        while backbone.try_recv().is_ok() {}
        match op % 6 {
            // A request from the backbone, well-formed or raw.
            kind @ (0 | 1) => {
                let frame = if kind == 0 {
                    request(&mut script, sessions[at].id)
                } else {
                    let len = usize::from(script.byte());
                    Bytes::from(script.bytes(len))
                };
                if hub.relay_request(1, frame.clone()).is_ok() {
                    // A raw frame may name any session, so every one is looked at.
                    for s in sessions.iter_mut() {
                        if let Ok(relayed) = s.frames.try_recv() {
                            assert_eq!(relayed, frame);
                            let Ok(Relayed::Request {
                                id,
                                response_values,
                                ..
                            }) = Message::inspect(&frame)
                            else {
                                panic!("relayed a frame that is not a request");
                            };
                            s.asked.insert(id, (frame.clone(), response_values));
                        }
                    }
                }
            }
            // An answer from the worker: a response of some size, signed well or badly, a
            // failure, or raw bytes (which a fuzzer cannot sign for a key made in this run).
            kind @ (2..=4) => {
                let s = &mut sessions[at];
                let id = u64::from(script.byte() % 8);
                let asked = s.asked.remove(&id);
                let mut signed = false;
                let frame: Bytes = match kind {
                    2 => {
                        let values = match (&asked, script.byte()) {
                            (Some((_, values)), 0..=191) => *values,
                            (_, n) => usize::from(n % 16),
                        };
                        let response = Response::unsigned(id, vec![0.25; values]);
                        let mut frame = Message::Response(response).encode();
                        let request = asked.as_ref().map_or(&[][..], |(request, _)| request);
                        signed = sign(&mut script, hub, s, id, request, &mut frame);
                        frame.into()
                    }
                    3 => Message::Failure(Failure::new(id, "no")).encode().into(),
                    _ => {
                        let len = usize::from(script.byte());
                        Bytes::from(script.bytes(len))
                    }
                };
                let paid = match (&asked, Message::inspect(&frame)) {
                    (Some((request, values)), Ok(Relayed::Response { values: got, .. }))
                        if got == *values && signed =>
                    {
                        Some((request.len() + frame.len()) as u64)
                    }
                    (Some(_), Ok(Relayed::Failure { .. })) => Some(0),
                    _ => None,
                };
                let outcome = hub.relay_answer(s.id, frame.clone());
                match paid {
                    Some(bytes) => {
                        assert!(outcome.is_ok(), "a good answer refused: {outcome:?}");
                        s.owed += bytes;
                        if bytes > 0 {
                            assert_eq!(backbone.try_recv().ok(), Some(frame));
                        }
                    }
                    None => {
                        assert!(outcome.is_err(), "a bad answer accepted");
                        // As the connection loop does: a worker that lied is dropped.
                        hub.remove_worker(s.id);
                        s.asked.clear();
                    }
                }
            }
            _ => {
                hub.remove_worker(sessions[at].id);
                sessions[at].asked.clear();
            }
        }
        assert!(hub.links().outstanding.len() <= SESSIONS * MAX_UNANSWERED);
    }
    // Counts only grow, so a wrong payment at any step still shows at the end.
    for s in &sessions {
        let metered = hub.registry.meter(s.id, s.worker.address(), 0, 0);
        let metered = metered.expect("a count");
        assert_eq!(metered, s.owed, "session {} paid other than owed", s.id);
    }
}
