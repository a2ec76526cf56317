//! `kvasir-node dev`: the newcomer's first command. The whole swarm on loopback as separate
//! processes (ledger, hub, TLS gateway, N workers, backbone): it bonds each worker's key from
//! the faucet (the dev chain asks a bond), generates with every expert on the workers while
//! the backbone audits their answers, checks the output against an all-local run bit for
//! bit, waits for the gateway to credit each worker's metered bytes on the ledger, shows what
//! the audits caught (with `--dishonest N`, the last N workers sign wrong answers and are
//! convicted on chain) and each worker's wallet balance, and re-verifies the chain. A second
//! run reuses the data dir (chain, model, keys, bonds).
//!
//! The room: it starts roles as child processes of this binary through `kvasir_devnet` (as
//! the swarm benchmarks and the scenarios do) and stops them. It may touch every role, through
//! its command line only.

mod market;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvasir_api::generation::{AuditReport, GenerationReport};
use kvasir_api::reports::{DevCaught, DevReport, DevSwarm, DevWorker, MeteredSession};
use kvasir_api::Client;
use kvasir_inference::config::Config;
use kvasir_inference::generate::Sampling;
use kvasir_inference::synth::{preset, synthesize};
use kvasir_ledger::fraction::Fraction;
use kvasir_ledger::{verify_chain, Address, Amount, Genesis, Keypair, SledStore};

use crate::answers::evidence_check;
use crate::engine::{load_local, model_pin, run_generation, Backend};
use kvasir_devnet::chain::{
    genesis_path, init_sealed, install_dev_chain, key_path, load_template, MAX_VALIDATORS,
};
use kvasir_devnet::funding::{bond_workers, top_up};
use kvasir_devnet::loopback::ledger_dir;
use kvasir_devnet::{current_exe, Loopback, Mode, Process};
use kvasir_wire::model_id;

