//! Continuous batching: every generation the backbone serves shares its decode steps. The
//! running sequences are split into micro-batches in flight at once (`Pipeline`), each a
//! lane: a thread that owns its sequences and steps them on its own, so that while one lane
//! waits for its remote experts at a layer, another computes. A request joins a lane between
//! two of its steps (its prompt is prefilled in the step it joins) and leaves when it is done
//! or its caller stops listening, so a step carries one row per sequence of the lane (plus
//! the prompts joining) and costs one round trip per remote worker per layer, whatever the
//! number of users. A sequence's tokens and logits are the same bits alone or in any batch
//! (the engine's guarantee), so batching changes throughput, never answers.
//!
//! Requests wait in a bounded queue; when it is full `submit` says so at once (the HTTP
//! layer answers 429) rather than letting a burst grow memory. One thread places them, in
//! order, each in the lane that runs fewest sequences, when there is room (`Room`): at most
//! `Limits::max_batch` sequences run in all lanes together, and their caches are bounded
//! (`Limits::cache_bytes`): a sequence is placed only when the cache it will hold at its full
//! length (prompt and tokens to generate) fits beside theirs, so many long generations wait
//! their turn instead of running the backbone out of memory. Its cache is allocated whole
//! when it is placed, so what is counted is what is held.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use kvasir_inference::generate::{step, Pipeline, Sampling, Sequence};
use kvasir_inference::model::qwen_moe::Model;
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

/// Prompt tokens that may join a lane in one step: a prompt is prefilled in the step it
/// joins, so this bounds how long one step (every stream of the lane's next token) can take.
/// One prompt always joins, however long.
const PREFILL_BUDGET: usize = 2048;

/// The batch's bounds.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sequences that run at once, in all micro-batches together.
    pub max_batch: usize,
    /// Micro-batches (lanes) the running sequences are split into, in flight together.
    pub micro_batches: usize,
    /// Jobs that may wait for a place; beyond, `submit` refuses them as busy.
    pub queue: usize,
    /// Bytes of cache the running sequences may hold together, each counted at its full
    /// length; a job that alone needs more is refused.
    pub cache_bytes: usize,
}

/// The handle requests are submitted through; the batch runs on its own threads until every
/// handle is dropped (and then until its running sequences are done).
#[derive(Clone)]
pub struct Batcher {
    jobs: SyncSender<(Job, UnboundedSender<Event>)>,
    engine: Arc<Engine>,
    cache_bytes: usize,
}

impl Batcher {
    /// Starts the batch thread, within `limits`.
    pub fn start(engine: Arc<Engine>, limits: Limits) -> anyhow::Result<Batcher> {
        let pipeline = Pipeline::new(limits.micro_batches, rayon::current_num_threads())?;
        let (jobs, incoming) = sync_channel(limits.queue);
        let limits = Limits {
            max_batch: limits.max_batch.max(1),
            ..limits
        };
        let room = Arc::new(Room::new(pipeline.micro_batches(), limits));
        let (lanes, placed): (Vec<Sender<Running>>, Vec<Receiver<Running>>) =
            (0..pipeline.micro_batches()).map(|_| channel()).unzip();
        let (lane_engine, lane_room) = (engine.clone(), room.clone());
        std::thread::Builder::new()
            .name("batch-lanes".into())
            .spawn(move || {
                pipeline.in_flight(placed.into_iter().enumerate(), |(lane, placed)| {
                    run_lane(&lane_engine, &lane_room, lane, &placed)
                })
            })?;
        let place_engine = engine.clone();
        std::thread::Builder::new()
            .name("batcher".into())
            .spawn(move || place(&place_engine, &room, &incoming, &lanes))?;
        Ok(Batcher {
            jobs,
            engine,
            cache_bytes: limits.cache_bytes,
        })
    }

    /// Queues `job`; its events arrive on the receiver. Dropping the receiver cancels it.
    /// A job is checked here, so that no sequence in the batch can fail the step it shares
    /// with the others.
    pub fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, Refused> {
        if let Err(why) = check(&job, &self.engine.model, self.cache_bytes) {
            return Err(Refused::Invalid(why));
        }
        let (events, receiver) = unbounded_channel();
        match self.jobs.try_send((job, events)) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(Refused::Busy),
            Err(TrySendError::Disconnected(_)) => Err(Refused::Stopped),
        }
    }
}

