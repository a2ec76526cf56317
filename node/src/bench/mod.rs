//! `kvasir-node bench ...`: each hot path measured next to its reference, in the same run.

mod audit;
mod consensus;
mod credit;
mod decode;
mod dispatch;
mod flood;
mod ledger;
mod market;
mod relay;
mod serve;

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum Bench {
    /// Transactions checked, applied and committed to sled, next to raw ed25519
    /// batch verification on all cores; block commit time at 10k and 1M accounts.
    Ledger(ledger::Args),
    /// Decode tokens/s next to the memory-bandwidth bound, throughput by batch size, and
    /// the expert kernel against the gemm crate.
    Decode(decode::Args),
    /// Decode with `--remote` experts on a worker behind an injected round trip (default
    /// 13 ms) at 1, 16, 64 and 256 streams, next to all-local decode: remote_vs_local, round
    /// trips exposed at one stream.
    Dispatch(dispatch::Args),
    /// Receipts of many sessions credited through the gateway's crediting into a ledger:
    /// credits per second, metered-to-pending latency.
    Credit(credit::Args),
    /// Frames through gateway + hub next to one direct TLS WebSocket (and bare TCP):
    /// throughput, round-trip p50/p99.
    Relay(relay::Args),
    /// Concurrent clients streaming completions from the OpenAI API of a backbone whose
    /// experts are all remote behind an injected round trip, next to the same load all
    /// local: aggregate and per-stream tokens/s, time to first token p50/p99.
    Serve(serve::Args),
    /// Decode with every expert remote at the default audit rate next to auditing off:
    /// audit overhead; answers until a worker lying on 1% of them is caught.
    Audit(audit::Args),
    /// apply_block with market matching at 1k offers/100 orders and 10k/1k, next to a block
    /// of plain transfers: ms per block, growth with the market.
    Market(market::Args),
    /// Transfers committed through four validators on loopback next to one: committed/s,
    /// submission-to-commit latency p50/p99.
    Consensus(consensus::Args),
    /// Funded keys flooding the ledger with minimum-fee transfers while the dev swarm
    /// generates, credits and catches a liar: crediting rounds committed, blocks evidence
    /// and tipped honest transfers wait, the flood's cost per minute.
    Flood(flood::Args),
}

pub fn run(bench: Bench) -> Result<()> {
    match bench {
        Bench::Ledger(args) => ledger::run(args),
        Bench::Decode(args) => decode::run(args),
        Bench::Dispatch(args) => dispatch::run(args),
        Bench::Relay(args) => relay::run(args),
        Bench::Serve(args) => serve::run(args),
        Bench::Credit(args) => credit::run(args),
        Bench::Audit(args) => audit::run(args),
        Bench::Consensus(args) => consensus::run(args),
        Bench::Market(args) => market::run(args),
        Bench::Flood(args) => flood::run(args),
    }
}
