//! `kvasir-node worker`: holds a slice of experts and evaluates them for the rows it is sent.
//! It opens one outbound `wss://` connection to the gateway and listens on no socket; it
//! answers the hub's challenge with its wallet key, announces what it holds, then serves
//! requests until the link drops, and reconnects with backoff. It answers the hub's pings,
//! and takes a hub from which nothing (not even a ping) arrived for `--idle-timeout-ms` for
//! dead: it drops that link and redials.
//!
//! The room: it may touch the engine's expert executors, the wire protocol and its link;
//! it never sees the router, the prompt, other layers or the ledger.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvasir_inference::config::Config;
use kvasir_inference::moe::ExpertExecutor;
use kvasir_ledger::keys::Keypair;
use tokio_rustls::rustls::ClientConfig;

use crate::engine::{load_experts, model_id, Backend};
use crate::link::{self, next_message, Identity, Idle};
use crate::spec::ExpertSpec;
use crate::tls;
use crate::wire::{ExpertId, Failure, Message, Request, Response, Role};

const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct Args {
    /// The gateway's swarm URL: wss://HOST[:PORT]/swarm (ws:// for a hub on the same LAN).
    #[arg(long)]
    gateway: String,
    /// The wallet key that signs the hub's challenge and is paid for the work.
    #[arg(long, env = "KVASIR_KEYFILE")]
    keyfile: PathBuf,
    /// Checkpoint directory; only the held experts' weights are read.
    #[arg(long)]
    model: PathBuf,
    /// Experts to hold, e.g. `0:*` or `1-3:0-15` (see `--help` of `backbone --remote`).
    #[arg(long)]
    experts: ExpertSpec,
    /// PEM certificate to trust for the gateway (a dev gateway's self-signed one).
    #[arg(long)]
    ca: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Nothing from the hub for this long (the hub pings every link, by default every 15 s)
    /// and the link is taken for dead and redialled; it also bounds dialling and the
    /// handshake.
    #[arg(long, default_value_t = link::DEFAULT_IDLE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_ms: u64,
}

struct Worker {
    key: Keypair,
    model_id: String,
    backend: String,
    hidden: usize,
    held: Vec<ExpertId>,
    experts: Box<dyn ExpertExecutor + Send>,
}

pub fn run(args: Args) -> Result<()> {
    let key = kvasir_keyfile::open(&args.keyfile)?;
    let config = Config::load(&args.model)?;
    let held = args.experts.resolve(&config);
    if held.is_empty() {
        bail!("--experts {} selects no expert of this model", args.experts);
    }
    let spec = args.experts.clone();
    let experts = load_experts(&args.model, args.backend, |l, e| spec.contains(l, e))
        .with_context(|| format!("loading experts from {}", args.model.display()))?;
    let worker = Arc::new(Worker {
        key,
        model_id: model_id(&args.model)?,
        backend: args.backend.name().to_string(),
        hidden: config.hidden_size,
        held,
        experts,
    });
    println!(
        "worker {} holds {} experts ({})",
        worker.key.address(),
        worker.held.len(),
        args.experts
    );
    // Checked once up front for a clear error; re-read per connection, so a gateway that
    // restarts with a new certificate is trusted again.
    tls::client(args.ca.as_deref())?;
    let idle = Duration::from_millis(args.idle_timeout_ms);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let mut backoff = Duration::from_millis(250);
        loop {
            let attempt = match tls::client(args.ca.as_deref()) {
                Ok(tls) => session(&worker, &args.gateway, &tls, idle).await,
                Err(e) => Err(e),
            };
            match attempt {
                Ok(served) => {
                    tracing::warn!("link closed after {served} requests");
                    if served > 0 {
                        backoff = Duration::from_millis(250);
                    }
                }
                Err(e) => tracing::warn!("link failed: {e:#}"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    })
}

/// One connection: dial, authenticate, serve until it ends or the hub is silent for `idle`.
/// Returns requests served.
async fn session(
    worker: &Arc<Worker>,
    url: &str,
    tls: &Arc<ClientConfig>,
    idle: Duration,
) -> Result<u64> {
    let identity = Identity {
        key: &worker.key,
        role: Role::Worker,
        model_id: worker.model_id.clone(),
        backend: worker.backend.clone(),
        experts: worker.held.clone(),
    };
    let (tx, source, session) = tokio::time::timeout(idle, link::connect(url, tls, identity))
        .await
        .with_context(|| format!("no welcome from the hub within {idle:?}"))??;
    let mut source = Idle::new(source, idle);
    println!("worker session {session} open");
    let mut served = 0;
    loop {
        let Message::Request(request) = next_message(&mut source).await? else {
            bail!("the hub sent something other than a request");
        };
        let worker = worker.clone();
        let answer = tokio::task::spawn_blocking(move || worker.answer(request)).await?;
        if tx.send(answer.encode().into()).is_err() {
            return Ok(served);
        }
        served += 1;
    }
}

impl Worker {
    /// The response to `request`, or a failure saying why there is none.
    fn answer(&self, request: Request) -> Message {
        match self.evaluate(&request) {
            Ok(response) => Message::Response(response),
            Err(e) => Message::Failure(Failure::new(request.id, format!("{e:#}"))),
        }
    }

    fn evaluate(&self, request: &Request) -> Result<Response> {
        let hidden = request.hidden as usize;
        if hidden != self.hidden {
            bail!("rows are {hidden} wide, this model's are {}", self.hidden);
        }
        let requests = request.to_expert_requests()?;
        let partials = self.experts.evaluate(request.layer as usize, &requests)?;
        Ok(Response::from_partials(request, &partials)?)
    }
}