/// Whether `job` can run on `model` beside others, its cache within `cache_bound` bytes;
/// if not, why.
fn check(job: &Job, model: &Model, cache_bound: usize) -> Result<(), String> {
    let config = model.config();
    let (context, vocab) = (config.max_position_embeddings, config.vocab_size);
    let (prompt, max_new) = (job.prompt.len(), job.max_new);
    if prompt == 0 || max_new == 0 {
        return Err("a prompt and at least one token to generate are needed".into());
    }
    if prompt > MAX_PROMPT_TOKENS {
        return Err(format!(
            "the prompt's {prompt} tokens are over {MAX_PROMPT_TOKENS}"
        ));
    }
    if prompt.saturating_add(max_new) > context {
        return Err(format!(
            "the prompt's {prompt} tokens and {max_new} to generate exceed the model's context of {context}"
        ));
    }
    let cache = cache_bytes(model, job);
    if cache > cache_bound {
        return Err(format!(
            "the prompt's {prompt} tokens and {max_new} to generate need {} KiB of cache, over this backbone's {} KiB",
            kib(cache),
            kib(cache_bound),
        ));
    }
    if let Some(token) = job.prompt.iter().find(|t| **t as usize >= vocab) {
        return Err(format!("token {token} is outside the vocabulary"));
    }
    Ok(())
}

fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1 << 10)
}

/// The cache `job`'s sequence holds at its full length.
fn cache_bytes(model: &Model, job: &Job) -> usize {
    model.cache_bytes(job.prompt.len().saturating_add(job.max_new))
}

/// A sequence in a lane, with where its caller listens, how many tokens it was told, the
/// prompt tokens its first step prefills and the cache it holds.
struct Running {
    sequence: Sequence,
    events: UnboundedSender<Event>,
    told: usize,
    prompt: usize,
    cache_bytes: usize,
}

/// What the lanes hold together: the sequences each runs and the cache of all. The placing
/// thread waits here for room; a lane gives back a sequence's share when it leaves.
struct Room {
    held: Mutex<Held>,
    freed: Condvar,
    limits: Limits,
}

struct Held {
    per_lane: Vec<usize>,
    cache: usize,
}

/// How often a job waiting for room looks whether its caller is still listening.
const WAITING_CHECK: Duration = Duration::from_millis(100);

impl Room {
    fn new(lanes: usize, limits: Limits) -> Room {
        Room {
            held: Mutex::new(Held {
                per_lane: vec![0; lanes],
                cache: 0,
            }),
            freed: Condvar::new(),
            limits,
        }
    }

    /// A lane holds no shared invariant a panic could break halfway: counts only.
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until a sequence whose cache is `needs` bytes fits (any does when none runs),
    /// counts it in the lane that runs fewest and says which; `None` once `left()` says its
    /// caller stopped listening.
    fn take(&self, needs: usize, left: impl Fn() -> bool) -> Option<usize> {
        let mut held = self.lock();
        loop {
            if left() {
                return None;
            }
            let running: usize = held.per_lane.iter().sum();
            let fits = running == 0
                || (running < self.limits.max_batch
                    && held.cache.saturating_add(needs) <= self.limits.cache_bytes);
            if fits {
                let lane = (0..held.per_lane.len())
                    .min_by_key(|lane| held.per_lane[*lane])
                    .unwrap_or(0);
                held.per_lane[lane] += 1;
                held.cache = held.cache.saturating_add(needs);
                return Some(lane);
            }
            held = self
                .freed
                .wait_timeout(held, WAITING_CHECK)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// A sequence of `lane` holding `cache_bytes` has left.
    fn give_back(&self, lane: usize, cache_bytes: usize) {
        let mut held = self.lock();
        if let Some(running) = held.per_lane.get_mut(lane) {
            *running = running.saturating_sub(1);
        }
        held.cache = held.cache.saturating_sub(cache_bytes);
        drop(held);
        self.freed.notify_all();
    }
}

/// The placing thread: takes jobs in order, waits for room for each and hands it, its cache
/// allocated, to a lane. Ends when every `Batcher` is dropped, which ends the lanes once
/// their sequences are done.
fn place(
    engine: &Engine,
    room: &Room,
    incoming: &Receiver<(Job, UnboundedSender<Event>)>,
    lanes: &[Sender<Running>],
) {
    while let Ok((job, events)) = incoming.recv() {
        let needs = cache_bytes(&engine.model, &job);
        // A caller that stopped listening while it waited gets no cache.
        let Some(lane) = room.take(needs, || events.is_closed()) else {
            continue;
        };
        let Some(running) = admit(engine, (job, events), needs) else {
            room.give_back(lane, needs);
            continue;
        };
        if lanes[lane].send(running).is_err() {
            tracing::error!("batch lane {lane} is gone; nothing more is served");
            return;
        }
    }
}

/// One lane: steps its sequences until the placing thread is gone and none is left.
fn run_lane(engine: &Engine, room: &Room, lane: usize, placed: &Receiver<Running>) {
    let mut batch: Vec<Running> = Vec::new();
    // Placed here, not yet joined: beyond this step's prefill budget.
    let mut waiting: VecDeque<Running> = VecDeque::new();
    let leave = |running: &Running| room.give_back(lane, running.cache_bytes);
    loop {
        if batch.is_empty() && waiting.is_empty() {
            match placed.recv() {
                Ok(running) => waiting.push_back(running),
                Err(_) => return,
            }
        }
        waiting.extend(placed.try_iter());
        let mut prefill = 0;
        while let Some(next) = waiting.front() {
            if prefill > 0 && prefill + next.prompt > PREFILL_BUDGET {
                break;
            }
            prefill += next.prompt;
            batch.extend(waiting.pop_front());
        }
        // A caller that stopped listening leaves before the step.
        batch.retain(|running| {
            let listening = !running.events.is_closed();
            if !listening {
                leave(running);
            }
            listening
        });
        if batch.is_empty() {
            continue;
        }
        let mut sequences: Vec<&mut Sequence> = batch.iter_mut().map(|r| &mut r.sequence).collect();
        // A step that fails, or panics, ends the generations in it, not the service.
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
            step(&engine.model, &engine.experts, &mut sequences)
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
                leave(&running);
            }
            continue;
        }
        batch.retain_mut(|running| {
            let stays = tell(running);
            if !stays {
                leave(running);
            }
            stays
        });
    }
}

