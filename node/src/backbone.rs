//! `kvasir-node backbone`: runs attention, norms and the router, and dispatches the experts
//! named by `--remote` to the workers that hold them, through the hub.
//!
//! Per layer step, `RemoteExperts` sends one request per worker first, computes the local
//! experts while those are in flight, then collects the answers. A worker that fails, leaves
//! or stalls past the timeout has its experts computed locally instead (every expert is
//! also held locally), so the output never changes and nothing hangs; a stalled session is
//! not used again, and a worker that reconnects is a new session and is used again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::Sampling;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::{ExpertError, ExpertExecutor, ExpertRequest, LocalExperts};
use kvasir_inference::tokenizer::Tokenizer;
use kvasir_ledger::keys::Keypair;
use tokio::sync::mpsc;
use tokio_rustls::rustls::ClientConfig;
use tokio_tungstenite::tungstenite::Bytes;

use crate::link::{self, next_message, Identity};
use crate::model::{model_id, run_generation, Generation, SamplingArgs};
use crate::spec::ExpertSpec;
use crate::tls;
use crate::wire::{DirectoryEntry, Message, Request, Role};

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
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A remote answer later than this is given up on and computed locally.
    #[arg(long, default_value_t = 5000)]
    dispatch_timeout_ms: u64,
    /// How long to wait for workers covering `--remote` before generating anyway.
    #[arg(long, default_value_t = 10_000)]
    wait_ms: u64,
    /// Print one JSON object (token ids, logits hash, dispatch counts).
    #[arg(long)]
    json: bool,
}

/// The backbone's end of its hub link, shared by the link task and the executor.
struct LinkState {
    tx: Option<mpsc::UnboundedSender<Bytes>>,
    directory: Vec<DirectoryEntry>,
    pending: HashMap<u64, std_mpsc::Sender<Result<Vec<f32>, String>>>,
    next_id: u64,
}

impl LinkState {
    /// Request ids start at a random point: a worker may still answer a request of a
    /// backbone process that has since been restarted, and that late answer must not match
    /// a new request that happens to reuse its id.
    fn new() -> LinkState {
        LinkState {
            tx: None,
            directory: Vec::new(),
            pending: HashMap::new(),
            next_id: rand::random::<u64>() >> 1,
        }
    }
}

#[derive(Clone, Copy, Default, Debug)]
pub struct DispatchStats {
    /// Requests sent to workers (one per worker per layer step).
    pub remote_requests: u64,
    /// Expert evaluations answered by workers.
    pub remote_evaluations: u64,
    /// Requests computed locally after their worker failed, left or stalled.
    pub fallbacks: u64,
}

/// An expert executor that sends the `remote` experts to workers through the hub.
pub struct RemoteExperts {
    local: LocalExperts,
    remote: ExpertSpec,
    model_id: String,
    hidden: usize,
    timeout: Duration,
    link: Arc<Mutex<LinkState>>,
    shunned: Mutex<HashSet<u64>>,
    stats: Mutex<DispatchStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One worker's share of a layer step.
struct Dispatch {
    session: u64,
    /// Indices into the step's requests.
    members: Vec<usize>,
    answer: Option<std_mpsc::Receiver<Result<Vec<f32>, String>>>,
    id: u64,
}

impl RemoteExperts {
    /// The live session that serves `(layer, expert)`: the lowest-numbered one holding it.
    fn session_for(
        &self,
        directory: &[DirectoryEntry],
        layer: usize,
        expert: usize,
    ) -> Option<u64> {
        if !self.remote.contains(layer, expert) {
            return None;
        }
        let shunned = lock(&self.shunned);
        directory
            .iter()
            .filter(|e| e.model_id == self.model_id && !shunned.contains(&e.session))
            .filter(|e| e.experts.contains(&(layer as u16, expert as u16)))
            .map(|e| e.session)
            .min()
    }

