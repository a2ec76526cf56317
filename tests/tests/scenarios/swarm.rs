//! Remote experts over real processes and sockets on loopback: backbone -> hub -> gateway
//! (TLS, raw splice) -> worker and back. Remote output must equal local output bit for bit,
//! whatever happens to workers and the hub mid-generation.

use std::time::{Duration, Instant};

use kvasir_api::generation::{DispatchCounts, GenerateRequest, GenerationReport};
use kvasir_api::{Client, ErrorBody};
use kvasir_tests::swarm::{http, listening_sockets, Swarm};

const PROMPT: &str = "The capital of France is";

fn assert_same_output(remote: &GenerationReport, local: &GenerationReport) {
    assert_eq!(remote.token_ids, local.token_ids, "token streams differ");
    assert_eq!(
        remote.logits_blake3, local.logits_blake3,
        "final logits differ"
    );
}

/// The backbone's dispatch counts, which its report must carry.
fn dispatch(report: &GenerationReport) -> DispatchCounts {
    report
        .dispatch
        .expect("the backbone reports its dispatch counts")
}

#[test]
fn layer0_experts_remote_give_the_local_tokens_and_logits_bit_for_bit() {
    let mut swarm = Swarm::start("tiny");
    let worker = swarm.add_worker("0:*");
    let remote = swarm.backbone("0:*", PROMPT, 32);
    let local = swarm.local(PROMPT, 32);
    assert_same_output(&remote, &local);
    assert_eq!(remote.token_ids.len(), 32);
    // One request per layer-0 step: everything went over the network, nothing fell back.
    assert_eq!(dispatch(&remote).remote_requests, 32);
    assert_eq!(dispatch(&remote).fallbacks, 0);
    // The worker dialled out and listens on nothing; the hub does listen (the check works).
    assert_eq!(listening_sockets(swarm.workers[worker].pid()), 0);
    assert!(listening_sockets(swarm.hub.as_ref().unwrap().pid()) >= 2);
    let metered = swarm.metered();
    assert_eq!(metered.len(), 1);
    assert!(
        metered[0].2 > 0,
        "the worker's traffic is metered: {metered:?}"
    );
}

#[test]
fn every_moe_layer_across_three_overlapping_workers_gives_the_local_output() {
    let mut swarm = Swarm::start("tiny");
    for experts in ["*:0-3", "*:2-5", "*:4-7"] {
        swarm.add_worker(experts);
    }
    let remote = swarm.backbone("*:*", PROMPT, 32);
    assert_same_output(&remote, &swarm.local(PROMPT, 32));
    assert_eq!(dispatch(&remote).fallbacks, 0);
    assert!(dispatch(&remote).remote_requests >= 64, "{remote:?}");
    let metered = swarm.metered();
    assert_eq!(metered.len(), 3);
    assert!(
        metered.iter().all(|(_, _, bytes)| *bytes > 0),
        "{metered:?}"
    );
}

/// Polls the registry until some session has metered traffic (the generation is under way).
fn wait_for_traffic(swarm: &Swarm) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let total: u64 = swarm.metered().iter().map(|(_, _, b)| b).sum();
        if total > 0 {
            return total;
        }
        assert!(Instant::now() < deadline, "no traffic metered");
        std::thread::sleep(Duration::from_millis(10));
    }
}

const LONG: usize = 400;

#[test]
fn a_worker_killed_mid_generation_changes_nothing_and_hangs_nothing() {
    let mut swarm = Swarm::start("tiny");
    let worker = swarm.add_worker("0:*");
    let backbone = swarm.start_backbone("0:*", PROMPT, LONG);
    wait_for_traffic(&swarm);
    swarm.workers[worker].kill();
    let out = backbone.finish(Duration::from_secs(300)).unwrap();
    let remote: GenerationReport = serde_json::from_str(&out).unwrap();
    assert_same_output(&remote, &swarm.local(PROMPT, LONG));
    let sent = dispatch(&remote).remote_requests;
    assert!(
        sent > 0 && sent < LONG as u64,
        "the kill must land mid-generation: {sent} remote requests of {LONG} steps"
    );
}