/// `job`'s place in a lane, its cache allocated; if the memory is not there, the caller
/// is told and the job is dropped.
fn admit(
    engine: &Engine,
    (job, events): (Job, UnboundedSender<Event>),
    cache_bytes: usize,
) -> Option<Running> {
    match Sequence::with_reserved_cache(&engine.model, &job.prompt, job.max_new, job.sampling) {
        Ok(sequence) => Some(Running {
            sequence,
            events,
            told: 0,
            prompt: job.prompt.len(),
            cache_bytes,
        }),
        Err(e) => {
            let message = format!("no memory for the {} KiB cache: {e}", kib(cache_bytes));
            tracing::error!("{message}");
            let _ = events.send(Event::Failed(message));
            None
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_inference::moe::{ExpertExecutor, LocalExperts};

    use crate::backbone::remote::RemoteExperts;
    use crate::engine::{load_local, tiny_checkpoint};

    fn tiny() -> (Model, LocalExperts) {
        let (model, experts, _) = load_local(&tiny_checkpoint()).unwrap();
        (model, experts)
    }

    fn job(prompt: usize, max_new: usize) -> Job {
        Job {
            prompt: vec![1; prompt],
            max_new,
            sampling: Sampling::GREEDY,
        }
    }

    /// The tokens `sequence` generates run alone, to its end.
    fn alone(model: &Model, experts: &dyn ExpertExecutor, mut sequence: Sequence) -> Vec<u32> {
        while !sequence.is_done() {
            kvasir_inference::generate::step(model, experts, &mut [&mut sequence]).unwrap();
        }
        sequence.generated().to_vec()
    }

    /// A job is refused before it joins when its cache at full length alone is over the
    /// bound, as when its context is; the bound is exact to the byte.
    #[test]
    fn a_job_whose_cache_cannot_fit_is_refused_before_it_joins() {
        let (model, _) = tiny();
        let bound = model.cache_bytes(60);
        assert_eq!(check(&job(10, 50), &model, bound), Ok(()));
        let refused = check(&job(10, 51), &model, bound).unwrap_err();
        assert!(
            refused.contains("of cache, over this backbone's"),
            "{refused}"
        );
        assert!(
            check(&job(10, 600), &model, usize::MAX).is_err(),
            "past the context"
        );
        assert!(check(&job(10, usize::MAX), &model, usize::MAX).is_err());
        assert!(check(&job(0, 5), &model, usize::MAX).is_err());
        let outside = Job {
            prompt: vec![u32::MAX],
            ..job(1, 1)
        };
        assert!(check(&outside, &model, usize::MAX).is_err());
        // The cache is the keys and values of every layer at each position.
        let per_position = model.cache_bytes(2) - model.cache_bytes(1);
        assert_eq!(per_position, 3 * 2 * 2 * 32 * 4);
        // Sizes past memory are an error, not an overflow or an abort.
        assert_eq!(model.cache_bytes(usize::MAX), usize::MAX);
        assert!(model.new_cache_for(usize::MAX / 2).is_err());
    }

    /// A reserved cache is allocated whole: a sequence run to its full length holds what was
    /// counted for it and gives the same tokens as one that grew its cache.
    #[test]
    fn a_reserved_cache_gives_the_same_tokens() {
        let (model, experts) = tiny();
        let prompt = [5, 6, 7];
        let reserved = Sequence::with_reserved_cache(&model, &prompt, 6, Sampling::GREEDY).unwrap();
        assert_eq!(
            alone(&model, &experts, reserved),
            alone(
                &model,
                &experts,
                Sequence::new(&model, &prompt, 6, Sampling::GREEDY)
            )
        );
    }

    /// With cache room for one generation at a time, the others wait in the queue: each has
    /// ended before the next one's first token, and each gets the tokens it gets alone. The
    /// room is shared: with several lanes, an idle lane does not take a job that does not fit.
    #[test]
    fn jobs_whose_caches_do_not_fit_together_run_one_after_another() {
        for micro_batches in [1, 3] {
            let engine = tiny_engine();
            let jobs = PROMPTS.map(|prompt| job_for(&prompt));
            let one = cache_bytes(&engine.model, &jobs[0]);
            let limits = Limits {
                max_batch: 8,
                micro_batches,
                queue: 8,
                cache_bytes: one + one / 2,
            };
            let batcher = Batcher::start(engine.clone(), limits).unwrap();
            let mut receivers = jobs.map(|job| batcher.submit(job).unwrap());
            let mut heard: [Vec<Event>; 3] = Default::default();
            for next in 1..3 {
                let first = receivers[next].blocking_recv().unwrap();
                while let Ok(event) = receivers[next - 1].try_recv() {
                    heard[next - 1].push(event);
                }
                assert!(
                    matches!(heard[next - 1].last(), Some(Event::Done { .. })),
                    "{micro_batches} lanes: job {next} started beside job {}: {:?}",
                    next - 1,
                    heard[next - 1]
                );
                heard[next].push(first);
            }
            while let Some(event) = receivers[2].blocking_recv() {
                heard[2].push(event);
            }
            assert_alone(&engine, &heard);
        }
    }

    /// With room for all, generations placed in several lanes at once, each stepping on its
    /// own, get the tokens they get alone.
    #[test]
    fn lanes_in_flight_at_once_give_every_generation_its_own_tokens() {
        let engine = tiny_engine();
        let limits = Limits {
            max_batch: 8,
            micro_batches: 2,
            queue: 8,
            cache_bytes: usize::MAX,
        };
        let batcher = Batcher::start(engine.clone(), limits).unwrap();
        let mut receivers = PROMPTS.map(|prompt| batcher.submit(job_for(&prompt)).unwrap());
        let heard = receivers.each_mut().map(|events| {
            let mut heard = Vec::new();
            while let Some(event) = events.blocking_recv() {
                heard.push(event);
            }
            heard
        });
        assert_alone(&engine, &heard);
    }

    const PROMPTS: [[u32; 3]; 3] = [[5, 6, 7], [8, 9, 10], [11, 12, 13]];
    const MAX_NEW: usize = 8;

    fn tiny_engine() -> Arc<Engine> {
        let (model, experts, tokenizer) = load_local(&tiny_checkpoint()).unwrap();
        let hidden = model.config().hidden_size;
        Arc::new(Engine {
            model,
            tokenizer,
            experts: RemoteExperts::unlinked(experts, hidden),
        })
    }

    fn job_for(prompt: &[u32]) -> Job {
        Job {
            prompt: prompt.to_vec(),
            max_new: MAX_NEW,
            sampling: Sampling::GREEDY,
        }
    }

    /// Each of `PROMPTS` was told the tokens it generates alone, then its end.
    fn assert_alone(engine: &Engine, heard: &[Vec<Event>; 3]) {
        for (prompt, events) in PROMPTS.iter().zip(heard) {
            let tokens: Vec<u32> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Token(t) => Some(*t),
                    _ => None,
                })
                .collect();
            let sequence = Sequence::new(&engine.model, prompt, MAX_NEW, Sampling::GREEDY);
            assert_eq!(tokens, alone(&engine.model, &engine.experts, sequence));
            assert!(
                matches!(events.last(), Some(Event::Done { .. })),
                "{events:?}"
            );
        }
    }
}