#[derive(clap::Args)]
pub struct Args {
    /// Where the chain, its keys, the model and the workers' wallets live; reused by later runs.
    #[arg(long, default_value = "kvasir-data")]
    data_dir: PathBuf,
    /// Workers to start; the experts are split between them.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Validators to run the chain with, each a ledger process, agreeing through consensus.
    /// One runs the published dev chain; more make a chain of their own in --data-dir on
    /// first use (with that many validator keys), and a later run must ask the same number.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=MAX_VALIDATORS as i64))]
    validators: u16,
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
    /// Serve this model instead of a preset: a GGUF file as llama.cpp's tools write it (the
    /// first file of a split one), or a checkpoint directory. Dev links it into the data dir
    /// (`models/`), and a data dir without a chain gets a chain of its own that pins it.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["preset", "quantized"])]
    model: Option<PathBuf>,
    /// Serve the preset quantized, as the GGUF file `model quantize` writes of it (q8_0 or
    /// q4_0). The published dev chain pins no quantized model, so a data dir
    /// without a chain gets a chain of its own that pins it too.
    #[arg(long = "quantize", value_name = "TYPE")]
    quantized: Option<kvasir_inference::gguf::write::Preset>,
    /// Where the workers run their experts: cpu, or cuda (needs a build with `--features
    /// cuda`); the output is still checked bit for bit against an all-local CPU run.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// The fraction of remote answers the backbone recomputes and compares bit for bit
    /// (besides every answer of a worker still on probation).
    #[arg(long, default_value = "0.02", value_parser = Fraction::parse)]
    audit_rate: Fraction,
    /// The last N workers lie: they sign wrong answers (all zeros), to see them caught,
    /// slashed and jailed while the output stays identical.
    #[arg(long, default_value_t = 0)]
    dishonest: usize,
    /// The fraction of its answers a `--dishonest` worker gets wrong.
    #[arg(long, default_value = "1", value_parser = Fraction::parse)]
    dishonest_fraction: Fraction,
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

/// What the backbone's key holds to report evidence: the dev chain's deposit of 1 KVR, which
/// true evidence keeps, and the fees of hundreds of pieces at its reserved-lane price.
const REPORTER_FUNDS_KVR: &str = "5";

/// The presets the dev chain pins (`genesis/dev`), the ones dev can serve.
const DEV_CHAIN_PRESETS: [&str; 4] = ["tiny", "tiny-qwen2", "small", "qwen35-small"];

/// The GGUF file `--quantize` serves of preset `name`, under `dir`: `model quantize`'s
/// output, written on first use (the same bytes every time, so its pin is too).
fn ensure_quantized(
    dir: &Path,
    name: &str,
    preset: kvasir_inference::gguf::write::Preset,
) -> Result<PathBuf> {
    let checkpoint = dir.join(format!("model-{name}"));
    ensure_model(&checkpoint, name)?;
    let file = quantized_path(dir, name, preset);
    if !file.exists() {
        println!("quantizing the {name} preset as {}", file.display());
        kvasir_inference::gguf::write::quantize(&checkpoint, &file, preset)
            .with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(file)
}

/// Where `ensure_quantized` writes preset `name` quantized as `preset`.
fn quantized_path(
    dir: &Path,
    name: &str,
    preset: kvasir_inference::gguf::write::Preset,
) -> PathBuf {
    dir.join(format!(
        "model-{name}-{}.gguf",
        format!("{preset:?}").to_lowercase()
    ))
}

/// The quantized models dev has written under `dir` (`ensure_quantized`), and the models
/// `--model` linked there (`link_model`).
fn added_models(dir: &Path) -> Result<Vec<PathBuf>> {
    use kvasir_inference::gguf::write::Preset;
    let mut models: Vec<PathBuf> = DEV_CHAIN_PRESETS
        .iter()
        .flat_map(|name| [Preset::Q8_0, Preset::Q4_0].map(|p| quantized_path(dir, name, p)))
        .filter(|file| file.exists())
        .collect();
    let linked = dir.join(LINKED);
    if linked.exists() {
        let mut entries = Vec::new();
        for entry in
            std::fs::read_dir(&linked).with_context(|| format!("reading {}", linked.display()))?
        {
            let path = entry?.path();
            // A split model is opened by its first file.
            if !is_later_part(&path.file_name().unwrap_or_default().to_string_lossy()) {
                entries.push(path);
            }
        }
        entries.sort();
        models.extend(entries);
    }
    Ok(models)
}

/// Whether `name` is a split GGUF model's part other than the first, as `llama-gguf-split`
/// names them: `NAME-0000N-of-0000M.gguf` with N above 1.
fn is_later_part(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".gguf") else {
        return false;
    };
    let tail = stem.len().checked_sub(15).and_then(|at| stem.get(at..));
    let Some(tail) = tail else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    match (
        tail.get(..1),
        tail.get(1..6),
        tail.get(6..10),
        tail.get(10..),
    ) {
        (Some("-"), Some(no), Some("-of-"), Some(count)) => {
            digits(no) && digits(count) && no != "00001"
        }
        _ => false,
    }
}

/// Where `--model`'s models are linked, in the data dir.
const LINKED: &str = "models";

/// `model` linked into the data dir (`LINKED`) under its own name, so that later runs and the
/// chain dev makes for it find it: every file of a GGUF model (each part of a split one), or
/// the checkpoint directory. The link, as the model's path from now on.
fn link_model(dir: &Path, model: &Path) -> Result<PathBuf> {
    let files = if kvasir_inference::gguf::is_gguf(model) {
        kvasir_inference::gguf::split::paths(model)?
    } else if model.join("config.json").exists() {
        vec![model.to_path_buf()]
    } else {
        bail!(
            "--model {}: neither a GGUF file nor a checkpoint directory (with a config.json)",
            model.display()
        );
    };
    let linked = dir.join(LINKED);
    std::fs::create_dir_all(&linked).with_context(|| format!("creating {}", linked.display()))?;
    let mut links = Vec::with_capacity(files.len());
    for file in &files {
        let target = file
            .canonicalize()
            .with_context(|| format!("finding {}", file.display()))?;
        // The name as given (a split model's parts are found by it), or the target's for `.`.
        let name = file.file_name().or(target.file_name());
        let link = linked.join(name.context("a model file has a name")?);
        links.push(link.clone());
        match std::fs::read_link(&link) {
            Ok(held) if held == target => continue,
            Ok(held) => bail!(
                "{} already links {}, another model of the same name: use another --data-dir",
                link.display(),
                held.display()
            ),
            Err(_) => std::os::unix::fs::symlink(&target, &link)
                .with_context(|| format!("linking {} to {}", link.display(), target.display()))?,
        }
    }
    Ok(links.swap_remove(0))
}

/// The checkpoint of each model `genesis` pins, under `dir`, synthesized on first use. Dev
/// synthesizes only the dev chain's presets (and quantizes them), so a chain pinning anything
/// else is refused.
fn pinned_models(dir: &Path, genesis: &Genesis) -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    let mut found = Vec::new();
    let mut candidates = Vec::new();
    for name in DEV_CHAIN_PRESETS {
        let model_dir = dir.join(format!("model-{name}"));
        ensure_model(&model_dir, name)?;
        candidates.push(model_dir);
    }
    let presets = candidates.len();
    candidates.extend(added_models(dir)?);
    for (i, model_dir) in candidates.into_iter().enumerate() {
        let id = match model_id(&model_dir) {
            Ok(id) => id,
            // A linked model moved or removed since: the chain may not need it.
            Err(e) if i >= presets => {
                eprintln!("warning: {} is left out: {e:#}", model_dir.display());
                continue;
            }
            Err(e) => return Err(e),
        };
        if genesis.model(&id).is_some() {
            dirs.push(model_dir);
            found.push(id);
        }
    }
    if let Some(other) = genesis.models.iter().find(|m| !found.contains(&m.id)) {
        bail!(
            "this chain pins model {}, which is none of the presets dev synthesizes ({}) nor of the models --quantize wrote or --model linked in this data dir",
            other.id,
            DEV_CHAIN_PRESETS.join(", ")
        );
    }
    Ok(dirs)
}

