//! `kvasir-node bench audit`: what auditing costs and how fast it catches a liar, the way
//! the backbone really runs. Decode with every expert on a worker behind the hub and the
//! TLS gateway, at the default audit rate, next to the same decode with auditing off, on the
//! same link, alternating so that the machine's drift hits both alike: `audit_overhead` is
//! the extra wall time as a fraction (target <= 0.03). Then a worker lying on 1% of its
//! answers is served alone and decoded from until the audits catch it: the answers it gave
//! until then (one draw of a geometric variable), next to the expected `1/(rate*fraction)`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::LocalExperts;
use kvasir_inference::synth::{preset, synthesize};

use super::decode::decode_rate;
use kvasir_devnet::Loopback;
use kvasir_node::backbone::dispatch::{Auditor, RemoteExperts};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (default: the `small` preset, synthesized into a temp dir).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The audit rate measured (the backbone's default).
    #[arg(long, default_value_t = 0.02)]
    audit_rate: f64,
    /// The fraction of answers the lying worker gets wrong.
    #[arg(long, default_value_t = 0.01)]
    lie_fraction: f64,
    /// Decode steps per timed run; each rate is timed `--rounds` times, alternating.
    #[arg(long, default_value_t = 128)]
    steps: usize,
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

/// Answers the liar may give before the run gives up on catching it: 20 times the expected.
const CATCH_LIMIT_FACTOR: f64 = 20.0;

/// A loopback swarm whose one worker holds every expert (lying on `lie` of its answers),
/// and the backbone's executor over it, auditing with `auditor`.
fn swarm_with_worker(
    dir: &std::path::Path,
    model_dir: &std::path::Path,
    config: &Config,
    lie: Option<f64>,
    auditor: Auditor,
) -> Result<(Loopback, RemoteExperts, tokio::runtime::Runtime)> {
    let mut swarm = Loopback::on_dev_chain(dir)?;
    let extra: Vec<String> = match lie {
        Some(fraction) => ["--dishonest-fraction", &fraction.to_string()]
            .map(String::from)
            .to_vec(),
        None => Vec::new(),
    };
    let url = Loopback::swarm_url(swarm.gateway_addr.port());
    let keyfile = dir.join("worker.key");
    swarm.add_worker(model_dir, "*:*", &url, &keyfile, "cpu", &extra)?;
    let checkpoint = Checkpoint::open(model_dir)?;
    let fallback = LocalExperts::load(&checkpoint, config, |_, _| true)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let remote = RemoteExperts::attach(
        &runtime,
        &format!("ws://{}", swarm.hub_addr),
        swarm.backbone.clone(),
        0,
        model_dir,
        fallback,
        "*:*".parse().map_err(anyhow::Error::msg)?,
        Duration::from_secs(30),
    )?
    .with_auditor(auditor);
    if !remote.wait_until_covered(config, Duration::from_secs(60)) {
        bail!("the worker never attached");
    }
    Ok((swarm, remote, runtime))
}

pub fn run(args: Args) -> Result<()> {
    if !(0.0..=1.0).contains(&args.audit_rate) || !(0.0..=1.0).contains(&args.lie_fraction) {
        bail!("--audit-rate and --lie-fraction are fractions from 0 to 1");
    }
    let scratch = tempfile::tempdir()?;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = scratch.path().join("small");
            synthesize(&dir, preset("small")?, |_, _| {})?;
            dir
        }
    };
    let config = Config::load(&model_dir)?;
    let model = Model::load(&Checkpoint::open(&model_dir)?, config.clone())?;

    // Overhead: one honest worker, the rate switched between runs on the same link.
    let honest_dir = scratch.path().join("honest");
    let (mut honest_swarm, honest, runtime) = swarm_with_worker(
        &honest_dir,
        &model_dir,
        &config,
        None,
        Auditor::new(0.0, 0, None),
    )?;
    decode_rate(&model, &honest, 1, 4)?; // warm-up: weights paged in, link open
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        // ABBA: whichever runs second in a round has an edge (a warmer cache, a settled
        // clock), and it goes to each rate in turn.
        let first_on = round % 2 == 1;
        for on_now in [first_on, !first_on] {
            let (rate, rates) = if on_now {
                (args.audit_rate, &mut on)
            } else {
                (0.0, &mut off)
            };
            honest.auditor().set_rate(rate);
            rates.push(decode_rate(&model, &honest, 1, args.steps).context("decoding")?);
        }
    }
    honest
        .stats()
        .all_remote()
        .map_err(|why| anyhow::anyhow!("{why}: not a measurement of remote dispatch"))?;
    let audit = honest.audit_report();
    if audit.mismatches > 0 {
        bail!("an honest worker's answer differed from the recomputation: {audit:?}");
    }
    let best = |rates: &[f64]| rates.iter().copied().fold(0.0, f64::max);
    let (off_tok_s, on_tok_s) = (best(&off), best(&on));
    let overhead = off_tok_s / on_tok_s - 1.0;
    drop(honest);
    // Its link task would redial the stopped hub for the rest of the run.
    runtime.shutdown_background();
    honest_swarm.stop();

    // Catching: a lone worker lying on `lie_fraction` of answers, audited at the rate.
    let liar_dir = scratch.path().join("liar");
    let (mut liar_swarm, liar, _liar_runtime) = swarm_with_worker(
        &liar_dir,
        &model_dir,
        &config,
        Some(args.lie_fraction),
        Auditor::new(args.audit_rate, 0, None),
    )?;
    let expected = 1.0 / (args.audit_rate * args.lie_fraction);
    let limit = (expected * CATCH_LIMIT_FACTOR) as u64;
    while liar.audit_report().mismatches == 0 {
        if liar.stats().remote_requests > limit {
            bail!("the liar was not caught within {limit} answers");
        }
        decode_rate(&model, &liar, 1, 64).context("decoding from the liar")?;
    }
    // Answers the liar gave up to and including the one caught.
    let caught_after = liar.audit_report().caught[0].answer_number;
    liar_swarm.stop();

    if args.json {
        let value = serde_json::json!({
            "model": model_dir,
            "audit_rate": args.audit_rate,
            "off_tok_s": off_tok_s,
            "on_tok_s": on_tok_s,
            "audit_overhead": overhead,
            "audits": audit.audits,
            "lie_fraction": args.lie_fraction,
            "answers_until_caught": caught_after,
            "expected_answers_until_caught": expected,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench audit: {}, every expert on one worker through hub and gateway ({} threads)",
        model_dir.display(),
        rayon::current_num_threads()
    );
    println!(
        "decode, batch 1: audits off {off_tok_s:.2} tok/s, at rate {} {on_tok_s:.2} tok/s ({} answers audited)",
        args.audit_rate, audit.audits
    );
    println!("audit_overhead {overhead:.4}  (extra wall time as a fraction; target <= 0.03)");
    println!(
        "a worker lying on {} of answers: caught after {caught_after} answers (one draw), expected 1/(rate x fraction) = {expected:.0}",
        args.lie_fraction
    );
    Ok(())
}
