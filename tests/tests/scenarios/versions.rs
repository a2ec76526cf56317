//! Upgrades against the real hub: a worker of the previous wire protocol version (one that
//! offers no WebSocket subprotocol, writes version-3 frames and declares no arithmetic) is
//! served within the hub's `--previous-wire-until` window, its answers relayed and metered and
//! the backbone's output unchanged, and refused after it with a failure saying to upgrade; a
//! client of another reference arithmetic is refused at its hello, so it never gets work that
//! could be audited or slashed.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::moe::LocalExperts;
use kvasir_ledger::keys::Keypair;
use kvasir_tests::swarm::Swarm;
use kvasir_wire::link::{self, dial, next_frame, next_message};
use kvasir_wire::{
    answer, model_id, request_hash, AnswerScope, Hello, Message, Role, PREVIOUS_VERSION,
};
use tokio::runtime::Runtime;

const PROMPT: &str = "Once upon a time";

/// A worker of the previous wire version holding every expert of layer 0, dialing the hub at
/// `addr` directly: the hub's failure if it is refused, else it answers every request
/// correctly (counting them in `answered`) until the link ends.
async fn previous_version_worker(
    addr: String,
    model: &Path,
    answered: Arc<AtomicUsize>,
) -> Result<(), String> {
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // No subprotocol offered: a client of version 3.
    let (ws, _) = tokio_tungstenite::client_async(format!("ws://{addr}/"), tcp)
        .await
        .unwrap();
    let (tx, mut source) = link::split_as(ws, None, PREVIOUS_VERSION);
    let frame = next_frame(&mut source).await.unwrap();
    let Ok(Message::Challenge(challenge)) = Message::decode_as(&frame, PREVIOUS_VERSION) else {
        panic!("no challenge of version 3");
    };
    let config = Config::load(model).unwrap();
    let experts = LocalExperts::load(&Checkpoint::open(model).unwrap(), &config, |layer, _| {
        layer == 0
    })
    .unwrap();
    let key = Keypair::generate();
    let held = (0..config.num_experts as u16).map(|e| (0, e)).collect();
    let model_id = model_id(model).unwrap();
    let mut hello = Hello::answer(
        &challenge,
        &key,
        Role::Worker,
        model_id.clone(),
        "cpu".into(),
        held,
    );
    hello.arithmetic = None;
    hello.sign(&challenge, &key);
    tx.send(Message::Hello(hello).encode_as(PREVIOUS_VERSION).into())
        .unwrap();
    let frame = next_frame(&mut source).await.unwrap();
    let session = match Message::decode_as(&frame, PREVIOUS_VERSION) {
        Ok(Message::Welcome(welcome)) => welcome.session,
        Ok(Message::Failure(failure)) => return Err(failure.message),
        other => panic!("neither a welcome nor a failure: {other:?}"),
    };
    let scope = AnswerScope::new(&challenge, session, &model_id);
    while let Ok(frame) = next_frame(&mut source).await {
        assert_eq!(
            frame[4], PREVIOUS_VERSION,
            "every frame to it is of its version"
        );
        let Ok(Message::Request(request)) = Message::decode_as(&frame, PREVIOUS_VERSION) else {
            panic!("not a request of version 3");
        };
        let response = answer(&request, config.hidden_size, &experts).unwrap();
        // Signed over the bodies, so the same signature in either version; the writer stamps
        // the header with version 3.
        let signed = response.signed_frame(&scope, request_hash(&frame), &key);
        tx.send(signed.into()).unwrap();
        answered.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

/// The hub's failure to a hello of this version declaring `arithmetic`, or None if welcomed.
async fn refusal_of_arithmetic(url: &str, model: String, arithmetic: u32) -> Option<String> {
    let tls = kvasir_wire::tls::client(None).unwrap();
    let (tx, mut source) = dial(url, &tls).await.unwrap();
    let Ok(Message::Challenge(challenge)) = next_message(&mut source).await else {
        panic!("no challenge");
    };
    let key = Keypair::generate();
    let mut hello = Hello::answer(
        &challenge,
        &key,
        Role::Worker,
        model,
        "cpu".into(),
        vec![(0, 1)],
    );
    hello.arithmetic = Some(arithmetic);
    hello.sign(&challenge, &key);
    tx.send(Message::Hello(hello).encode().into()).unwrap();
    match next_message(&mut source).await {
        Ok(Message::Welcome(_)) => None,
        Ok(Message::Failure(failure)) => Some(failure.message),
        other => panic!("neither a welcome nor a failure: {other:?}"),
    }
}

#[test]
fn a_previous_version_worker_serves_in_the_window_and_another_arithmetic_never() {
    let mut swarm = Swarm::start_with_hub_args(
        "tiny",
        false,
        &["--previous-wire-until", "2999-01-01T00:00:00Z"],
    );
    let local = swarm.local(PROMPT, 4);
    let model = model_id(&swarm.model).unwrap();
    let hub_url = format!("ws://{}", swarm.hub_addr);
    let runtime = Runtime::new().unwrap();

    // Another arithmetic, either side of this one: refused at the hello, saying why.
    let current = kvasir_inference::ARITHMETIC_VERSION;
    for other in [current + 1, 0] {
        let why = runtime
            .block_on(refusal_of_arithmetic(&hub_url, model.clone(), other))
            .expect("refused");
        assert!(why.contains("arithmetic version"), "{why}");
    }
    assert_eq!(
        runtime.block_on(refusal_of_arithmetic(&hub_url, model.clone(), current)),
        None
    );

    // Version 3 within the window: served, identical output, every request answered remotely.
    let answered = Arc::new(AtomicUsize::new(0));
    let (addr, dir, count) = (
        swarm.hub_addr.clone(),
        swarm.model.clone(),
        answered.clone(),
    );
    let worker = runtime.spawn(async move { previous_version_worker(addr, &dir, count).await });
    let remote = swarm.backbone("0:*", PROMPT, 4);
    assert_eq!(remote.token_ids, local.token_ids);
    assert_eq!(remote.logits_blake3, local.logits_blake3);
    assert_eq!(remote.dispatch.map(|d| d.fallbacks), Some(0), "{remote:?}");
    assert!(answered.load(Ordering::SeqCst) > 0);
    let metered = swarm.metered();
    assert!(
        metered.iter().any(|(_, _, bytes)| *bytes > 0),
        "its answers are metered: {metered:?}"
    );
    worker.abort();

    // Past the window: refused at its hello, in its own version, saying to upgrade.
    swarm.hub_extra = vec![
        "--previous-wire-until".into(),
        "2020-01-01T00:00:00Z".into(),
    ];
    swarm.kill_and_restart_hub();
    let (addr, dir) = (swarm.hub_addr.clone(), swarm.model.clone());
    let refused = runtime.block_on(async move {
        previous_version_worker(addr, &dir, Arc::new(AtomicUsize::new(0))).await
    });
    let why = refused.expect_err("refused after the window");
    assert!(why.contains("upgrade kvasir-node"), "{why}");
}
