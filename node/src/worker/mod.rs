//! `kvasir-node worker`: holds a slice of experts and evaluates them for the rows it is sent.
//! It opens one outbound `wss://` connection to the gateway and listens on no socket; it
//! answers the hub's challenge with its wallet key, announces what it holds, then serves
//! requests until the link drops, and reconnects with backoff. Every response carries its
//! answer signature (`kvasir_wire::AnswerScope`): over the request body exactly as received and the
//! response body it sends, for this link's chain, hub and session and its own model; the hub
//! pays nothing unsigned. It answers the hub's pings, and takes a hub from which nothing (not
//! even a ping) arrived for `--idle-timeout-ms` for dead: it drops that link and redials.
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

use crate::engine::{load_experts, Backend};
use kvasir_wire::link::{self, next_frame, Connected, Identity, Idle};
use kvasir_wire::model_id;
use kvasir_wire::spec::ExpertSpec;
use kvasir_wire::tls;
use lies::{Liar, Lie, Lying};

mod lies;

use kvasir_wire::{
    request_hash, AnswerScope, Challenge, ExpertId, Failure, Message, Request, Role,
};

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
    /// Tests and the demo only (see `lies`): answer wrongly, and sign it, on this fraction
    /// of answers. Hidden from `--help`.
    #[arg(long, hide = true)]
    dishonest_fraction: Option<f64>,
    /// How a dishonest worker lies (see `lies::Lie`).
    #[arg(long, hide = true, value_enum, default_value_t = Lie::Zeros, requires = "dishonest_fraction")]
    dishonest_kind: Lie,
}

struct Worker {
    key: Keypair,
    model_id: String,
    backend: String,
    hidden: usize,
    held: Vec<ExpertId>,
    /// The held experts; a dishonest worker's behind its `Lying`.
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
    let mut experts = load_experts(&args.model, args.backend, |l, e| spec.contains(l, e))
        .with_context(|| format!("loading experts from {}", args.model.display()))?;
    if let Some(fraction) = args.dishonest_fraction {
        eprintln!(
            "warning: this worker is DISHONEST: it answers wrongly ({:?}) on {fraction} of its answers, and will be caught and slashed",
            args.dishonest_kind
        );
        experts = Box::new(Lying {
            honest: experts,
            liar: Liar::new(fraction, args.dishonest_kind),
            hidden: config.hidden_size,
        });
    }
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
        order: 0,
    };
    let connected = tokio::time::timeout(idle, link::connect(url, tls, identity))
        .await
        .with_context(|| format!("no welcome from the hub within {idle:?}"))??;
    let Connected {
        tx,
        source,
        session,
        challenge,
        notice,
    } = connected;
    let mut source = Idle::new(source, idle);
    let challenge = Arc::new(challenge);
    println!("worker session {session} open");
    if !notice.is_empty() {
        // Debug-quoted: the text is the hub's, and must not write lines of its own.
        tracing::warn!("the hub says: {notice:?}");
    }
    let mut served = 0;
    loop {
        // The frame itself is kept: the answer signs the hash of its body exactly as it came.
        let frame = next_frame(&mut source).await?;
        let request = match Message::decode(&frame)? {
            Message::Request(request) => request,
            // The hub drops a worker whose key may no longer serve (unbonded, jailed) and
            // says why, as it does to a refused hello.
            Message::Failure(failure) => bail!("the hub dropped this worker: {}", failure.message),
            _ => bail!("the hub sent something other than a request"),
        };
        let (worker, challenge) = (worker.clone(), challenge.clone());
        let answer = tokio::task::spawn_blocking(move || {
            worker.answer(&challenge, session, &request, &frame)
        })
        .await?;
        if tx.send(answer.into()).is_err() {
            return Ok(served);
        }
        served += 1;
    }
}

impl Worker {
    /// The frame answering `request` (which arrived as `frame` on session `session` of the
    /// link `challenge` opened): the signed response, or a failure saying why there is none.
    fn answer(
        &self,
        challenge: &Challenge,
        session: u64,
        request: &Request,
        frame: &[u8],
    ) -> Vec<u8> {
        match kvasir_wire::answer(request, self.hidden, &*self.experts) {
            Ok(response) => {
                let scope = AnswerScope::new(challenge, session, &self.model_id);
                response.signed_frame(&scope, request_hash(frame), &self.key)
            }
            Err(e) => Message::Failure(Failure::new(request.id, format!("{e:#}"))).encode(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_inference::checkpoint::Checkpoint;
    use kvasir_inference::moe::LocalExperts;
    use kvasir_wire::{response_body, Relayed};

    use crate::engine::tiny_checkpoint;

    #[test]
    fn every_response_is_signed_for_the_request_exactly_as_it_came() {
        let dir = tiny_checkpoint();
        let config = Config::load(&dir).unwrap();
        let hidden = config.hidden_size;
        let experts = LocalExperts::load(&Checkpoint::open(&dir).unwrap(), &config, |l, e| {
            (l, e) == (0, 1)
        })
        .unwrap();
        let request = Request {
            session: 6,
            id: 9,
            layer: 0,
            hidden: hidden as u32,
            format: kvasir_wire::RowFormat::F32,
            rows: (0..2 * hidden)
                .map(|i| (i % 7) as f32 * 0.25 - 0.5)
                .collect(),
            experts: vec![(1, vec![1])],
        };
        let want = kvasir_wire::answer(&request, hidden, &experts).unwrap();
        let worker = Worker {
            key: Keypair::from_seed(&[4; 32]),
            model_id: "m".into(),
            backend: "cpu".into(),
            hidden,
            held: vec![(0, 1)],
            experts: Box::new(experts),
        };
        let challenge = Challenge {
            nonce: [1; 32],
            hub: Keypair::from_seed(&[5; 32]).address(),
            chain_id: "kvasir-test".into(),
        };
        let frame = Message::Request(request.clone()).encode();
        let answer = worker.answer(&challenge, 6, &request, &frame);
        let Ok(Relayed::Response { id, signature, .. }) = Message::inspect(&answer) else {
            panic!("not a response: {:?}", Message::decode(&answer));
        };
        assert_eq!(id, 9);
        let Ok(Message::Response(response)) = Message::decode(&answer) else {
            panic!("a response decodes");
        };
        let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&response.partials), bits(&want.partials));
        let scope = AnswerScope::new(&challenge, 6, "m");
        let me = worker.key.address();
        let body = response_body(&answer);
        let asked = request_hash(&frame);
        assert!(scope.verify(&me, 9, asked, body, &signature).is_ok());

        let wide = Request {
            hidden: hidden as u32 * 2,
            format: kvasir_wire::RowFormat::F32,
            ..request
        };
        let frame = Message::Request(wide.clone()).encode();
        let refused = worker.answer(&challenge, 6, &wide, &frame);
        assert!(matches!(
            Message::decode(&refused),
            Ok(Message::Failure(Failure { id: 9, .. }))
        ));
    }
}
