//! Misbehaving peers against the real hub and gateway processes. A peer that sends garbage,
//! wrong shapes, padding, unsolicited or oversized answers, or answers not signed for exactly
//! what it was asked, is dropped and earns nothing; the backbone's output is unchanged. Failed challenges, replayed hellos and impostor backbones
//! are refused. Slow clients are cut off. Nothing panics and the swarm keeps serving.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use kvasir_ledger::answer::body_hash;
use kvasir_ledger::keys::Keypair;
use kvasir_tests::swarm::Swarm;
use kvasir_wire::link::{dial, next_frame, next_message};
use kvasir_wire::model_id;
use kvasir_wire::tls;
use kvasir_wire::{
    request_hash, AnswerScope, Hello, Message, Response, Role, MAX_FRAME, SIGNATURE,
};
use tokio::runtime::Runtime;
use tokio_tungstenite::tungstenite::Bytes;

const PROMPT: &str = "Once upon a time";

#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    Garbage,
    TooFewValues,
    Padding,
    Unsolicited,
    WrongVersion,
    Oversized,
    /// The right answer, unsigned.
    Unsigned,
    /// The right answer, signed by a key other than the one it said hello with.
    OtherKey,
    /// Signed, then one partial changed.
    AlteredAfterSigning,
    /// Signed as an answer to another request id, session, model, request body or chain.
    OtherRequestId,
    OtherSession,
    OtherModel,
    OtherRequestBody,
    OtherChain,
}

/// Every way of answering badly.
const ALL: [Misbehaviour; 14] = [
    Misbehaviour::Garbage,
    Misbehaviour::TooFewValues,
    Misbehaviour::Padding,
    Misbehaviour::Unsolicited,
    Misbehaviour::WrongVersion,
    Misbehaviour::Oversized,
    Misbehaviour::Unsigned,
    Misbehaviour::OtherKey,
    Misbehaviour::AlteredAfterSigning,
    Misbehaviour::OtherRequestId,
    Misbehaviour::OtherSession,
    Misbehaviour::OtherModel,
    Misbehaviour::OtherRequestBody,
    Misbehaviour::OtherChain,
];

/// A worker that authenticates properly, holds all of layer 0, and answers its first
/// request badly (signing properly whatever is not meant to be the fault). Returns its session
/// id and whether the hub then dropped it.
async fn bad_worker(url: String, cert: &Path, model: String, how: Misbehaviour) -> (u64, bool) {
    let tls = tls::client(Some(cert)).unwrap();
    let (tx, mut source) = dial(&url, &tls).await.unwrap();
    let Ok(Message::Challenge(challenge)) = next_message(&mut source).await else {
        panic!("no challenge");
    };
    let key = Keypair::generate();
    let held = (0..8).map(|e| (0, e)).collect();
    let hello = Hello::answer(
        &challenge,
        &key,
        Role::Worker,
        model.clone(),
        "cpu".into(),
        held,
    );
    tx.send(Message::Hello(hello).encode().into()).unwrap();
    let Ok(Message::Welcome(welcome)) = next_message(&mut source).await else {
        panic!("a correct hello must be welcomed");
    };
    let (frame, request) = loop {
        let frame = next_frame(&mut source)
            .await
            .unwrap_or_else(|e| panic!("link ended before a request: {e}"));
        if let Ok(Message::Request(request)) = Message::decode(&frame) {
            break (frame, request);
        }
    };
    let values = request.response_values();
    let scope = AnswerScope::new(&challenge, welcome.session, &model);
    let asked = request_hash(&frame);
    // The response of `n` values to request `id`, signed by `key` as an answer to
    // `signed_id` in `scope` for the request body hashing to `hash`.
    let response = |id, n, scope: AnswerScope<'_>, signed_id, hash, key: &Keypair| {
        let mut frame = Message::Response(Response::unsigned(id, vec![0.5; n])).encode();
        scope.sign_frame(&mut frame, signed_id, hash, key);
        frame
    };
    let id = request.id;
    let honest = |n| response(id, n, scope, id, asked, &key);
    let answer: Vec<u8> = match how {
        Misbehaviour::Garbage => (0..4096).map(|_| rand::random::<u8>()).collect(),
        Misbehaviour::TooFewValues => honest(values - 1),
        Misbehaviour::Padding => honest(values + request.hidden as usize),
        Misbehaviour::Unsolicited => response(id + 1_000, values, scope, id + 1_000, asked, &key),
        Misbehaviour::WrongVersion => {
            let mut frame = honest(values);
            frame[4] = 99;
            frame
        }
        Misbehaviour::Oversized => vec![0; MAX_FRAME + 1],
        Misbehaviour::Unsigned => {
            let mut frame = honest(values);
            let end = frame.len();
            frame[end - SIGNATURE..].fill(0);
            frame
        }
        Misbehaviour::OtherKey => response(id, values, scope, id, asked, &Keypair::generate()),
        Misbehaviour::AlteredAfterSigning => {
            let mut frame = honest(values);
            frame[22] ^= 1;
            frame
        }
        Misbehaviour::OtherRequestId => response(id, values, scope, id + 1, asked, &key),
        Misbehaviour::OtherSession => {
            let other = AnswerScope {
                session: welcome.session + 1,
                ..scope
            };
            response(id, values, other, id, asked, &key)
        }
        Misbehaviour::OtherModel => {
            let other = AnswerScope {
                model_id: "another model",
                ..scope
            };
            response(id, values, other, id, asked, &key)
        }
        Misbehaviour::OtherRequestBody => {
            response(id, values, scope, id, body_hash(b"other rows"), &key)
        }
        Misbehaviour::OtherChain => {
            let other = AnswerScope {
                chain_id: "another chain",
                ..scope
            };
            response(id, values, other, id, asked, &key)
        }
    };
    let _ = tx.send(Bytes::from(answer));
    let dropped = tokio::time::timeout(Duration::from_secs(20), async {
        while next_frame(&mut source).await.is_ok() {}
    })
    .await
    .is_ok();
    (welcome.session, dropped)
}