#[test]
fn a_hub_restart_mid_generation_loses_no_count_and_dispatch_resumes() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("0:*");
    let backbone = swarm.start_backbone("0:*", PROMPT, LONG);
    wait_for_traffic(&swarm);
    let before = swarm.metered();
    if let Some(mut hub) = swarm.hub.take() {
        hub.kill();
    }
    swarm.restart_hub();
    let out = backbone.finish(Duration::from_secs(300)).unwrap();
    let first: GenerationReport = serde_json::from_str(&out).unwrap();
    assert_same_output(&first, &swarm.local(PROMPT, LONG));
    // Counts served before the kill survived it.
    let after = swarm.metered();
    for (session, worker, bytes) in &before {
        let kept = after
            .iter()
            .find(|(s, _, _)| s == session)
            .expect("session kept");
        assert_eq!(&kept.1, worker);
        assert!(kept.2 >= *bytes, "session {session}: {} < {bytes}", kept.2);
    }
    // The worker reconnects as a new session, and a new generation dispatches to it again.
    swarm.workers[0]
        .line_within("worker session ", Duration::from_secs(60))
        .unwrap();
    let second = swarm.backbone("0:*", PROMPT, 16);
    assert_same_output(&second, &swarm.local(PROMPT, 16));
    assert_eq!(dispatch(&second).remote_requests, 16);
    let last = swarm.metered();
    assert!(last.len() > before.len(), "{last:?}");
    let newest = last.iter().max_by_key(|(s, _, _)| *s).unwrap();
    assert!(newest.2 > 0 && before.iter().all(|(s, _, _)| *s < newest.0));
}

#[test]
fn the_registry_lists_only_the_sessions_that_rose_since_a_mark() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:0-3");
    swarm.add_worker("*:4-7");
    swarm.backbone("*:*", PROMPT, 4);
    let registry = Client::new(&format!("http://{}", swarm.registry_addr));
    let all = registry.receipts(0, 1000).unwrap();
    assert_eq!(all.receipts.len(), 2, "{all:?}");
    // In the order they changed, not by id.
    let mut since_start = registry.receipts_since(0, 1000).unwrap();
    since_start.receipts.sort_by_key(|r| r.session_id);
    assert_eq!(since_start.receipts, all.receipts);
    assert_eq!(since_start.mark, all.mark);
    // Nothing ran since: nothing is listed, the mark stays.
    let mark = all.mark.unwrap();
    let quiet = registry.receipts_since(mark, 1000).unwrap();
    assert!(
        quiet.receipts.is_empty() && quiet.mark == all.mark,
        "{quiet:?}"
    );
    // Only experts 4-7 go remote now: only their worker's session rose.
    swarm.backbone("*:4-7", PROMPT, 4);
    let rose = registry.receipts_since(mark, 1000).unwrap();
    assert_eq!(rose.receipts.len(), 1, "{rose:?}");
    let before = all
        .receipts
        .iter()
        .find(|r| r.session_id == rose.receipts[0].session_id);
    assert!(rose.receipts[0].cumulative_bytes > before.unwrap().cumulative_bytes);
    assert!(rose.receipts[0].signed_receipt().is_ok());
    assert!(rose.mark > all.mark, "{:?} {:?}", rose.mark, all.mark);
    // With `since`, `after` filters by id.
    let ids: Vec<u64> = all.receipts.iter().map(|r| r.session_id).collect();
    let (lowest, highest) = (ids[0], ids[1]);
    let body = http(
        &swarm.registry_addr,
        "GET",
        &format!("/receipts?since=0&after={lowest}"),
        "",
    )
    .1;
    let filtered: kvasir_api::registry::ReceiptListing = serde_json::from_str(&body).unwrap();
    let listed: Vec<u64> = filtered.receipts.iter().map(|r| r.session_id).collect();
    assert_eq!(listed, vec![highest]);
}

#[test]
fn the_backbone_http_endpoint_generates_remotely_and_refuses_bad_bodies() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone("*:*");
    let request = GenerateRequest {
        prompt: PROMPT.into(),
        tokens: 8,
    };
    let body = serde_json::to_string(&request).unwrap();
    let (status, reply) = http(&addr, "POST", "/generate", &body);
    assert_eq!(status, 200, "{reply}");
    let remote: GenerationReport = serde_json::from_str(&reply).unwrap();
    assert_same_output(&remote, &swarm.local(PROMPT, 8));
    assert!(dispatch(&remote).remote_requests > 0);
    for (bad, expected) in [
        ("{not json", 400),
        (r#"{"tokens": 3}"#, 422),
        (r#"{"prompt": "", "tokens": 3}"#, 422),
        (r#"{"prompt": "x", "tokens": 100000}"#, 422),
        // A struct's array form, which serde's derive alone would take.
        (r#"["x", 3]"#, 422),
    ] {
        let (status, reply) = http(&addr, "POST", "/generate", bad);
        assert_eq!(status, expected, "{bad}: {reply}");
        let error: Result<ErrorBody, _> = serde_json::from_str(&reply);
        assert!(error.is_ok(), "not an error body: {reply}");
    }
    let oversized = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(100_000));
    assert_eq!(http(&addr, "POST", "/generate", &oversized).0, 413);
    // Still serving after all that.
    assert_eq!(http(&addr, "POST", "/generate", &body).0, 200);
    // Its metrics count what went remote and how long the round trips took.
    let (status, metrics) = http(&addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("# HELP kvasir_backbone_fallbacks_total "),
        "{metrics}"
    );
    let round_trips = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvasir_backbone_dispatch_round_trip_seconds_count "))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(round_trips.is_some_and(|n| n > 0), "{metrics}");
}
