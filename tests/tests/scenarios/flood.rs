//! The fee market under a flood, with real processes: `kvasir-node bench flood` runs the dev
//! swarm while two thousand funded keys submit minimum-fee transfers as fast as the ledger
//! takes them, for a minute. Payments, evidence and honest tipped transfers must keep
//! flowing, and the flood must cost more the longer it lasts. The targets are in blocks and
//! shares, not seconds: they hold on a slow machine too.

use kvasir_api::reports::FloodReport;
use kvasir_tests::{run, stderr, stdout};

#[test]
fn a_flood_of_minimum_fee_transfers_stops_no_payment_no_evidence_and_no_tipped_transfer() {
    let out = run(
        "kvasir-node",
        &[
            "bench",
            "flood",
            "--seconds",
            "60",
            "--keys",
            "2000",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let json = text.lines().find(|l| l.starts_with('{')).expect("a report");
    let report: FloodReport = serde_json::from_str(json).unwrap();
    // The flood filled blocks: the base fee rose.
    assert!(report.flood_admitted > 10_000, "{report:?}");
    assert!(report.base_fee_peak > report.base_fee_start, "{report:?}");
    // Every crediting round committed, over at least ten.
    assert!(report.credit_rounds >= 10, "{report:?}");
    assert_eq!(report.credit_rounds_committed, 1.0, "{report:?}");
    // The liar was caught during the flood and its evidence landed within 3 blocks.
    assert!(!report.evidence_blocks.is_empty(), "{report:?}");
    assert!(report.evidence_blocks.iter().all(|&b| b <= 3), "{report:?}");
    // Every honest transfer with the suggested tip landed within 2 blocks.
    assert!(report.honest_transfer_blocks.len() >= 5, "{report:?}");
    assert!(
        report.honest_transfer_blocks.iter().all(|&b| b <= 2),
        "{report:?}"
    );
    // The flood paid more in its later windows than in its first.
    let costs = &report.attacker_cost_kvr_per_min;
    assert!(costs.len() >= 3, "{report:?}");
    assert!(costs[costs.len() - 1] > costs[0], "{report:?}");
}