#[test]
fn bad_answers_drop_the_worker_earn_nothing_and_change_nothing() {
    let swarm = Swarm::start("tiny");
    let local = swarm.local(PROMPT, 4);
    let model = model_id(&swarm.model).unwrap();
    let runtime = Runtime::new().unwrap();
    for how in ALL {
        let (url, cert, model) = (swarm.gateway_url(), swarm.cert(), model.clone());
        let worker = runtime.spawn(async move { bad_worker(url, &cert, model, how).await });
        let remote = swarm.backbone("0:*", PROMPT, 4);
        let (session, dropped) = runtime.block_on(worker).unwrap();
        assert!(dropped, "{how:?}: the hub must drop the worker");
        assert_eq!(remote.token_ids, local.token_ids, "{how:?}");
        assert_eq!(remote.logits_blake3, local.logits_blake3, "{how:?}");
        let fallbacks = remote.dispatch.map_or(0, |d| d.fallbacks);
        assert!(fallbacks >= 1, "{how:?}: {remote:?}");
        let metered = swarm.metered();
        let earned = metered.iter().find(|(s, _, _)| *s == session).map(|m| m.2);
        // A session that earned nothing is not even listed.
        assert_eq!(earned, None, "{how:?}: bytes counted for a bad answer");
    }
    // The hub survived all of it and still serves an honest worker.
    let mut swarm = swarm;
    swarm.add_worker("0:*");
    let remote = swarm.backbone("0:*", PROMPT, 4);
    assert_eq!(remote.token_ids, local.token_ids);
    assert_eq!(remote.dispatch.map(|d| d.fallbacks), Some(0));
}

/// Sends `hello` in answer to a fresh challenge; whether the hub welcomed it.
async fn welcomed(
    url: &str,
    tls: Option<&Path>,
    forge: impl FnOnce(&kvasir_wire::Challenge) -> Hello,
) -> bool {
    let tls = tls::client(tls).unwrap();
    let (tx, mut source) = dial(url, &tls).await.unwrap();
    let Ok(Message::Challenge(challenge)) = next_message(&mut source).await else {
        panic!("no challenge");
    };
    tx.send(Message::Hello(forge(&challenge)).encode().into())
        .unwrap();
    matches!(next_message(&mut source).await, Ok(Message::Welcome(_)))
}