/// The experts `a..=b` of worker `i` of `n`: contiguous, near-equal ranges.
fn share(i: usize, n: usize, experts: usize) -> (usize, usize) {
    let (start, end) = (i * experts / n, (i + 1) * experts / n);
    (start, end.max(start + 1) - 1)
}

pub fn run(args: Args) -> Result<()> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if args.dishonest > args.workers {
        bail!(
            "--dishonest {} is more than the {} workers",
            args.dishonest,
            args.workers
        );
    }
    let dir = &args.data_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let validators = usize::from(args.validators);
    let model_dir = match (&args.model, args.quantized) {
        (Some(model), _) => link_model(dir, model)?,
        (None, None) => {
            let model_dir = dir.join(format!("model-{}", args.preset));
            ensure_model(&model_dir, &args.preset)?;
            model_dir
        }
        (None, Some(preset)) => ensure_quantized(dir, &args.preset, preset)?,
    };
    let genesis = if genesis_path(dir).exists() {
        Genesis::load(&genesis_path(dir))?
    } else if validators == 1 && args.quantized.is_none() && args.model.is_none() {
        install_dev_chain(dir)?
    } else {
        new_dev_chain(dir, validators)?
    };
    let has = genesis.authorities.validators.len();
    if has != validators {
        bail!(
            "the chain in {} has {has} validators, not {validators}: run with --validators {has}, or another --data-dir",
            dir.display()
        );
    }
    // The ledger judges evidence with every model the chain pins, as any validator must.
    let pinned_dirs = pinned_models(dir, &genesis)?;
    if !pinned_dirs.contains(&model_dir) {
        bail!(
            "the chain in {} (genesis {}) does not pin {}, so evidence against its workers could not be judged: serve one it pins ({}), or start afresh with another --data-dir",
            dir.display(),
            genesis.hash(),
            model_dir.display(),
            genesis
                .models
                .iter()
                .map(|m| if m.name.is_empty() { &m.id } else { &m.name }.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let config = Config::load(&model_dir)?;
    if args.workers > config.num_experts {
        bail!(
            "--workers {} is more than the model's {} experts",
            args.workers,
            config.num_experts
        );
    }
    let serving = match (&args.model, args.quantized) {
        (Some(model), _) => model.display().to_string(),
        (None, None) => args.preset.clone(),
        (None, Some(q)) => format!("{} quantized as {q:?}", args.preset),
    };
    println!(
        "Kvasir dev swarm: chain {} (genesis {}), model {serving} in {}",
        genesis.params.chain_id,
        genesis.hash(),
        dir.display()
    );

    let run_dir = dir.join("swarm");
    // Validators of a format-2 chain judge evidence from the weights it carries; those of a
    // format-1 chain, with the pinned checkpoints.
    let judged_with = if genesis.params.format == 1 {
        pinned_dirs.clone()
    } else {
        Vec::new()
    };
    let mut swarm = Loopback::start(&current_exe()?, &run_dir, dir, Some(&judged_with))?;
    let ledger_url = swarm.ledger_url().context("the ledger did not start")?;
    println!(
        "ledger {ledger_url} ({validators} validator{}), hub {} (registry http://{}), gateway wss://localhost:{}",
        if validators == 1 { "" } else { "s" },
        swarm.hub_addr,
        swarm.registry_addr,
        swarm.gateway_addr.port()
    );
    let ledger = Client::new(&ledger_url);
    let keys = worker_keys(&ledger, dir, args.workers)?;
    let faucet = kvasir_keyfile::open(&key_path(dir, "faucet"))?;
    let bonded = bond_workers(
        &ledger,
        &faucet,
        &keys.iter().map(|(_, k)| k).collect::<Vec<_>>(),
    )?;
    // The backbone reports the evidence its audits find, paying each one's fee.
    let reporter_funds = Amount::parse(REPORTER_FUNDS_KVR)?;
    top_up(&ledger, &faucet, swarm.backbone.address(), reporter_funds)
        .context("funding the backbone's key for the evidence it reports")?;
    let min_bond = ledger.params()?.min_bond.base_units;
    let url = Loopback::swarm_url(swarm.gateway_addr.port());
    let lie = [
        "--dishonest-fraction".to_string(),
        args.dishonest_fraction.to_string(),
        "--dishonest-kind".to_string(),
        "zeros".to_string(),
    ];
    let ranges: Vec<(usize, usize)> = (0..args.workers)
        .map(|i| share(i, args.workers, config.num_experts))
        .collect();
    let offers: Vec<(&Keypair, (usize, usize))> = keys
        .iter()
        .map(|(_, k)| k)
        .zip(ranges.iter().copied())
        .collect();
    let mut placed = market::place(
        &ledger_url,
        dir,
        &faucet,
        &offers,
        &config,
        &model_id(&model_dir)?,
        swarm.backbone.address(),
    )?;
    println!(
        "market: the buyer's order {} for every expert is placed on the workers' offers; the backbone acts for it",
        placed.order
    );
    let mut workers = Vec::new();
    for (i, ((keyfile, _), bonded_now)) in keys.into_iter().zip(bonded).enumerate() {
        let (first, last) = ranges[i];
        let experts = format!("*:{first}-{last}");
        let dishonest = i >= args.workers - args.dishonest;
        let extra: &[String] = if dishonest { &lie } else { &[] };
        let address = swarm.add_worker(
            &model_dir,
            &experts,
            &url,
            &keyfile,
            args.backend.name(),
            extra,
        )?;
        let bond = if min_bond.is_zero() {
            String::new()
        } else if bonded_now.is_zero() {
            ", bonded in an earlier run".to_string()
        } else {
            format!(", bonded {bonded_now} from the faucet")
        };
        let lies = match (dishonest, args.dishonest_fraction) {
            (false, _) => String::new(),
            (true, Fraction::ONE) => ", DISHONEST: signs an all-zero answer every time".into(),
            (true, fraction) => {
                format!(
                    ", DISHONEST: signs an all-zero answer on a fraction {fraction} of its answers"
                )
            }
        };
        println!(
            "worker {}: {address} holds experts {experts}{bond}{lies}",
            i + 1
        );
        workers.push((address, keyfile));
    }

    let backbone_key = run_dir.join("backbone.key");
    if backbone_key.exists() {
        std::fs::remove_file(&backbone_key)?;
    }
    kvasir_keyfile::write(&backbone_key, &swarm.backbone, None)?;
    let tokens = args.tokens.to_string();
    let order = placed.order.to_string();
    let mut backbone = Process::start(
        &current_exe()?,
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
            "--ledger",
            &ledger_url,
            "--order",
            &order,
            "--audit-rate",
            &args.audit_rate.to_string(),
            "--prompt",
            &args.prompt,
            "--tokens",
            &tokens,
            "--json",
        ],
        Mode::Product,
    )?;
    let remote: GenerationReport =
        serde_json::from_str(&backbone.line("{").map(|rest| format!("{{{rest}"))?)
            .context("the backbone's report is not a generation report")?;
    // Nothing more is asked of the workers once the backbone has gone, so the counts the
    // registry settles on are what the ledger credits.
    backbone
        .finish(Duration::from_secs(60))
        .context("the backbone did not exit after its report")?;
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
    let audit = remote.audit.unwrap_or_default();
    let caught = convictions(&ledger, &audit, &workers)?;

    // Every session's bytes, credited: wait until the ledger's marks reach the registry's counts,
    // read once they hold still (the hub meters an answer it relays as it arrives).
    let registry = Client::new(&format!("http://{}", swarm.registry_addr));
    let mut listing = registry.all_receipts()?;
    let still_by = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        swarm.check()?;
        let again = registry.all_receipts()?;
        if again.receipts == listing.receipts {
            break;
        }
        if Instant::now() > still_by {
            bail!("the hub kept metering for 30 s after the backbone exited");
        }
        listing = again;
    }
    let sessions: Vec<MeteredSession> = listing
        .receipts
        .iter()
        .map(|r| MeteredSession {
            session_id: r.session_id,
            order: r.order,
            worker: r.worker,
            cumulative_bytes: r.cumulative_bytes,
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for session in &sessions {
        while ledger
            .session(&listing.hub, session.session_id, session.order)?
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
        let from_escrow = account
            .pending
            .iter()
            .filter(|p| p.order == Some(placed.order))
            .try_fold(kvasir_ledger::Amount::ZERO, |sum, p| {
                sum.checked_add(p.amount.base_units)
            })
            .context("pending pay overflows")?;
        println!(
            "  pending pay from order {}'s escrow: {from_escrow}",
            placed.order
        );
        report.push(DevWorker {
            address: *address,
            keyfile: keyfile.clone(),
            relayed_bytes: relayed,
            account,
        });
    }
    let market = market::report(&ledger, &placed)?;
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
            audits: audit.audits,
            mismatches: audit.mismatches,
            caught,
            market,
            swarm: Some(DevSwarm {
                hub: swarm.hub_addr.to_string(),
                registry: swarm.registry_addr.to_string(),
                gateway: swarm.gateway_addr.to_string(),
                ca: swarm.cert.clone(),
                chain: dir.to_path_buf(),
                model: model_dir.clone(),
                backbone_key: backbone_key.clone(),
            }),
        };
        println!("{}", serde_json::to_string(&json)?);
    }
    if args.serve {
        println!("the swarm is running; Ctrl-C stops it");
        crate::shutdown::wait_unless(|| swarm.check())?;
        println!("stopping the swarm");
    }
    market::close(&ledger, &mut placed)?;
    swarm.stop();
    // Evidence in the chain is recomputed as the ledger judged it.
    let answers = evidence_check(&genesis, &judged_with)?;
    for index in 0..validators {
        let store = SledStore::open(&ledger_dir(dir, index))?;
        let verified = verify_chain(&store, Some(&genesis), answers.clone(), |_, _| {})?;
        let whose = if validators == 1 {
            String::new()
        } else {
            format!(" (validator {})", index + 1)
        };
        println!(
            "chain re-verified from genesis{whose}: {} blocks, {} transactions, every certificate checked, state root {}",
            verified.blocks, verified.transactions, verified.state_root
        );
    }
    Ok(())
}