    /// Dials the hub at `hub_url` as the backbone `key` (the link is kept up on `runtime`,
    /// redialled when it drops) and dispatches the `remote` experts; `local` holds every
    /// expert, for the fallback.
    pub fn attach(
        runtime: &tokio::runtime::Runtime,
        hub_url: &str,
        key: Keypair,
        model_dir: &std::path::Path,
        local: LocalExperts,
        remote: ExpertSpec,
        timeout: Duration,
    ) -> Result<RemoteExperts> {
        let config = Config::load(model_dir)?;
        let link = Arc::new(Mutex::new(LinkState::new()));
        let experts = RemoteExperts {
            local,
            remote,
            model_id: model_id(model_dir)?,
            hidden: config.hidden_size,
            timeout,
            link: link.clone(),
            shunned: Mutex::new(HashSet::new()),
            stats: Mutex::new(DispatchStats::default()),
        };
        runtime.spawn(maintain_link(
            hub_url.to_string(),
            key,
            experts.model_id.clone(),
            link,
        ));
        Ok(experts)
    }

    /// Waits until every remote expert of `config` is held by a live worker; false if that
    /// has not happened within `wait`.
    pub fn wait_until_covered(&self, config: &Config, wait: Duration) -> bool {
        let start = Instant::now();
        while !self.covered(config) {
            if start.elapsed() > wait {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    fn covered(&self, config: &Config) -> bool {
        let link = lock(&self.link);
        self.remote.resolve(config).iter().all(|(l, e)| {
            self.session_for(&link.directory, *l as usize, *e as usize)
                .is_some()
        })
    }

    /// Sends each worker its share; returns the shares and the requests left to do locally.
    fn send(&self, layer: usize, requests: &[ExpertRequest]) -> (Vec<Dispatch>, Vec<usize>) {
        let mut link = lock(&self.link);
        let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let mut local = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.session_for(&link.directory, layer, request.expert) {
                Some(session) if link.tx.is_some() => groups.entry(session).or_default().push(i),
                _ => local.push(i),
            }
        }
        let mut dispatches = Vec::new();
        for (session, members) in groups {
            link.next_id += 1;
            let id = link.next_id;
            let frame = Message::Request(self.request(session, id, layer, requests, &members));
            let (answer_tx, answer) = std_mpsc::channel();
            link.pending.insert(id, answer_tx);
            let sent = link
                .tx
                .as_ref()
                .is_some_and(|tx| tx.send(frame.encode().into()).is_ok());
            dispatches.push(Dispatch {
                session,
                members,
                answer: sent.then_some(answer),
                id,
            });
        }
        (dispatches, local)
    }

    /// The wire request for `members`: each token's row once, and per expert its row indices.
    fn request(
        &self,
        session: u64,
        id: u64,
        layer: usize,
        requests: &[ExpertRequest],
        members: &[usize],
    ) -> Request {
        let hidden = self.hidden;
        let mut slot: BTreeMap<usize, u32> = BTreeMap::new();
        let mut rows = Vec::new();
        let experts = members
            .iter()
            .map(|&i| {
                let request = &requests[i];
                let indices = request
                    .tokens
                    .iter()
                    .zip(request.rows.chunks(hidden))
                    .map(|(token, row)| {
                        *slot.entry(*token).or_insert_with(|| {
                            rows.extend_from_slice(row);
                            (rows.len() / hidden - 1) as u32
                        })
                    })
                    .collect();
                (request.expert as u16, indices)
            })
            .collect();
        Request {
            session,
            id,
            layer: layer as u16,
            hidden: hidden as u32,
            rows,
            experts,
        }
    }

    /// Waits for one worker's answer until `deadline`; its partials, split per member.
    fn collect(
        &self,
        dispatch: &Dispatch,
        requests: &[ExpertRequest],
        deadline: Instant,
    ) -> Option<Vec<Vec<f32>>> {
        let answer = dispatch.answer.as_ref()?;
        let waited = answer.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        lock(&self.link).pending.remove(&dispatch.id);
        let partials = match waited {
            Ok(Ok(partials)) => partials,
            Ok(Err(message)) => {
                tracing::warn!("worker failed request {}: {message}", dispatch.id);
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.shunned).insert(dispatch.session);
                tracing::warn!(
                    "session {} stalled on request {}; not using it again",
                    dispatch.session,
                    dispatch.id
                );
                return None;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return None,
        };
        let sizes: Vec<usize> = dispatch
            .members
            .iter()
            .map(|&i| requests[i].rows.len())
            .collect();
        if partials.len() != sizes.iter().sum::<usize>() {
            return None;
        }
        let mut rest = &partials[..];
        Some(
            sizes
                .into_iter()
                .map(|n| {
                    let (head, tail) = rest.split_at(n);
                    rest = tail;
                    head.to_vec()
                })
                .collect(),
        )
    }

    pub fn stats(&self) -> DispatchStats {
        *lock(&self.stats)
    }
}

impl ExpertExecutor for RemoteExperts {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.local.holds(layer, expert)
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let deadline = Instant::now() + self.timeout;
        let (dispatches, local) = self.send(layer, requests);
        let mut results: Vec<Option<Vec<f32>>> = vec![None; requests.len()];
        let subset = |members: &[usize]| -> Vec<ExpertRequest> {
            members.iter().map(|&i| requests[i].clone()).collect()
        };
        // Local experts while the remote ones are in flight.
        for (i, partial) in local
            .iter()
            .zip(self.local.evaluate(layer, &subset(&local))?)
        {
            results[*i] = Some(partial);
        }
        let mut stats = DispatchStats::default();
        for dispatch in &dispatches {
            stats.remote_requests += 1;
            let partials = match self.collect(dispatch, requests, deadline) {
                Some(partials) => {
                    stats.remote_evaluations += dispatch.members.len() as u64;
                    partials
                }
                None => {
                    stats.fallbacks += 1;
                    self.local.evaluate(layer, &subset(&dispatch.members))?
                }
            };
            for (i, partial) in dispatch.members.iter().zip(partials) {
                results[*i] = Some(partial);
            }
        }
        let mut total = lock(&self.stats);
        total.remote_requests += stats.remote_requests;
        total.remote_evaluations += stats.remote_evaluations;
        total.fallbacks += stats.fallbacks;
        Ok(results.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// Keeps the hub link up: dial, authenticate, read answers and directories, redial.
async fn maintain_link(url: String, key: Keypair, model_id: String, state: Arc<Mutex<LinkState>>) {
    let mut backoff = Duration::from_millis(100);
    let tls = match tls::client(None) {
        Ok(tls) => tls,
        Err(e) => return tracing::error!("TLS setup: {e:#}"),
    };
    loop {
        match hub_session(&url, &tls, &key, &model_id, &state).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => tracing::warn!("hub link: {e:#}"),
        }
        {
            let mut link = lock(&state);
            link.tx = None;
            link.directory.clear();
            // Dropping the senders tells every waiting step to compute locally.
            link.pending.clear();
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn hub_session(
    url: &str,
    tls: &Arc<ClientConfig>,
    key: &Keypair,
    model_id: &str,
    state: &Arc<Mutex<LinkState>>,
) -> Result<()> {
    let identity = Identity {
        key,
        role: Role::Backbone,
        model_id: model_id.into(),
        backend: "cpu".into(),
        experts: vec![],
    };
    let (tx, mut source, _) = link::connect(url, tls, identity).await?;

    lock(state).tx = Some(tx);
    tracing::info!("attached to the hub at {url}");
    loop {
        match next_message(&mut source).await? {
            Message::Directory(directory) => lock(state).directory = directory.sessions,
            Message::Response(response) => {
                if let Some(answer) = lock(state).pending.remove(&response.id) {
                    let _ = answer.send(Ok(response.partials));
                }
            }
            Message::Failure(failure) => {
                if let Some(answer) = lock(state).pending.remove(&failure.id) {
                    let _ = answer.send(Err(failure.message));
                }
            }
            _ => bail!("unexpected message from the hub"),
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let loading = || format!("loading {}", args.model.display());
    let config = Config::load(&args.model).with_context(loading)?;
    let checkpoint = Checkpoint::open(&args.model).with_context(loading)?;
    let local = LocalExperts::load(&checkpoint, &config, |_, _| true).with_context(loading)?;
    let model = Model::load(&checkpoint, config.clone()).with_context(loading)?;
    let tokenizer = Tokenizer::load(&args.model).with_context(loading)?;
    let key = kvasir_wallet::keyfile::open(&args.key)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let experts = RemoteExperts::attach(
        &runtime,
        &args.hub,
        key,
        &args.model,
        local,
        args.remote.clone(),
        Duration::from_millis(args.dispatch_timeout_ms),
    )?;
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
        return runtime.block_on(serve(engine, listen, sampling));
    }
    let prompt = args.prompt.unwrap_or_default();
    let generation = engine.generate(&prompt, args.sampling.tokens, sampling)?;
    let stats = engine.experts.stats();
    if args.json {
        println!("{}", generation.to_json(stats.to_json()));
    } else {
        println!("{prompt}{}", generation.text);
        eprintln!(
            "{} remote requests, {} expert evaluations remote, {} computed locally after a worker failed",
            stats.remote_requests, stats.remote_evaluations, stats.fallbacks
        );
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
    fn generate(&self, prompt: &str, tokens: usize, sampling: Sampling) -> Result<Generation> {
        run_generation(
            &self.model,
            &self.tokenizer,
            &self.experts,
            prompt,
            tokens,
            sampling,
        )
    }
}

impl DispatchStats {
    fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "remote_requests": self.remote_requests,
            "remote_evaluations": self.remote_evaluations,
            "fallbacks": self.fallbacks,
        })
    }
}

#[derive(serde::Deserialize)]
struct GenerateRequest {
    prompt: String,
    #[serde(default = "default_tokens")]
    tokens: usize,
}

fn default_tokens() -> usize {
    32
}

/// Most tokens one HTTP request may ask for.
const MAX_HTTP_TOKENS: usize = 4096;

type Reply = Result<Json<serde_json::Value>, (StatusCode, Json<serde_json::Value>)>;

fn http_error(
    status: StatusCode,
    kind: &str,
    message: String,
) -> (StatusCode, Json<serde_json::Value>) {
    (
        status,
        Json(serde_json::json!({"error": kind, "message": message})),
    )
}

/// The HTTP endpoint's state: the engine, one generation at a time (batching concurrent
/// requests is for a later change), and the sampling settings from the command line.
struct Served {
    engine: Arc<Engine>,
    turn: tokio::sync::Mutex<()>,
    sampling: Sampling,
}

/// `POST /generate`: JSON in and out, errors as `{error, message}`.
async fn generate_handler(
    State(served): State<Arc<Served>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Reply {
    let Json(request) = body.map_err(|e| http_error(e.status(), "bad_request", e.body_text()))?;
    if request.prompt.is_empty() || request.tokens == 0 || request.tokens > MAX_HTTP_TOKENS {
        let message = format!("prompt must be non-empty and tokens in 1..={MAX_HTTP_TOKENS}");
        return Err(http_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
            message,
        ));
    }
    let _turn = served.turn.lock().await;
    let (engine, sampling) = (served.engine.clone(), served.sampling);
    let generation = tokio::task::spawn_blocking(move || {
        engine.generate(&request.prompt, request.tokens, sampling)
    })
    .await
    .map_err(|e| http_error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
    .map_err(|e| {
        http_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "generation",
            format!("{e:#}"),
        )
    })?;
    Ok(Json(
        generation.to_json(served.engine.experts.stats().to_json()),
    ))
}

async fn serve(
    engine: Arc<Engine>,
    listen: std::net::SocketAddr,
    sampling: Sampling,
) -> Result<()> {
    let served = Arc::new(Served {
        engine,
        turn: tokio::sync::Mutex::new(()),
        sampling,
    });
    let app = Router::new()
        .route("/generate", post(generate_handler))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(64 << 10))
        .with_state(served);
    let listener = link::bind("backbone", listen).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
