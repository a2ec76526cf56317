//! Keepalive over real processes on loopback: the hub pings every link and drops a worker
//! session that has gone silent (it reads nothing, so it answers no ping) within its idle
//! timeout, while an honest idle worker and the backbone, which answer the pings, stay
//! attached past it and still serve a generation; and a worker whose hub goes silent redials.

use std::time::{Duration, Instant};

use kvasir_api::generation::{GenerateRequest, GenerationReport};
use kvasir_ledger::Keypair;
use kvasir_tests::path_str;
use kvasir_tests::swarm::{
    assert_all_remote_and_identical, claimless_session, http, new_key, Swarm,
};
use kvasir_wire::link::{self, next_frame, next_message};
use kvasir_wire::tls;
use kvasir_wire::{Challenge, Message, Welcome};
use tokio::runtime::Runtime;

const PROMPT: &str = "Once upon a time";
const IDLE: Duration = Duration::from_millis(1000);
const IDLE_MS: &str = "1000";
const PING_MS: &str = "200";

#[test]
fn a_silent_session_is_dropped_while_an_idle_worker_and_the_backbone_stay() {
    let hub_args = ["--ping-interval-ms", PING_MS, "--idle-timeout-ms", IDLE_MS];
    let mut swarm = Swarm::start_with_hub_args("tiny", false, &hub_args);
    let worker = swarm.add_worker_with("*:*", &["--idle-timeout-ms", IDLE_MS]);
    let (_backbone, backbone_addr) = swarm.serve_backbone("*:*");

    // A session that completes the handshake and then neither reads nor writes.
    let runtime = Runtime::new().unwrap();
    let client_tls = tls::client(Some(&swarm.cert())).unwrap();
    let (_tx, mut silent, _) = runtime
        .block_on(claimless_session(
            &swarm.gateway_url(),
            &client_tls,
            &kvasir_ledger::Keypair::generate(),
        ))
        .expect("the silent session is welcomed");
    std::thread::sleep(IDLE * 3);

    // The hub has given up on it: what it sent (pings, then the close) ends at once.
    let dropped = runtime.block_on(async {
        let ended = async { while next_frame(&mut silent).await.is_ok() {} };
        tokio::time::timeout(Duration::from_secs(2), ended)
            .await
            .is_ok()
    });
    let hub = swarm.hub.as_ref().expect("a hub").stderr();
    assert!(dropped, "the hub kept a silent session\n{hub}");
    assert!(hub.contains("nothing arrived"), "{hub}");

    // The honest worker and the backbone answered every ping: neither was dropped nor
    // redialled, and a generation goes through them with nothing computed locally.
    let ask = serde_json::to_string(&GenerateRequest {
        prompt: PROMPT.into(),
        tokens: 4,
    })
    .unwrap();
    let (status, body) = http(&backbone_addr, "POST", "/generate", &ask);
    assert_eq!(status, 200, "{body}");
    let remote: GenerationReport = serde_json::from_str(&body).unwrap();
    assert_all_remote_and_identical(&remote, &swarm.local(PROMPT, 4));
    let hub = swarm.hub.as_ref().expect("a hub").stderr();
    assert_eq!(hub.matches("worker attached").count(), 2, "{hub}");
    assert_eq!(hub.matches("backbone attached").count(), 1, "{hub}");
    let worker = swarm.workers[worker].stderr();
    assert!(
        !worker.contains("link "),
        "the worker lost its link: {worker}"
    );
}

/// A stand-in hub welcomes the worker and then goes silent (it reads nothing, so it answers no
/// ping and sends none): the worker takes it for dead after its idle timeout and redials.
#[test]
fn a_worker_redials_a_hub_that_goes_silent() {
    let dir = tempfile::tempdir().unwrap();
    let model = kvasir_tests::model("tiny");
    let key = dir.path().join("worker.key");
    new_key(&key);
    let runtime = Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("ws://{}/swarm", listener.local_addr().unwrap());
    let mut worker = kvasir_tests::start(
        "kvasir-node",
        &[
            "worker",
            "--gateway",
            &url,
            "--keyfile",
            path_str(&key),
            "--model",
            path_str(&model),
            "--experts",
            "0:0",
            "--idle-timeout-ms",
            IDLE_MS,
        ],
    );
    let hub = Keypair::generate();
    let redialled_after = runtime.block_on(async {
        let mut held = Vec::new();
        let mut welcomed = None;
        for session in 0..2 {
            let (tcp, _) = tokio::time::timeout(Duration::from_secs(60), listener.accept())
                .await
                .unwrap_or_else(|_| panic!("no dial {session}\n{}", worker.stderr()))
                .unwrap();
            let (ws, _) = link::accept(tcp).await.unwrap();
            let (tx, mut source) = link::split(ws, None);
            let challenge = Challenge {
                nonce: [7; 32],
                hub: hub.address(),
                chain_id: "kvasir-test".into(),
            };
            tx.send(Message::Challenge(challenge).encode().into())
                .unwrap();
            let Ok(Message::Hello(_)) = next_message(&mut source).await else {
                panic!("no hello");
            };
            tx.send(Message::Welcome(Welcome::new(session, "")).encode().into())
                .unwrap();
            welcomed.get_or_insert_with(Instant::now);
            // Held open, never read again.
            held.push((tx, source));
        }
        welcomed.map(|at| at.elapsed())
    });
    let redialled_after = redialled_after.expect("welcomed");
    assert!(
        redialled_after >= IDLE,
        "redialled after {redialled_after:?}"
    );
    worker
        .line_within("worker session 0 open", Duration::from_secs(5))
        .unwrap();
    worker
        .line_within("worker session 1 open", Duration::from_secs(5))
        .unwrap();
    assert!(
        worker.stderr().contains("nothing arrived"),
        "{}",
        worker.stderr()
    );
}