/// A fresh chain for `validators` validators in `dir`: the dev chain's parameters and pinned
/// presets, and the quantized presets written in `dir` (`--quantize`) and the models linked
/// there (`--model`), with new keys (the published dev chain has one validator and pins only
/// its presets).
fn new_dev_chain(dir: &Path, validators: usize) -> Result<Genesis> {
    let mut pins = Vec::new();
    for name in DEV_CHAIN_PRESETS {
        let model_dir = dir.join(format!("model-{name}"));
        ensure_model(&model_dir, name)?;
        pins.push(model_pin(&model_dir)?);
    }
    for file in added_models(dir)? {
        match model_pin(&file) {
            Ok(pin) => pins.push(pin),
            // As in `pinned_models`: a linked model moved away since is left out.
            Err(e) => eprintln!("warning: {} is left out: {e:#}", file.display()),
        }
    }
    let mut template = load_template(None)?;
    template.params.chain_id = format!("kvasir-dev-{validators}v");
    init_sealed(dir, &template, None, pins, validators)
}

/// The key of each of `n` workers, from `DIR/keys/worker-N.key`, created on first use. A key
/// still jailed (caught by a `--dishonest` run) could not serve: its file is kept aside, as
/// it still holds the rest of its bond, and the worker gets a fresh key.
fn worker_keys(ledger: &Client, dir: &Path, n: usize) -> Result<Vec<(PathBuf, Keypair)>> {
    let mut keys = Vec::with_capacity(n);
    for i in 1..=n {
        let keyfile = dir.join("keys").join(format!("worker-{i}.key"));
        if keyfile.exists() {
            let key = kvasir_keyfile::open(&keyfile)?;
            let account = ledger.account(&key.address())?;
            if !account.jailed {
                keys.push((keyfile, key));
                continue;
            }
            let aside = dir
                .join("keys")
                .join(format!("worker-{i}.jailed-{}.key", key.address()));
            std::fs::rename(&keyfile, &aside)
                .with_context(|| format!("moving {} to {}", keyfile.display(), aside.display()))?;
            println!(
                "worker {i}: its key {} is jailed until height {} (caught lying in an earlier run); kept as {}, a fresh key replaces it",
                key.address(),
                account.jailed_until,
                aside.display()
            );
        }
        let key = Keypair::generate();
        kvasir_keyfile::write(&keyfile, &key, None)?;
        keys.push((keyfile, key));
    }
    Ok(keys)
}

