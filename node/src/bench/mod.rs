//! `kvasir-node bench ...`: each hot path measured next to its reference, in the same run.

mod decode;
mod ledger;

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum Bench {
    /// Transactions checked, applied and committed to sled, next to raw ed25519
    /// batch verification on all cores; block commit time at 10k and 1M accounts.
    Ledger(ledger::Args),
    /// Decode tokens/s next to the memory-bandwidth bound, throughput by batch size, and
    /// the expert kernel against the gemm crate.
    Decode(decode::Args),
}

pub fn run(bench: Bench) -> Result<()> {
    match bench {
        Bench::Ledger(args) => ledger::run(args),
        Bench::Decode(args) => decode::run(args),
    }
}
