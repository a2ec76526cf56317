//! Continuous batching: every generation the backbone serves shares its decode steps. One
//! thread owns the running batch; a request joins it between two steps (its prompt is
//! prefilled in the step it joins) and leaves when it is done or its caller stops listening,
//! so a step carries one row per running sequence (plus the prompts joining) and costs one
//! round trip per remote worker per layer, whatever the number of users. A sequence's tokens
//! and logits are the same bits alone or in any batch (the engine's guarantee), so batching
//! changes throughput, never answers.
//!
//! The batch is split into micro-batches in flight at once (`Pipeline`): while one waits
//! for its remote experts at a layer, another computes.
//!
//! Requests wait in a bounded queue; when it is full `submit` says so at once (the HTTP
//! layer answers 429) rather than letting a burst grow memory.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;

use kvasir_inference::generate::{Pipeline, Sampling, Sequence};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::Engine;

/// One generation asked for.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub sampling: Sampling,
}

/// What a caller hears about its generation, in order: tokens, then one end.
#[derive(Debug, PartialEq)]
pub enum Event {
    Token(u32),
    /// The generation ended: at the end token (`eos`) or at `max_new`. `logits_blake3` is
    /// the hash of the last step's logits (little-endian f32).
    Done {
        eos: bool,
        logits_blake3: String,
    },
    Failed(String),
}

/// Why a job was not queued.
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// The queue is full: try again later.
    Busy,
    /// The batch thread is gone: nothing will be served.
    Stopped,
    /// The job cannot run on this model (too long for its context, a token outside its
    /// vocabulary, nothing to generate).
    Invalid(String),
}

/// Most prompt tokens one job may bring.
pub const MAX_PROMPT_TOKENS: usize = 8192;

/// Prompt tokens that may join the batch in one step: a prompt is prefilled in the step it
/// joins, so this bounds how long one step (every running stream's next token) can take.
/// One prompt always joins, however long.
const PREFILL_BUDGET: usize = 2048;

/// The handle requests are submitted through; the batch runs on its own thread until every
/// handle is dropped.
#[derive(Clone)]
pub struct Batcher {
    jobs: SyncSender<(Job, UnboundedSender<Event>)>,
    context: usize,
    vocab: usize,
}

impl Batcher {
    /// Starts the batch thread: at most `max_batch` sequences run at once, in up to
    /// `micro_batches` micro-batches in flight together, and at most `queue` more wait.
    pub fn start(
        engine: Arc<Engine>,
        max_batch: usize,
        micro_batches: usize,
        queue: usize,
    ) -> anyhow::Result<Batcher> {
        let pipeline = Pipeline::new(micro_batches, rayon::current_num_threads())?;
        let config = engine.model.config();
        let (context, vocab) = (config.max_position_embeddings, config.vocab_size);
        let (jobs, incoming) = sync_channel(queue);
        std::thread::Builder::new()
            .name("batcher".into())
            .spawn(move || run(&engine, &pipeline, &incoming, max_batch.max(1)))?;
        Ok(Batcher {
            jobs,
            context,
            vocab,
        })
    }

    /// Queues `job`; its events arrive on the receiver. Dropping the receiver cancels it.
    /// A job is checked here, so that no sequence in the batch can fail the step it shares
    /// with the others.
    pub fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, Refused> {
        let invalid = |m: String| Err(Refused::Invalid(m));
        if job.prompt.is_empty() || job.max_new == 0 {
            return invalid("a prompt and at least one token to generate are needed".into());
        }
        if job.prompt.len() > MAX_PROMPT_TOKENS {
            return invalid(format!(
                "the prompt's {} tokens are over {MAX_PROMPT_TOKENS}",
                job.prompt.len()
            ));
        }
        if job.prompt.len() + job.max_new > self.context {
            return invalid(format!(
                "the prompt's {} tokens and {} to generate exceed the model's context of {}",
                job.prompt.len(),
                job.max_new,
                self.context
            ));
        }
        if let Some(token) = job.prompt.iter().find(|t| **t as usize >= self.vocab) {
            return invalid(format!("token {token} is outside the vocabulary"));
        }
        let (events, receiver) = unbounded_channel();
        match self.jobs.try_send((job, events)) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(Refused::Busy),
            Err(TrySendError::Disconnected(_)) => Err(Refused::Stopped),
        }
    }
}

/// A sequence in the batch, with where its caller listens and how many tokens it was told.
struct Running {
    sequence: Sequence,
    events: UnboundedSender<Event>,
    told: usize,
}

fn run(
    engine: &Engine,
    pipeline: &Pipeline,
    incoming: &Receiver<(Job, UnboundedSender<Event>)>,
    max_batch: usize,
) {
    let mut batch: Vec<Running> = Vec::new();
    // A job taken from the queue that did not fit this step's prefill budget.
    let mut held: Option<(Job, UnboundedSender<Event>)> = None;
    loop {
        // Wait while idle; otherwise take whoever is waiting, up to the batch size and the
        // step's prefill budget.
        if batch.is_empty() && held.is_none() {
            match incoming.recv() {
                Ok(job) => held = Some(job),
                Err(_) => return,
            }
        }
        let mut prefill = 0;
        while batch.len() < max_batch {
            let job = match held.take() {
                Some(job) => job,
                None => match incoming.try_recv() {
                    Ok(job) => job,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                },
            };
            let rows = job.0.prompt.len();
            if prefill > 0 && prefill + rows > PREFILL_BUDGET {
                held = Some(job);
                break;
            }
            prefill += rows;
            batch.push(admit(engine, job));
        }
        // A caller that stopped listening leaves before the step.
        batch.retain(|r| !r.events.is_closed());
        if batch.is_empty() {
            continue;
        }
        let mut sequences: Vec<&mut Sequence> = batch.iter_mut().map(|r| &mut r.sequence).collect();
        // A step that fails, or panics, ends the generations in it, not the service.
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pipeline.step(&engine.model, &engine.experts, &mut sequences)
        }));
        let failure = match stepped {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("generation failed: {e}")),
            Err(_) => Some("generation failed: the step panicked".to_string()),
        };
        if let Some(message) = failure {
            tracing::error!("{message}; the {} generations in it end", batch.len());
            for running in batch.drain(..) {
                let _ = running.events.send(Event::Failed(message.clone()));
            }
            continue;
        }
        batch.retain_mut(tell);
    }
}

fn admit(engine: &Engine, (job, events): (Job, UnboundedSender<Event>)) -> Running {
    Running {
        sequence: Sequence::new(&engine.model, &job.prompt, job.max_new, job.sampling),
        events,
        told: 0,
    }
}

/// Sends the caller its new tokens, and the end if it came; whether it stays in the batch.
fn tell(running: &mut Running) -> bool {
    let generated = running.sequence.generated();
    for token in &generated[running.told..] {
        if running.events.send(Event::Token(*token)).is_err() {
            return false;
        }
    }
    running.told = generated.len();
    if !running.sequence.is_done() {
        return true;
    }
    let logits: Vec<u8> = running
        .sequence
        .last_logits()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let _ = running.events.send(Event::Done {
        eos: running.sequence.ended(),
        logits_blake3: blake3::hash(&logits).to_hex().to_string(),
    });
    false
}