/// Prints what the backbone's audits found and, for each worker caught, what the ledger did
/// about it, read from the worker's conviction in that session. The backbone's report waited for each
/// Evidence transaction to be committed, so a catch without a conviction is an error.
fn convictions(
    ledger: &Client,
    audit: &AuditReport,
    workers: &[(Address, PathBuf)],
) -> Result<Vec<DevCaught>> {
    println!(
        "audits: {} answers recomputed, {} wrong",
        audit.audits, audit.mismatches
    );
    let mut caught = Vec::with_capacity(audit.caught.len());
    for catch in &audit.caught {
        let which = workers
            .iter()
            .position(|(address, _)| *address == catch.worker)
            .map_or(String::new(), |i| format!(" (worker {})", i + 1));
        if catch.committed_height.is_none() {
            bail!(
                "the evidence against {}{which} was not committed: {}",
                catch.worker,
                catch.error.as_deref().unwrap_or("no reason given")
            );
        }
        let conviction = ledger
            .account(&catch.worker)?
            .convictions
            .into_iter()
            .find(|c| c.session.hub == catch.hub && c.session.session_id == catch.session_id)
            .with_context(|| {
                format!(
                    "the evidence against session {} was committed but the ledger holds no conviction of it",
                    catch.session_id
                )
            })?;
        println!(
            "caught: {}{which} answered request {} of session {} wrongly: {} pending cancelled, {} of its bond slashed ({} to the backbone, which reported it, the rest burned), jailed until height {}",
            catch.worker,
            conviction.request_id,
            catch.session_id,
            conviction.cancelled.kvr,
            conviction.slashed.kvr,
            conviction.reporter_paid.kvr,
            conviction.jailed_until
        );
        caught.push(DevCaught {
            address: catch.worker,
            session_id: catch.session_id,
            request_id: conviction.request_id,
            cancelled: conviction.cancelled,
            slashed: conviction.slashed,
            jailed_until: conviction.jailed_until,
        });
    }
    Ok(caught)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model_pin;
    use kvasir_devnet::chain::DEV_GENESIS;

    #[test]
    fn the_dev_chain_pins_exactly_its_presets_and_dev_refuses_a_chain_pinning_another() {
        let scratch = tempfile::tempdir().unwrap();
        let mut genesis = Genesis::from_json(DEV_GENESIS).unwrap();
        // A linked model since moved away is left out, not an error.
        std::fs::create_dir(scratch.path().join(LINKED)).unwrap();
        let gone = scratch.path().join("gone.gguf");
        std::os::unix::fs::symlink(&gone, scratch.path().join(LINKED).join("gone.gguf")).unwrap();
        let dirs = pinned_models(scratch.path(), &genesis).unwrap();
        let pins: Vec<_> = dirs.iter().map(|d| model_pin(d).unwrap()).collect();
        assert_eq!(pins, genesis.models);
        genesis.models[0].id = "another".into();
        let refused = pinned_models(scratch.path(), &genesis).unwrap_err();
        assert!(refused.to_string().contains("another"), "{refused}");
    }

    /// `--model` on a split file links every part; the data dir's models then list it once,
    /// by its first file, which opens as the original does. Linking it again changes nothing,
    /// another model of the same name is refused, and a path that is no model is an error.
    #[test]
    fn a_split_model_is_linked_part_by_part_and_found_by_its_first_file() {
        let scratch = tempfile::tempdir().unwrap();
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../inference/tests/data/gguf");
        let name = "tiny-qwen3moe-q8_0-00001-of-00003.gguf";
        let first = fixtures.join(name);
        let linked = link_model(scratch.path(), &first).unwrap();
        assert_eq!(linked, scratch.path().join(LINKED).join(name));
        let links = std::fs::read_dir(scratch.path().join(LINKED)).unwrap();
        assert_eq!(links.count(), 3);
        assert_eq!(added_models(scratch.path()).unwrap(), vec![linked.clone()]);
        assert_eq!(model_id(&linked).unwrap(), model_id(&first).unwrap());
        assert_eq!(link_model(scratch.path(), &first).unwrap(), linked);

        let elsewhere = tempfile::tempdir().unwrap();
        let namesake = elsewhere.path().join(name);
        std::fs::copy(fixtures.join("tiny-qwen3moe-q8_0.gguf"), &namesake).unwrap();
        let refused = link_model(scratch.path(), &namesake).unwrap_err();
        assert!(refused.to_string().contains("already links"), "{refused}");
        let refused = link_model(scratch.path(), &fixtures).unwrap_err();
        assert!(
            refused.to_string().contains("neither a GGUF file"),
            "{refused}"
        );
    }

    #[test]
    fn later_parts_of_a_split_model_are_told_by_their_names() {
        assert!(is_later_part("model-00002-of-00003.gguf"));
        assert!(!is_later_part("model-00001-of-00003.gguf"));
        assert!(!is_later_part("best-of-breed.gguf"));
        assert!(!is_later_part("model-0002-of-00003.gguf"));
        assert!(!is_later_part("-00002-of-0000x.gguf"));
        assert!(!is_later_part("model-00002-of-00003"));
        // Names that are not ASCII, cut inside a character, do not panic.
        assert!(is_later_part("é-00002-of-00003.gguf"));
        assert!(!is_later_part("ab-0000é-of-00003.gguf"));
        assert!(!is_later_part("é0002-of-00003.gguf"));
    }

    #[test]
    fn expert_shares_cover_every_expert_once() {
        assert_eq!(share(0, 2, 32), (0, 15));
        assert_eq!(share(1, 2, 32), (16, 31));
        assert_eq!(share(2, 3, 8), (5, 7));
        assert_eq!(share(0, 1, 8), (0, 7));
    }
}
