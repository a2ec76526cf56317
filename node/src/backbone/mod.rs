//! `kvasir-node backbone`: runs attention, norms and the router, and dispatches the experts
//! named by `--remote` to the workers that hold them; it generates once or serves HTTP. Two
//! subsystems meet here, in `run`, through the `Engine` they share:
//! - `dispatch`: the network executor, the hub link, worker choice, audits, placements;
//! - `serve`: the HTTP endpoints, the OpenAI-compatible API, chat templates and the shared
//!   decode batch.
//!
//! It may touch the engine, the wire protocol and its hub link; of the ledger, only its API:
//! to read workers' bonds and submit evidence.

pub mod dispatch;
mod serve;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result};
use kvasir_api::generation::GenerationReport;
use kvasir_inference::generate::Sampling;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::tokenizer::Tokenizer;

use crate::bonds::BondCheck;
use crate::engine::{load_local, run_generation, SamplingArgs};
use crate::listen::Limits;
use dispatch::{Auditor, Placements, RemoteExperts, Reporting};
use kvasir_wire::model_id;
use kvasir_wire::spec::ExpertSpec;
use serve::{batcher, chat};

/// `--micro-batches` when experts are remote and it is not given.
const DEFAULT_REMOTE_MICRO_BATCHES: u16 = 4;
/// `--max-batch` when experts are remote and it is not given, and when none are.
const DEFAULT_REMOTE_MAX_BATCH: usize = 256;
const DEFAULT_LOCAL_MAX_BATCH: usize = 64;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (every expert is loaded too, as the fallback).
    #[arg(long)]
    model: PathBuf,
    /// The hub's listener, e.g. ws://127.0.0.1:7101.
    #[arg(long, default_value = "ws://127.0.0.1:7101")]
    hub: String,
    /// The backbone's key file (the hub is configured with its address).
    #[arg(long)]
    key: PathBuf,
    /// Experts served by workers: comma-separated LAYERS:EXPERTS items, each side a number,
    /// a range a-b or *; `0:*` is all of layer 0, `*:*` every expert.
    #[arg(long, default_value = "*:*")]
    remote: ExpertSpec,
    /// Generate once from this prompt and exit (give this or `--listen`).
    #[arg(long, required_unless_present = "listen")]
    prompt: Option<String>,
    /// Serve `POST /generate` ({"prompt", "tokens"}) on this address instead.
    #[arg(long, conflicts_with = "prompt")]
    listen: Option<std::net::SocketAddr>,
    /// Connections `--listen` holds at once (users come through a gateway, so this caps only
    /// the total).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Generations that run at once at most, in all micro-batches together (continuous
    /// batching); more wait. By default 256 when `--remote` names any expert of the model: a
    /// step waits one round trip per remote layer however many sequences it carries, so the
    /// swarm's capacity comes from sequences in flight (`bench serve` on 2 cores, 13 ms
    /// away: 448, 652 and 801 tokens/s at 64, 128 and 256 clients); 64 when none.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_batch: Option<u64>,
    /// Micro-batches the running batch is split into, in flight at once, each stepping on
    /// its own: while one waits for its remote experts, another computes. Tokens and logits
    /// are the same bits for any number; more hide more of the round trip when workers are
    /// far away, and cost rows per expert. By default 4 when `--remote` names any expert of
    /// the model (with every layer's experts 13 ms away, 4 to 8 served 64 streams best on
    /// 2 cores: `bench serve --micro-batches`), 1 when none (nothing to hide). The default
    /// follows the selection, not the workers attached: with none attached, experts named
    /// remote run locally in 4 micro-batches (about 0.8 of one's throughput on 2 cores).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    micro_batches: Option<u16>,
    /// Requests that may wait for a place in the batch; beyond, `--listen` answers 429 (with
    /// 0, a request is taken only when the batch has room for it at once).
    #[arg(long, default_value_t = 256)]
    max_queued: usize,
    /// Memory the running generations' caches (attention keys and values, DeltaNet states)
    /// may take together, in MiB, each counted at its full length: a request joins the batch
    /// only when its cache fits beside theirs, and one that alone needs more gets a 400.
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    cache_mib: u64,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A remote answer later than this is given up on and computed locally.
    #[arg(long, default_value_t = 5000)]
    dispatch_timeout_ms: u64,
    /// How long to wait for workers covering `--remote` before generating anyway.
    #[arg(long, default_value_t = 10_000)]
    wait_ms: u64,
    /// The ledger API: workers are dispatched to only while bonded and not jailed, and wrong
    /// answers found by audits are submitted there as Evidence (signed with `--key`, which
    /// is paid the reporter's share). Without it, neither happens.
    #[arg(long)]
    ledger: Option<String>,
    /// Act for this market order (the key must be its buyer or delegate): the hub meters the
    /// workers' answers for it, they are paid from its escrow, and an expert's rows go only
    /// to workers placed for it (followed on `--ledger` as blocks arrive); an expert without
    /// a live placement is computed locally.
    #[arg(long, requires = "ledger")]
    order: Option<u64>,
    /// The fraction of remote answers recomputed locally and compared bit for bit, drawn
    /// at random after each answer arrives.
    #[arg(long, default_value_t = 0.02, value_parser = fraction)]
    audit_rate: f64,
    /// Every answer of a worker is audited until it has given this many.
    #[arg(long, default_value_t = 32)]
    probation: u64,
    /// Print one JSON object (token ids, logits hash, dispatch counts).
    #[arg(long)]
    json: bool,
}

