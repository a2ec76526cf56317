//! `kvasir-node dev`: the newcomer's first command. The whole swarm on loopback as separate
//! processes (ledger, hub, TLS gateway, N workers, backbone): it generates with every expert
//! on the workers, checks the output against an all-local run bit for bit, waits for the
//! gateway to credit each worker's metered bytes on the ledger, shows each worker's wallet
//! balance, and re-verifies the chain. A second run reuses the data dir (chain, model, keys).
//!
//! The room: `launch` starts roles as child processes of this binary (also used by the swarm
//! benchmarks) and stops them. It may touch every role, through its command line only.

pub mod launch;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvasir_api::generation::GenerationReport;
use kvasir_api::reports::{DevReport, DevWorker, MeteredSession};
use kvasir_api::Client;
use kvasir_inference::config::Config;
use kvasir_inference::generate::Sampling;
use kvasir_inference::synth::{preset, synthesize};
use kvasir_ledger::{verify_chain, Genesis, SledStore};

use crate::commands::genesis::{genesis_path, install_dev_chain};
use crate::engine::{load_local, run_generation, Backend};
use launch::{Child, Loopback};

#[derive(clap::Args)]
pub struct Args {
    /// Where the chain, its keys, the model and the workers' wallets live; reused by later runs.
    #[arg(long, default_value = "kvasir-data")]
    data_dir: PathBuf,
    /// Workers to start; the experts are split between them.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Keep the swarm running afterwards (Ctrl-C stops it).
    #[arg(long)]
    serve: bool,
    /// The synthetic checkpoint to serve.
    #[arg(long, default_value = "small")]
    preset: String,
    /// Where the workers run their experts: cpu, or cuda (needs a build with `--features
    /// cuda`); the output is still checked bit for bit against an all-local CPU run.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Also print one JSON object with the figures (for scripts and tests).
    #[arg(long)]
    json: bool,
}

fn text(path: &Path) -> String {
    path.display().to_string()
}