#[test]
fn failed_challenges_replayed_hellos_and_impostor_backbones_are_refused() {
    let swarm = Swarm::start("tiny");
    let model = model_id(&swarm.model).unwrap();
    let cert = swarm.cert();
    let url = swarm.gateway_url();
    let hub_url = format!("ws://{}", swarm.hub_addr);
    let runtime = Runtime::new().unwrap();
    runtime.block_on(async {
        let honest = Keypair::generate();
        let held = vec![(0, 1)];
        // An honest hello is welcomed; the same hello replayed on a new challenge is not.
        let mut captured = None;
        assert!(
            welcomed(&url, Some(&cert), |c| {
                let hello = Hello::answer(
                    c,
                    &honest,
                    Role::Worker,
                    model.clone(),
                    "cpu".into(),
                    held.clone(),
                );
                captured = Some(hello.clone());
                hello
            })
            .await
        );
        let replayed = captured.unwrap();
        assert!(
            !welcomed(&url, Some(&cert), |_| replayed.clone()).await,
            "replay"
        );
        // Claiming a key without holding it: signed by another key.
        let thief = Keypair::generate();
        let stolen = |c: &kvasir_wire::Challenge| {
            let mut hello =
                Hello::answer(c, &thief, Role::Worker, model.clone(), "cpu".into(), vec![]);
            hello.key = honest.address();
            hello
        };
        assert!(!welcomed(&url, Some(&cert), stolen).await, "wrong signer");
        // A backend not proven to give the CPU kernels' bits: an honest worker on it would
        // answer other bits, so it may not serve.
        let inexact = |c: &kvasir_wire::Challenge| {
            let key = Keypair::generate();
            Hello::answer(c, &key, Role::Worker, model.clone(), "metal".into(), vec![])
        };
        assert!(
            !welcomed(&url, Some(&cert), inexact).await,
            "inexact backend"
        );
        // A backbone key the hub was not configured with, on the hub's own port.
        let impostor = |c: &kvasir_wire::Challenge| {
            Hello::answer(
                c,
                &Keypair::generate(),
                Role::Backbone,
                model.clone(),
                "cpu".into(),
                vec![],
            )
        };
        assert!(
            !welcomed(&hub_url, None, impostor).await,
            "impostor backbone"
        );
    });
    // No session earned anything, so the registry lists none (the honest one did no work).
    let metered = swarm.metered();
    assert!(metered.is_empty(), "{metered:?}");
}

/// Trickles one byte at a time to `addr`; true when the server hangs up within `limit`.
fn cut_off(addr: &str, limit: Duration) -> bool {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let start = Instant::now();
    let mut byte = [0u8; 1];
    while start.elapsed() < limit {
        if stream.write_all(b"G").is_err() {
            return true;
        }
        match stream.read(&mut byte) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn slow_clients_are_cut_off() {
    let swarm = Swarm::start("tiny");
    let (hub, gateway) = (swarm.hub_addr.clone(), swarm.gateway_addr.clone());
    let hub = std::thread::spawn(move || cut_off(&hub, Duration::from_secs(30)));
    assert!(
        cut_off(&gateway, Duration::from_secs(30)),
        "gateway kept a trickling client"
    );
    assert!(hub.join().unwrap(), "hub kept a trickling client");
}

/// A wrong-sized or badly signed answer is refused by the hub, which tells the backbone at
/// once: the backbone computes those experts locally right away instead of waiting out its
/// dispatch timeout (a minute here), and its output is still the local output.
#[test]
fn a_wrong_sized_or_badly_signed_answer_falls_back_at_once() {
    const DISPATCH_TIMEOUT: Duration = Duration::from_secs(60);
    let swarm = Swarm::start("tiny");
    let local = swarm.local(PROMPT, 4);
    let model = model_id(&swarm.model).unwrap();
    let runtime = Runtime::new().unwrap();
    let hub = format!("ws://{}", swarm.hub_addr);
    // `Swarm::start` writes the backbone's key file here.
    let key = swarm.dir.path().join("backbone.key");
    let timeout_ms = DISPATCH_TIMEOUT.as_millis().to_string();
    for how in [
        Misbehaviour::TooFewValues,
        Misbehaviour::Padding,
        Misbehaviour::OtherKey,
    ] {
        let (url, cert, model) = (swarm.gateway_url(), swarm.cert(), model.clone());
        let worker = runtime.spawn(async move { bad_worker(url, &cert, model, how).await });
        let started = Instant::now();
        let out = kvasir_tests::start(
            "kvasir-node",
            &[
                "backbone",
                "--model",
                kvasir_tests::path_str(&swarm.model),
                "--hub",
                &hub,
                "--key",
                kvasir_tests::path_str(&key),
                "--dispatch-timeout-ms",
                &timeout_ms,
                "--wait-ms",
                "20000",
                "--remote",
                "0:*",
                "--prompt",
                PROMPT,
                "--tokens",
                "4",
                "--json",
            ],
        )
        .finish(Duration::from_secs(300))
        .unwrap();
        let took = started.elapsed();
        let remote: kvasir_api::generation::GenerationReport =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        let (_, dropped) = runtime.block_on(worker).unwrap();
        assert!(dropped, "{how:?}: the hub must drop the worker");
        assert_eq!(remote.token_ids, local.token_ids, "{how:?}");
        assert_eq!(remote.logits_blake3, local.logits_blake3, "{how:?}");
        let fallbacks = remote.dispatch.map_or(0, |d| d.fallbacks);
        assert!(fallbacks >= 1, "{how:?}: {remote:?}");
        assert!(
            took < DISPATCH_TIMEOUT / 3,
            "{how:?}: the backbone took {took:?}: it waited for the refused answer"
        );
    }
}