/// A `--audit-rate`: a number from 0 to 1.
fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("{text:?} is not a number from 0 to 1")),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn run(args: Args) -> Result<()> {
    let loading = || format!("loading {}", args.model.display());
    let (model, local, tokenizer) = load_local(&args.model).with_context(loading)?;
    let config = model.config().clone();
    let key = kvasir_keyfile::open(&args.key)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let reporting = args.ledger.as_deref().map(|url| Reporting {
        ledger: kvasir_api::Client::new(url),
        key: key.clone(),
        model: args.model.clone(),
    });
    let auditor = Auditor::new(args.audit_rate, args.probation, reporting);
    let mut experts = RemoteExperts::attach(
        &runtime,
        &args.hub,
        key,
        args.order.unwrap_or(0),
        &args.model,
        local,
        args.remote.clone(),
        Duration::from_millis(args.dispatch_timeout_ms),
    )?
    .with_auditor(auditor);
    if let Some(url) = &args.ledger {
        experts = experts.with_bond_check(BondCheck::new(url)?);
    }
    if let (Some(order), Some(url)) = (args.order, &args.ledger) {
        experts = experts.with_placements(Placements::new(url, order));
    }
    if !experts.wait_until_covered(&config, Duration::from_millis(args.wait_ms)) {
        tracing::warn!(
            "no workers cover --remote {}; uncovered experts run locally",
            args.remote
        );
    }
    let sampling = args.sampling.sampling();
    let engine = Arc::new(Engine {
        model,
        tokenizer,
        experts,
    });
    if let Some(listen) = args.listen {
        let anything_remote = !args.remote.resolve(&config).is_empty();
        let (micro_batches, max_batch) = if anything_remote {
            (DEFAULT_REMOTE_MICRO_BATCHES, DEFAULT_REMOTE_MAX_BATCH)
        } else {
            (1, DEFAULT_LOCAL_MAX_BATCH)
        };
        let micro_batches = args.micro_batches.unwrap_or(micro_batches);
        let max_batch = args.max_batch.map_or(max_batch, |given| {
            usize::try_from(given).unwrap_or(usize::MAX)
        });
        let serving = serve::Serving {
            listen,
            limits: Limits::total(args.max_connections),
            sampling,
            model_name: model_id(&args.model).with_context(loading)?,
            chat: chat::Chat::load(&args.model).with_context(loading)?,
            batch: batcher::Limits {
                max_batch,
                micro_batches: usize::from(micro_batches),
                queue: args.max_queued,
                cache_bytes: usize::try_from(args.cache_mib.saturating_mul(1 << 20))
                    .unwrap_or(usize::MAX),
            },
        };
        return runtime.block_on(serve::serve(engine, serving));
    }
    let prompt = args.prompt.unwrap_or_default();
    let mut generation = engine.generate(&prompt, args.sampling.tokens, sampling)?;
    // The report waits for the evidence of any catch to be committed (or given up on).
    generation.audit = Some(engine.experts.finish_audits());
    let stats = engine.experts.stats();
    if args.json {
        println!("{}", serde_json::to_string(&generation)?);
    } else {
        println!("{prompt}{}", generation.text);
        eprintln!(
            "{} remote requests, {} expert evaluations remote, {} computed locally after a worker failed",
            stats.remote_requests, stats.remote_evaluations, stats.fallbacks
        );
        if let Some(audit) = &generation.audit {
            eprintln!(
                "{} answers audited, {} wrong",
                audit.audits, audit.mismatches
            );
            for caught in &audit.caught {
                eprintln!(
                    "caught: {} on request {} of session {}",
                    caught.worker, caught.request_id, caught.session_id
                );
            }
        }
    }
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}

/// What generation needs, shared with the HTTP handler.
struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    experts: RemoteExperts,
}

impl Engine {
    /// One generation, reported with the dispatch counts so far.
    fn generate(
        &self,
        prompt: &str,
        tokens: usize,
        sampling: Sampling,
    ) -> Result<GenerationReport> {
        let mut report = run_generation(
            &self.model,
            &self.tokenizer,
            &self.experts,
            prompt,
            tokens,
            sampling,
        )?;
        report.dispatch = Some(self.experts.stats());
        report.audit = Some(self.experts.audit_report());
        Ok(report)
    }
}
