//! `kvasir-node`: one binary, one subcommand per role.

// No unsafe code in the production build; the `bench-reference` build allows it in its one
// call into the `gemm` crate (`bench::decode`).
#![cfg_attr(not(feature = "bench-reference"), forbid(unsafe_code))]
#![cfg_attr(feature = "bench-reference", deny(unsafe_code))]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvasir_node::commands::{genesis, model, verify};
use kvasir_node::{backbone, dev, gateway, hub, ledger, worker};

// Benches live in the binary, not the library every test links: they reach the roles through
// the library's public API. Their arithmetic is tested in kvasir-devnet (`measure`).
mod bench;

#[derive(Parser)]
#[command(
    name = "kvasir-node",
    version,
    about = "Serve a Mixture-of-Experts model from the hardware that shows up, and get paid in KVR."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the demo on loopback: a fresh dev chain, a metered session credited to a worker's
    /// wallet, settlement, and a full re-verification.
    Dev(dev::Args),
    /// Create a chain.
    #[command(subcommand)]
    Genesis(GenesisCommand),
    /// Synthetic checkpoints in the Hugging Face format.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Generate text with a checkpoint, every expert local.
    Generate(model::GenerateArgs),
    /// Replay a stored chain from genesis, checking every signature, hash link, tx root and
    /// state root.
    VerifyChain(verify::Args),
    /// The ledger service: produces blocks and serves the REST API.
    Ledger(ledger::Args),
    /// Serve experts: one outbound wss:// link to the gateway, no listening socket.
    Worker(worker::Args),
    /// The public TLS port: worker upgrades spliced raw to the hub, the REST API otherwise.
    Gateway(gateway::Args),
    /// LAN-only relay between backbone and workers; meters and signs receipts.
    Hub(hub::Args),
    /// Generate with experts dispatched to workers through the hub.
    Backbone(backbone::Args),
    /// Measure a hot path next to its reference.
    #[command(subcommand)]
    Bench(bench::Bench),
}

#[derive(Subcommand)]
enum GenesisCommand {
    /// Write a fresh chain: genesis.json and newly generated keys (mode 0600) under keys/.
    Init {
        /// Directory to write into; created if absent.
        #[arg(long)]
        out: PathBuf,
        /// Chain parameters (default: the built-in genesis/template.json).
        #[arg(long)]
        template: Option<PathBuf>,
        /// The chain's name, [a-z0-9-] (default: the template's `chain_id`, a dash and eight
        /// random hex digits). The published dev chain's, kvasir-dev, is refused. Signatures
        /// commit to the name and the genesis hash, so no other chain takes them.
        #[arg(long)]
        chain_id: Option<String>,
        /// Pin this checkpoint directory or GGUF file in genesis (repeatable): evidence of
        /// wrong answers carries the disputed expert's weights as stored, which validators
        /// check against the pin and recompute with.
        #[arg(long)]
        model: Vec<PathBuf>,
        /// Seal the key files under a passphrase (KVASIR_PASSPHRASE, or typed twice).
        #[arg(long)]
        encrypt: bool,
        /// Validators in the chain's set, one vote each (keys/validator.key, then
        /// keys/validator-1.key, ...); 4 tolerate one failing.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=kvasir_devnet::chain::MAX_VALIDATORS as i64))]
        validators: u16,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Our own logs at info; the consensus engine's only when it warns (at info it narrates every
/// step of every round), its network's only on errors (it warns of every connection a
/// stopping peer closes).
// The engine's network layer logs every gossip it could not publish as an error, once a
// second per channel when no peer listens: always so for a lone validator, and during any
// partition, which consensus itself reports. `RUST_LOG=arc_malachitebft_network=error` shows it.
const DEFAULT_LOG: &str = "info,arc_malachitebft_core_consensus=warn,arc_malachitebft_engine=warn,\
arc_malachitebft_network=off,arc_malachitebft_discovery=error,arc_malachitebft_sync=warn,\
arc_malachitebft_wal=warn,libp2p_swarm=warn,libp2p_gossipsub=error,ractor=warn";

fn main() -> ExitCode {
    kvasir_devnet::process::follow_parent();
    let cli = Cli::parse();
    // Logs go to stderr (stdout is for results); RUST_LOG overrides the level.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG)),
        )
        .init();
    let result = match cli.command {
        Command::Dev(args) => dev::run(args),
        Command::Genesis(GenesisCommand::Init {
            out,
            template,
            chain_id,
            model,
            encrypt,
            validators,
            json,
        }) => genesis::init_command(
            &out,
            template.as_deref(),
            chain_id.as_deref(),
            &model,
            encrypt,
            validators.into(),
            json,
        ),
        Command::Model(command) => model::run(command),
        Command::Generate(args) => model::generate_command(args),
        Command::VerifyChain(args) => verify::run(args),
        Command::Bench(bench) => bench::run(bench),
        Command::Ledger(args) => ledger::run(args),
        Command::Worker(args) => worker::run(args),
        Command::Gateway(args) => gateway::run(args),
        Command::Hub(args) => hub::run(args),
        Command::Backbone(args) => backbone::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
