//! `kvasir-node`: one binary, one subcommand per role.

mod bench;
mod dev;
mod genesis;
mod model;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dev(args) => dev::run(args),
        Command::Genesis(GenesisCommand::Init {
            out,
            template,
            json,
        }) => genesis::load_template(template.as_deref())
            .and_then(|t| genesis::init(&out, &t))
            .map(|g| {
                if json {
                    let value = serde_json::json!({
                        "chain_id": g.params.chain_id,
                        "genesis_hash": g.hash().to_string(),
                        "genesis": genesis::genesis_path(&out),
                        "keys": genesis::ROLES.map(|r| genesis::key_path(&out, r)),
                    });
                    println!("{value}");
                } else {
                    println!("chain {} genesis {}", g.params.chain_id, g.hash());
                    println!("wrote {}", genesis::genesis_path(&out).display());
                    for role in genesis::ROLES {
                        println!(
                            "wrote {} (mode 0600)",
                            genesis::key_path(&out, role).display()
                        );
                    }
                }
            }),
        Command::Model(command) => model::synth(command),
        Command::Generate(args) => model::generate_command(args),
        Command::VerifyChain(args) => verify::run(args),
        Command::Bench(bench) => bench::run(bench),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