/// The checkpoint in `dir`, synthesized on first use.
fn ensure_model(dir: &Path, name: &str) -> Result<()> {
    if dir.join("config.json").exists() {
        return Ok(());
    }
    let preset = preset(name)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("synthesizing the model {bar:40} {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    synthesize(dir, preset, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    Ok(())
}

/// `*:a-b` for worker `i` of `n`: contiguous, near-equal expert ranges.
fn share(i: usize, n: usize, experts: usize) -> String {
    let (start, end) = (i * experts / n, (i + 1) * experts / n);
    format!("*:{}-{}", start, end.max(start + 1) - 1)
}

pub fn run(args: Args) -> Result<()> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let dir = &args.data_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let genesis = if genesis_path(dir).exists() {
        Genesis::load(&genesis_path(dir))?
    } else {
        install_dev_chain(dir)?
    };
    let model_dir = dir.join(format!("model-{}", args.preset));
    ensure_model(&model_dir, &args.preset)?;
    let config = Config::load(&model_dir)?;
    if args.workers > config.num_experts {
        bail!(
            "--workers {} is more than the model's {} experts",
            args.workers,
            config.num_experts
        );
    }
    println!(
        "Kvasir dev swarm: chain {} (genesis {}), model {} in {}",
        genesis.params.chain_id,
        genesis.hash(),
        args.preset,
        dir.display()
    );

    let run_dir = dir.join("swarm");
    let mut swarm = Loopback::start(&run_dir, dir, true)?;
    let ledger_url = format!(
        "http://{}",
        swarm.ledger_addr.context("the ledger did not start")?
    );
    println!(
        "ledger http://{}, hub {} (registry http://{}), gateway wss://localhost:{}",
        swarm.ledger_addr.map(|a| a.to_string()).unwrap_or_default(),
        swarm.hub_addr,
        swarm.registry_addr,
        swarm.gateway_addr.port()
    );
    let url = Loopback::swarm_url(swarm.gateway_addr.port());
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let keyfile = dir.join("keys").join(format!("worker-{}.key", i + 1));
        let experts = share(i, args.workers, config.num_experts);
        let address = swarm.add_worker(&model_dir, &experts, &url, &keyfile, args.backend)?;
        println!("worker {}: {address} holds experts {experts}", i + 1);
        workers.push((address, keyfile));
    }

    let backbone_key = run_dir.join("backbone.key");
    if backbone_key.exists() {
        std::fs::remove_file(&backbone_key)?;
    }
    kvasir_keyfile::write(&backbone_key, &swarm.backbone, None)?;
    let tokens = args.tokens.to_string();
    let mut backbone = Child::spawn(
        &[
            "backbone",
            "--model",
            &text(&model_dir),
            "--hub",
            &format!("ws://{}", swarm.hub_addr),
            "--key",
            &text(&backbone_key),
            "--remote",
            "*:*",
            "--prompt",
            &args.prompt,
            "--tokens",
            &tokens,
            "--json",
        ]
        .map(String::from),
    )?;
    let remote: GenerationReport =
        serde_json::from_str(&backbone.line("{").map(|rest| format!("{{{rest}"))?)
            .context("the backbone's report is not a generation report")?;
    let (model, experts, tokenizer) = load_local(&model_dir)?;
    let local = run_generation(
        &model,
        &tokenizer,
        &experts,
        &args.prompt,
        args.tokens,
        Sampling::GREEDY,
    )?;
    println!("{}{}", args.prompt, remote.text);
    let same = remote
        .token_ids
        .iter()
        .zip(&local.token_ids)
        .filter(|(r, l)| r == l)
        .count();
    let logits_same = remote.logits_blake3 == local.logits_blake3;
    let dispatch = remote.dispatch.unwrap_or_default();
    println!(
        "remote vs local: {same}/{} tokens identical, logits {} ({} remote requests, {} fell back)",
        local.token_ids.len(),
        if logits_same { "identical" } else { "DIFFER" },
        dispatch.remote_requests,
        dispatch.fallbacks
    );
    if same != local.token_ids.len()
        || remote.token_ids.len() != local.token_ids.len()
        || !logits_same
    {
        bail!("remote output differs from local output");
    }
    dispatch.all_remote().map_err(anyhow::Error::msg)?;

    // Every session's bytes, credited: wait until the ledger's marks reach the registry's counts.
    let registry = Client::new(&format!("http://{}", swarm.registry_addr));
    let ledger = Client::new(&ledger_url);
    let listing = registry.all_receipts()?;
    let sessions: Vec<MeteredSession> = listing
        .receipts
        .iter()
        .map(|r| MeteredSession {
            session_id: r.session_id,
            worker: r.worker,
            cumulative_bytes: r.cumulative_bytes,
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for session in &sessions {
        while ledger
            .session(&listing.hub, session.session_id)?
            .cumulative_bytes
            < session.cumulative_bytes
        {
            swarm.check()?;
            if Instant::now() > deadline {
                bail!(
                    "session {} was not credited within two minutes",
                    session.session_id
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let mut report = Vec::new();
    for (i, (address, keyfile)) in workers.iter().enumerate() {
        let relayed: u64 = sessions
            .iter()
            .filter(|s| s.worker == *address)
            .map(|s| s.cumulative_bytes)
            .sum();
        let account = ledger.account(address)?;
        println!(
            "worker {}: {relayed} bytes relayed (all its sessions)",
            i + 1
        );
        println!("  kvasir-wallet balance: {}", account.summary());
        report.push(DevWorker {
            address: *address,
            keyfile: keyfile.clone(),
            relayed_bytes: relayed,
            account,
        });
    }
    if let Some((_, keyfile)) = workers.first() {
        println!(
            "query a balance yourself (while `dev --serve` runs), through the gateway: cargo run --release -p kvasir-wallet -- balance --keyfile {} --url https://localhost:{} --ca {}",
            keyfile.display(),
            swarm.gateway_addr.port(),
            swarm.cert.display()
        );
    }
    if args.json {
        let json = DevReport {
            tokens_identical: same,
            logits_identical: logits_same,
            remote_requests: dispatch.remote_requests,
            fallbacks: dispatch.fallbacks,
            sessions,
            workers: report,
            ledger: ledger_url,
        };
        println!("{}", serde_json::to_string(&json)?);
    }
    if args.serve {
        println!("the swarm is running; Ctrl-C stops it");
        crate::shutdown::wait_unless(|| swarm.check())?;
        println!("stopping the swarm");
    }
    drop(backbone);
    swarm.stop();
    let store = SledStore::open(&dir.join("ledger"))?;
    let verified = verify_chain(&store, Some(&genesis), None, |_, _| {})?;
    println!(
        "chain re-verified from genesis: {} blocks, {} transactions, state root {}",
        verified.blocks, verified.transactions, verified.state_root
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn expert_shares_cover_every_expert_once() {
        assert_eq!(share(0, 2, 32), "*:0-15");
        assert_eq!(share(1, 2, 32), "*:16-31");
        assert_eq!(share(2, 3, 8), "*:5-7");
        assert_eq!(share(0, 1, 8), "*:0-7");
    }
}
