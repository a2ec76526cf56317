//! The public edge under load, over real processes on loopback: a gateway held to 1024 open
//! files takes 2,000 idle TCP connections, 500 TLS handshakes that stall after their first
//! bytes and 200 worker sessions that authenticate and then go silent, while two honest
//! workers serve a generation. The gateway and the hub stay up, the generation is the local
//! one bit for bit, the honest workers are credited exactly, and both processes' resident
//! memory stays bounded (printed, for the record).

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvasir_api::Client;
use kvasir_ledger::Genesis;
use kvasir_tests::swarm::{
    alive, assert_all_remote_and_identical, claimless_session, new_key, resident_kib, Swarm,
};
use kvasir_wire::tls;

const PROMPT: &str = "Once upon a time";
const IDLE_TCP: usize = 2_000;
const STALLED_TLS: usize = 500;
const SILENT_SESSIONS: usize = 200;
/// A bound far above what either process needs; a leak per connection would cross it.
const MAX_RESIDENT_KIB: u64 = 512 << 10;

fn memory(swarm: &Swarm) -> (u64, u64) {
    let hub = swarm.hub.as_ref().expect("a hub").pid();
    (resident_kib(swarm.gateway.pid()), resident_kib(hub))
}

#[test]
fn a_flood_of_idle_stalled_and_silent_connections_changes_nothing_for_honest_work() {
    let mut swarm = Swarm::start_with("tiny", true);
    // The per-address cap would stop a loopback flood early; lift it so the flood reaches the
    // file limit, the harder case.
    swarm.restart_gateway_limited(1024, &["--max-connections-per-ip", "100000"]);
    swarm.add_worker("*:0-3");
    swarm.add_worker("*:4-7");
    let local = swarm.local(PROMPT, 16);
    let before = memory(&swarm);

    // 200 sessions that complete TLS, the WebSocket upgrade and a signed hello, then say
    // nothing more (and claim nothing, so the backbone never waits on them). One bonded key
    // opens them all: the hub admits only bonded keys, and does not cap sessions per key.
    let silent_key = swarm.dir.path().join("silent.key");
    new_key(&silent_key);
    swarm.bond(swarm.ledger_url.as_deref().unwrap(), &silent_key);
    let silent_key = kvasir_keyfile::open(&silent_key).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let client_tls = tls::client(Some(&swarm.cert())).unwrap();
    let url = swarm.gateway_url();
    let silent = runtime.block_on(async {
        let mut held = Vec::new();
        for _ in 0..SILENT_SESSIONS {
            held.extend(claimless_session(&url, &client_tls, &silent_key).await);
        }
        held
    });
    assert_eq!(silent.len(), SILENT_SESSIONS, "silent sessions admitted");

    // TLS handshakes that send the first bytes of a ClientHello and stall.
    let gateway = swarm.gateway_addr.clone();
    let dial = |n: usize, first: &[u8]| -> Vec<TcpStream> {
        (0..n)
            .filter_map(|_| {
                let addr = gateway.parse().ok()?;
                let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
                stream.write_all(first).ok()?;
                Some(stream)
            })
            .collect()
    };
    let stalled = dial(STALLED_TLS, b"\x16\x03\x01\x02\x00\x01");
    let idle = dial(IDLE_TCP, b"");
    eprintln!(
        "held: {} silent sessions, {} stalled handshakes, {} idle connections",
        silent.len(),
        stalled.len(),
        idle.len()
    );
    assert!(
        stalled.len() + idle.len() > 1024,
        "the flood must pass the file limit"
    );

    // Honest work meanwhile: the generation goes through the workers' spliced links.
    let remote = swarm.backbone("*:*", PROMPT, 16);
    assert_all_remote_and_identical(&remote, &local);
    let during = memory(&swarm);
    assert!(
        alive(swarm.gateway.pid()),
        "the gateway died under the flood"
    );

    // The flood ends; the honest workers' bytes are credited exactly.
    drop((idle, stalled, silent));
    let ledger = Client::new(&swarm.ledger_url.clone().unwrap());
    let hub = kvasir_keyfile::address(&swarm.dir.path().join("chain/keys/hub.key")).unwrap();
    let genesis = Genesis::load(&swarm.dir.path().join("chain/genesis.json")).unwrap();
    let sessions = swarm.metered();
    assert_eq!(
        sessions.len(),
        2,
        "only the honest sessions metered: {sessions:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    for (session, _, bytes) in &sessions {
        while ledger.session(&hub, *session, 0).unwrap().cumulative_bytes != *bytes {
            assert!(Instant::now() < deadline, "session {session} not credited");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for (_, worker, bytes) in &sessions {
        let address = worker.parse().unwrap();
        let account = ledger.account(&address).unwrap();
        let paid =
            account.balance.base_units.base_units() + account.pending_total.base_units.base_units();
        let earned = genesis.earned(*bytes).unwrap().base_units();
        assert_eq!(
            paid,
            kvasir_tests::pay::expected_held(&ledger, &genesis, &address, earned),
            "{worker}"
        );
    }
    // And the gateway serves a newcomer again.
    let url = format!(
        "https://localhost:{}",
        swarm.gateway_addr.rsplit(':').next().unwrap_or_default()
    );
    let public = Client::with_ca(&url, Some(&swarm.cert())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while public.head().is_err() {
        assert!(
            Instant::now() < deadline,
            "the gateway does not serve again"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The gateway's own metrics saw it all: the splices (the honest two and the silent 200),
    // bytes both ways, the credits, and a crediting round not long ago.
    let metrics = public.metrics().unwrap();
    let value = |name: &str| -> u64 {
        let line = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")));
        line.and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {metrics}"))
    };
    assert!(value("kvasir_gateway_swarm_connections_total") >= 202);
    assert!(value("kvasir_gateway_spliced_bytes_total{direction=\"to_hub\"}") > 0);
    assert!(value("kvasir_gateway_spliced_bytes_total{direction=\"to_worker\"}") > 0);
    assert!(value("kvasir_gateway_credits_admitted_total") >= 2);
    assert!(value("kvasir_gateway_crediting_lag_seconds") < 60);
    let after = memory(&swarm);
    eprintln!(
        "resident KiB (gateway, hub): before {before:?}, under the flood {during:?}, after {after:?}"
    );
    for (what, kib) in [("gateway", during.0), ("hub", during.1)] {
        assert!(
            kib < MAX_RESIDENT_KIB,
            "{what} holds {kib} KiB under the flood"
        );
    }
}
