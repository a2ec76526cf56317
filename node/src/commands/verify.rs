//! `kvasir-node verify-chain`: replays a stored chain with a progress bar, against the
//! genesis it is given (without one, the store's own genesis is trusted, with a warning).

use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use kvasir_api::reports::VerifyReport;
use kvasir_ledger::{verify_chain, Genesis, SledStore, Storage};

use crate::answers::evidence_check;

#[derive(clap::Args)]
pub struct Args {
    /// The ledger's data directory.
    #[arg(long)]
    data_dir: PathBuf,
    /// The chain's genesis.json: a store holding another chain is refused.
    #[arg(long)]
    genesis: Option<PathBuf>,
    /// Format-1 chains only: a checkpoint the genesis pins, to recompute the chain's evidence
    /// with; repeat it for each pinned model, all of them (a chain that holds evidence does
    /// not verify without). A format-2 chain's evidence carries its weights.
    #[arg(long = "model", value_name = "DIR")]
    models: Vec<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let trusted = args.genesis.as_deref().map(Genesis::load).transpose()?;
    let store = SledStore::open(&args.data_dir)?;
    if trusted.is_none() {
        eprintln!(
            "warning: no --genesis given, so the genesis stored in {} ({}) is trusted",
            args.data_dir.display(),
            store.genesis()?.hash()
        );
    }
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(store.head()?)
    };
    bar.set_style(
        ProgressStyle::with_template("verifying {bar:40} {pos}/{len} blocks {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // A format-1 chain's evidence is recomputed only with the checkpoints given; a format-2
    // chain's always, from the weights it carries.
    let genesis = store.genesis()?;
    let answers = if args.models.is_empty() && genesis.params.format == 1 {
        None
    } else {
        evidence_check(&genesis, &args.models)?
    };
    let report = verify_chain(&store, trusted.as_ref(), answers, |done, _| {
        bar.set_position(done)
    });
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        let json = VerifyReport {
            ok: true,
            blocks: report.blocks,
            transactions: report.transactions,
            head_hash: report.head_hash,
            state_root: report.state_root,
        };
        println!("{}", serde_json::to_string(&json)?);
    } else {
        println!(
            "chain ok: {} blocks, {} transactions, head {}, state root {}",
            report.blocks, report.transactions, report.head_hash, report.state_root
        );
    }
    Ok(())
}
