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
//! layer answers 429) rather than letting a burst grow memory. A request whose caller has
//! hung up leaves the full queue when the next one comes, so the gone do not keep the living
//! out. One thread places them, in
//! order, each in the lane that runs fewest sequences (a sequence stays in its lane to its
//! end: lanes are balanced when placing, not rebalanced), when there is room (`Room`): at most
//! `Limits::max_batch` sequences run in all lanes together, and their caches are bounded
//! (`Limits::cache_bytes`): a sequence is placed only when the cache it will hold at its full
//! length (prompt and tokens to generate) fits beside theirs, so many long generations wait
//! their turn instead of running the backbone out of memory. Its cache is allocated whole
//! when it is placed, so what is counted is what is held.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, SendError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use kvasir_inference::generate::{step, Pipeline, Sampling, Sequence};
use kvasir_inference::model::qwen_moe::Model;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::backbone::{lock, Engine};

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
    /// The batch has stopped (no lane is left): nothing will be served.
    Stopped,
    /// The job cannot run on this model.
    Invalid(Unfit),
}

/// Why a job cannot run on this model, whatever else runs.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum Unfit {
    #[error("a prompt and at least one token to generate are needed")]
    Empty,
    #[error("the prompt's {prompt} tokens are over {MAX_PROMPT_TOKENS}")]
    PromptTooLong { prompt: usize },
    #[error("the prompt's {prompt} tokens and {max_new} to generate exceed the model's context of {context}")]
    OverContext {
        prompt: usize,
        max_new: usize,
        context: usize,
    },
    #[error("the prompt's {prompt} tokens and {max_new} to generate need {} KiB of cache, over this backbone's {} KiB", kib(*.needs), kib(*.bound))]
    OverCache {
        prompt: usize,
        max_new: usize,
        needs: usize,
        bound: usize,
    },
    #[error("token {0} is outside the vocabulary")]
    OutsideVocabulary(u32),
}

impl Unfit {
    /// The prompt and the tokens asked for are more than this backbone can hold for one
    /// sequence: fewer would fit.
    pub fn is_length(&self) -> bool {
        matches!(
            self,
            Unfit::PromptTooLong { .. } | Unfit::OverContext { .. } | Unfit::OverCache { .. }
        )
    }
}

/// The batch at a glance, for `/metrics`: what it holds now, and what it has done since it
/// started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchStats {
    /// Jobs waiting for a place: in the queue (those whose callers hung up too, until a
    /// full queue sweeps them out), and the one the placing thread holds while it waits for
    /// room.
    pub queued: usize,
    /// Sequences placed in a lane.
    pub running: usize,
    /// Cache bytes the placed sequences hold (each at its full length).
    pub cache_bytes: usize,
    /// Tokens told to callers.
    pub tokens: u64,
    /// Generations that ended: told their end, or their caller said it had heard enough.
    pub completed: u64,
    /// Generations whose caller stopped listening before their end, queued or running.
    pub hung_up: u64,
    /// Generations that failed while their caller listened.
    pub failed: u64,
}

/// The counts behind `BatchStats`: tokens as they are told, generations by their `Caller`,
/// each once.
#[derive(Default)]
struct Tally {
    tokens: AtomicU64,
    completed: AtomicU64,
    hung_up: AtomicU64,
    failed: AtomicU64,
}

impl Tally {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A generation's events, in order, for its caller. Dropping it cancels the generation (the
/// caller hung up); `finish` ends it as done, when the caller has what it wanted before the
/// batch's end (a stop string).
pub struct Generation {
    events: UnboundedReceiver<Event>,
    finished: Arc<AtomicBool>,
}

impl Generation {
    pub async fn recv(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    pub fn finish(self) {
        self.finished.store(true, Ordering::Release);
    }
}

/// Where a job's caller hears about it, and whether it said it had heard enough. Its
/// generation is counted once, by it, however the job leaves: as it is told its end
/// (`end`), or as it is dropped without one, queued or running (`Drop`).
struct Caller {
    events: UnboundedSender<Event>,
    finished: Arc<AtomicBool>,
    tally: Arc<Tally>,
    counted: bool,
}

impl Caller {
    /// A caller counted in `tally`, and the generation it listens to.
    fn new(tally: Arc<Tally>) -> (Caller, Generation) {
        let (events, receiver) = unbounded_channel();
        let finished = Arc::new(AtomicBool::new(false));
        let generation = Generation {
            events: receiver,
            finished: finished.clone(),
        };
        let caller = Caller {
            events,
            finished,
            tally,
            counted: false,
        };
        (caller, generation)
    }

    /// Whether it still listens.
    fn tell(&self, event: Event) -> bool {
        self.events.send(event).is_ok()
    }

    fn gone(&self) -> bool {
        self.events.is_closed()
    }

    /// Tells it how its generation ended (`Done` or `Failed`), counted first, so that a
    /// caller who heard its end finds it counted; one no longer listening is counted as
    /// having left.
    fn end(&mut self, end: Event) {
        if self.gone() {
            return self.count_left();
        }
        let counter = match end {
            Event::Failed(_) => &self.tally.failed,
            _ => &self.tally.completed,
        };
        Tally::count(counter);
        self.counted = true;
        self.tell(end);
    }

    /// It left before the end: done if it said it had heard enough, else hung up.
    fn count_left(&mut self) {
        let tally = &self.tally;
        let finished = self.finished.load(Ordering::Acquire);
        Tally::count(if finished {
            &tally.completed
        } else {
            &tally.hung_up
        });
        self.counted = true;
    }
}

impl Drop for Caller {
    /// Dropped untold: left, if it no longer listens; else its job was dropped by the batch
    /// (a lane that ended, a channel lost with it, the batch stopping), and it is told that
    /// its generation failed.
    fn drop(&mut self) {
        if self.counted {
            return;
        }
        if self.gone() {
            return self.count_left();
        }
        self.end(Event::Failed(
            "generation failed: the batch stopped before its end".to_string(),
        ));
    }
}

/// Most prompt tokens one job may bring.
pub const MAX_PROMPT_TOKENS: usize = 8192;

/// Prompt tokens that may join a lane in one step: a prompt is prefilled in the step it
/// joins, so this bounds how much one lane's step (every stream of the lane's next token)
/// prefills; the lanes together prefill at most this many times their number. One prompt
/// always joins, however long.
const PREFILL_BUDGET: usize = 2048;

/// The batch's bounds.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sequences that run at once, in all micro-batches together.
    pub max_batch: usize,
    /// Micro-batches (lanes) the running sequences are split into, in flight together.
    pub micro_batches: usize,
    /// Jobs that may wait for a place; beyond, `submit` refuses them as busy. With none, a
    /// job is taken only when the batch has room for it at once.
    pub queue: usize,
    /// Bytes of cache the running sequences may hold together, each counted at its full
    /// length; a job that alone needs more is refused.
    pub cache_bytes: usize,
}

/// The handle requests are submitted through; the batch runs on its own threads until every
/// handle is dropped (and then until its running sequences are done).
#[derive(Clone)]
pub struct Batcher {
    submitter: Arc<Submitter>,
    room: Arc<Room>,
    engine: Arc<Engine>,
    cache_bytes: usize,
}

impl Batcher {
    /// Starts the placing thread and the lanes, within `limits`.
    pub fn start(engine: Arc<Engine>, limits: Limits) -> anyhow::Result<Batcher> {
        let pipeline = Pipeline::new(limits.micro_batches, rayon::current_num_threads())?;
        let tally = Arc::new(Tally::default());
        let queue = Arc::new(Queue::new(limits.queue));
        let limits = Limits {
            max_batch: limits.max_batch.max(1),
            ..limits
        };
        let room = Arc::new(Room::new(pipeline.micro_batches(), limits, tally));
        let (lanes, placed): (Vec<Sender<Running>>, Vec<Receiver<Running>>) =
            (0..pipeline.micro_batches()).map(|_| channel()).unzip();
        let (lane_engine, lane_room) = (engine.clone(), room.clone());
        std::thread::Builder::new()
            .name("batch-lanes".into())
            .spawn(move || {
                pipeline.in_flight(placed.into_iter().enumerate(), |(lane, placed)| {
                    Lane {
                        room: &lane_room,
                        lane,
                        placed: &placed,
                        batch: Vec::new(),
                        waiting: VecDeque::new(),
                    }
                    .run(&lane_engine)
                })
            })?;
        let (place_engine, place_room, incoming) = (engine.clone(), room.clone(), queue.clone());
        std::thread::Builder::new()
            .name("batcher".into())
            .spawn(move || place(&place_engine, &place_room, &incoming, &lanes))?;
        Ok(Batcher {
            submitter: Arc::new(Submitter(queue)),
            room,
            engine,
            cache_bytes: limits.cache_bytes,
        })
    }

    /// Queues `job`; its events arrive on the `Generation`.
    /// A job is checked here, so that no sequence in the batch can fail the step it shares
    /// with the others.
    pub fn submit(&self, job: Job) -> Result<Generation, Refused> {
        check(&job, &self.engine.model, self.cache_bytes).map_err(Refused::Invalid)?;
        let (caller, generation) = Caller::new(self.room.tally.clone());
        self.submitter.0.push((job, caller))?;
        Ok(generation)
    }

    /// The batch now, and its counts since it started.
    pub fn stats(&self) -> BatchStats {
        let queued = self.submitter.0.lock().waiting();
        let held = self.room.lock();
        let tally = &self.room.tally;
        let count = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        BatchStats {
            queued,
            running: held.running(),
            cache_bytes: held.cache,
            tokens: count(&tally.tokens),
            completed: count(&tally.completed),
            hung_up: count(&tally.hung_up),
            failed: count(&tally.failed),
        }
    }
}

/// A job and where its caller hears about it.
type Queued = (Job, Caller);

/// The jobs waiting for a place, in order, at most `bound` of them.
struct Queue {
    state: Mutex<Waiting>,
    arrived: Condvar,
    bound: usize,
}

struct Waiting {
    jobs: VecDeque<Queued>,
    /// False once the placing thread has ended: nothing is served any more.
    taking: bool,
    /// False once every `Batcher` is gone: nothing more comes.
    submitting: bool,
    /// The placing thread waits for a job: the batch has room, and a job is taken at once
    /// even by a queue of none.
    idle: bool,
    /// The placing thread holds a job it took from here and has not placed yet (it waits
    /// for room).
    holding: bool,
}

impl Waiting {
    /// Jobs not placed yet, the one the placing thread holds included.
    fn waiting(&self) -> usize {
        self.jobs.len() + usize::from(self.holding)
    }
}

impl Queue {
    fn new(bound: usize) -> Queue {
        Queue {
            state: Mutex::new(Waiting {
                jobs: VecDeque::new(),
                taking: true,
                submitting: true,
                idle: false,
                holding: false,
            }),
            arrived: Condvar::new(),
            bound,
        }
    }

    /// A queue and its flags: nothing a panic could leave half done.
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        lock(&self.state)
    }

    /// Queues `job` behind the others, unless the queue is full of callers still listening
    /// (when it is full, those who hung up leave it first) or nothing takes jobs any more.
    fn push(&self, job: Queued) -> Result<(), Refused> {
        let mut waiting = self.lock();
        if !waiting.taking {
            return Err(Refused::Stopped);
        }
        let handed_over = usize::from(waiting.idle && waiting.jobs.is_empty());
        let bound = self.bound.max(handed_over);
        if waiting.jobs.len() >= bound {
            // Each counted as it is dropped.
            waiting.jobs.retain(|(_, caller)| !caller.gone());
        }
        if waiting.jobs.len() >= bound {
            return Err(Refused::Busy);
        }
        waiting.jobs.push_back(job);
        drop(waiting);
        self.arrived.notify_one();
        Ok(())
    }

    /// The first job, waiting for one; `None` once the queue is empty and nothing more comes.
    fn next(&self) -> Option<Queued> {
        let mut waiting = self.lock();
        loop {
            if let Some(job) = waiting.jobs.pop_front() {
                waiting.idle = false;
                waiting.holding = true;
                return Some(job);
            }
            if !waiting.submitting {
                return None;
            }
            waiting.idle = true;
            waiting = self
                .arrived
                .wait(waiting)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// The job `next` gave has left the placing thread's hands.
    fn placed(&self) {
        self.lock().holding = false;
    }

    /// Nothing will take jobs any more: later ones are refused; those waiting, returned.
    fn stop_taking(&self) -> VecDeque<Queued> {
        let mut waiting = self.lock();
        waiting.taking = false;
        std::mem::take(&mut waiting.jobs)
    }
}

/// The `Batcher`s' end of the queue: when the last is dropped, the placing thread hears that
/// nothing more comes (it places what is queued, then ends, and the lanes with it once their
/// sequences are done).
struct Submitter(Arc<Queue>);

impl Drop for Submitter {
    fn drop(&mut self) {
        self.0.lock().submitting = false;
        self.0.arrived.notify_all();
    }
}

/// Whether `job` can run on `model` beside others, its cache within `cache_bound` bytes;
/// if not, why.
fn check(job: &Job, model: &Model, cache_bound: usize) -> Result<(), Unfit> {
    let config = model.config();
    let (context, vocab) = (config.max_position_embeddings, config.vocab_size);
    let (prompt, max_new) = (job.prompt.len(), job.max_new);
    if prompt == 0 || max_new == 0 {
        return Err(Unfit::Empty);
    }
    if prompt > MAX_PROMPT_TOKENS {
        return Err(Unfit::PromptTooLong { prompt });
    }
    if prompt.saturating_add(max_new) > context {
        return Err(Unfit::OverContext {
            prompt,
            max_new,
            context,
        });
    }
    let needs = cache_bytes(model, job);
    if needs > cache_bound {
        return Err(Unfit::OverCache {
            prompt,
            max_new,
            needs,
            bound: cache_bound,
        });
    }
    if let Some(token) = job.prompt.iter().find(|t| **t as usize >= vocab) {
        return Err(Unfit::OutsideVocabulary(*token));
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
    caller: Caller,
    told: usize,
    prompt: usize,
    /// Held for its drop: the sequence's room goes back when it leaves. Last, so that it
    /// is dropped after the sequence and its caller: its cache is freed and its end counted
    /// before its room is given back.
    _share: Share,
}

/// A sequence's share of the room: its place in a lane and its cache. Given back when it is
/// dropped, however the sequence leaves: done, failed, its caller gone, or its lane ended,
/// even while it was still in the channel to that lane.
struct Share {
    room: Arc<Room>,
    lane: usize,
    cache_bytes: usize,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.room.give_back(self.lane, self.cache_bytes);
    }
}

/// What the lanes hold together: the sequences each runs and the cache of all. The placing
/// thread waits here for room and takes a sequence's `Share`, which gives it back when the
/// sequence leaves; a lane gives back its place when it ends.
struct Room {
    held: Mutex<Held>,
    freed: Condvar,
    limits: Limits,
    tally: Arc<Tally>,
}

struct Held {
    /// Sequences placed in each lane; `None` once the lane has ended.
    per_lane: Vec<Option<usize>>,
    cache: usize,
}

impl Held {
    fn running(&self) -> usize {
        self.per_lane.iter().flatten().sum()
    }
}

/// Where a job goes.
enum Placing {
    /// Its share of the room, in the lane it goes to.
    Lane(Share),
    /// Its caller stopped listening while it waited.
    Left,
    /// No lane is left to run it.
    NoLane,
}

/// How often a job waiting for room looks whether its caller is still listening.
const WAITING_CHECK: Duration = Duration::from_millis(100);

impl Room {
    fn new(lanes: usize, limits: Limits, tally: Arc<Tally>) -> Room {
        Room {
            held: Mutex::new(Held {
                per_lane: vec![Some(0); lanes],
                cache: 0,
            }),
            freed: Condvar::new(),
            limits,
            tally,
        }
    }

    /// Counts only: nothing a panic could leave half done.
    fn lock(&self) -> MutexGuard<'_, Held> {
        lock(&self.held)
    }

    fn wait<'a>(&self, held: MutexGuard<'a, Held>) -> MutexGuard<'a, Held> {
        self.freed
            .wait_timeout(held, WAITING_CHECK)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0
    }

    /// Waits until fewer than `max_batch` sequences run, so that a job is taken from the
    /// queue only when it could run but for its cache (the queue then holds `queue` jobs
    /// waiting, and one more at most is held for cache room); false when no lane is left.
    fn wait_for_a_place(&self) -> bool {
        let mut held = self.lock();
        loop {
            if held.per_lane.iter().all(Option::is_none) {
                return false;
            }
            if held.running() < self.limits.max_batch {
                return true;
            }
            held = self.wait(held);
        }
    }

    /// Waits until a sequence whose cache is `needs` bytes fits (any does when none runs),
    /// counts it in the live lane that runs fewest and gives its share there, unless `left()`
    /// says its caller stopped listening first.
    fn take(self: &Arc<Room>, needs: usize, left: impl Fn() -> bool) -> Placing {
        let mut held = self.lock();
        loop {
            if left() {
                return Placing::Left;
            }
            let Some(lane) = (0..held.per_lane.len())
                .filter(|lane| held.per_lane[*lane].is_some())
                .min_by_key(|lane| held.per_lane[*lane])
            else {
                return Placing::NoLane;
            };
            let running = held.running();
            let fits = running == 0
                || (running < self.limits.max_batch
                    && held.cache.saturating_add(needs) <= self.limits.cache_bytes);
            if fits {
                if let Some(count) = &mut held.per_lane[lane] {
                    *count += 1;
                }
                held.cache = held.cache.saturating_add(needs);
                return Placing::Lane(Share {
                    room: self.clone(),
                    lane,
                    cache_bytes: needs,
                });
            }
            held = self.wait(held);
        }
    }

    /// A sequence of `lane` holding `cache_bytes` has left (`Share`'s drop).
    fn give_back(&self, lane: usize, cache_bytes: usize) {
        let mut held = self.lock();
        if let Some(Some(count)) = held.per_lane.get_mut(lane) {
            debug_assert!(*count > 0, "lane {lane} gave back more than it held");
            *count = count.saturating_sub(1);
        }
        debug_assert!(held.cache >= cache_bytes, "more cache given back than held");
        held.cache = held.cache.saturating_sub(cache_bytes);
        drop(held);
        self.freed.notify_all();
    }

    /// `lane` has ended: nothing is placed there again, and its count is no longer kept
    /// (the shares of its sequences give back only their cache).
    fn close(&self, lane: usize) {
        if let Some(place) = self.lock().per_lane.get_mut(lane) {
            *place = None;
        }
        self.freed.notify_all();
    }
}

/// The placing thread: takes jobs in order, waits for room for each and hands it, its cache
/// allocated, to a lane. Ends when every `Batcher` is dropped and the queue is empty, which
/// ends the lanes once their sequences are done, or when no lane is left (then `submit`
/// says `Stopped`, and the jobs still queued fail).
fn place(engine: &Engine, room: &Arc<Room>, incoming: &Queue, lanes: &[Sender<Running>]) {
    let _ending = Ending(incoming);
    let stopped = || "generation failed: the batch stopped".to_string();
    while room.wait_for_a_place() {
        let Some((job, mut caller)) = incoming.next() else {
            return;
        };
        let needs = cache_bytes(&engine.model, &job);
        // A caller that stopped listening while it waited gets no cache.
        let placing = room.take(needs, || caller.gone());
        incoming.placed();
        let share = match placing {
            Placing::Lane(share) => share,
            // Counted as it is dropped.
            Placing::Left => continue,
            Placing::NoLane => {
                caller.end(Event::Failed(stopped()));
                break;
            }
        };
        let lane = share.lane;
        let Some(running) = admit(engine, (job, caller), share) else {
            continue;
        };
        // The lane ended after it was chosen: this job fails (told as it is dropped), the
        // next goes elsewhere.
        if let Err(SendError(running)) = lanes[lane].send(running) {
            drop(running);
        }
    }
    tracing::error!("every batch lane has ended; nothing more is served");
}

/// The placing thread's end, however it comes (no lane left, the last `Batcher` gone, a
/// panic): later jobs are refused as stopped, and those still queued fail.
struct Ending<'a>(&'a Queue);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        for (_, mut caller) in self.0.stop_taking() {
            caller.end(Event::Failed(
                "generation failed: the batch stopped".to_string(),
            ));
        }
    }
}

/// One lane's sequences: those stepping, and those placed here that have not joined yet
/// (beyond a step's prefill budget). However the lane ends, even by a panic, what it holds is
/// given back and its callers told (`Drop`).
struct Lane<'a> {
    room: &'a Room,
    lane: usize,
    placed: &'a Receiver<Running>,
    batch: Vec<Running>,
    waiting: VecDeque<Running>,
}

impl Lane<'_> {
    /// Steps the lane's sequences until the placing thread is gone and none is left.
    fn run(&mut self, engine: &Engine) {
        loop {
            if self.batch.is_empty() && self.waiting.is_empty() {
                match self.placed.recv() {
                    Ok(running) => self.waiting.push_back(running),
                    Err(_) => return,
                }
            }
            self.waiting.extend(self.placed.try_iter());
            // A caller that stopped listening leaves before the step (and takes no budget);
            // its share goes back as it is dropped.
            self.waiting.retain(|r| !r.caller.gone());
            self.batch.retain(|r| !r.caller.gone());
            let mut prefill = 0;
            while let Some(next) = self.waiting.front() {
                if prefill > 0 && prefill + next.prompt > PREFILL_BUDGET {
                    break;
                }
                prefill += next.prompt;
                self.batch.extend(self.waiting.pop_front());
            }
            if self.batch.is_empty() {
                continue;
            }
            self.step(engine);
        }
    }

    fn step(&mut self, engine: &Engine) {
        let mut sequences: Vec<&mut Sequence> =
            self.batch.iter_mut().map(|r| &mut r.sequence).collect();
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
            tracing::error!("{message}; the {} generations in it end", self.batch.len());
            for mut running in self.batch.drain(..) {
                running.caller.end(Event::Failed(message.clone()));
            }
            return;
        }
        self.batch.retain_mut(tell);
    }
}

impl Drop for Lane<'_> {
    /// Closed first, so that nothing more is placed here; then every sequence it holds, and
    /// any still in its channel, is dropped: told that it failed, its share given back. A
    /// job sent by a placing thread that chose this lane just before it closed is dropped
    /// with the channel, and told the same.
    fn drop(&mut self) {
        self.room.close(self.lane);
        self.batch.clear();
        self.waiting.clear();
        self.placed.try_iter().for_each(drop);
    }
}

/// `job`'s place in a lane, its cache allocated; if the memory is not there, the caller
/// is told and the job is dropped.
fn admit(engine: &Engine, (job, mut caller): Queued, share: Share) -> Option<Running> {
    match Sequence::with_reserved_cache(&engine.model, &job.prompt, job.max_new, job.sampling) {
        Ok(sequence) => Some(Running {
            sequence,
            caller,
            told: 0,
            prompt: job.prompt.len(),
            _share: share,
        }),
        Err(e) => {
            let message = format!(
                "no memory for the {} KiB cache: {e}",
                kib(share.cache_bytes)
            );
            tracing::error!("{message}");
            caller.end(Event::Failed(message));
            None
        }
    }
}

/// Sends the caller its new tokens, and the end if it came; whether it stays in the batch.
fn tell(running: &mut Running) -> bool {
    let generated = running.sequence.generated();
    for token in &generated[running.told..] {
        if !running.caller.tell(Event::Token(*token)) {
            return false;
        }
        Tally::count(&running.caller.tally.tokens);
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
    running.caller.end(Event::Done {
        eos: running.sequence.ended(),
        logits_blake3: blake3::hash(&logits).to_hex().to_string(),
    });
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_inference::moe::{ExpertExecutor, LocalExperts};

    use crate::backbone::dispatch::RemoteExperts;
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
        assert_eq!(
            refused,
            Unfit::OverCache {
                prompt: 10,
                max_new: 51,
                needs: model.cache_bytes(61),
                bound
            }
        );
        assert!(refused.is_length());
        assert!(
            refused
                .to_string()
                .contains("of cache, over this backbone's"),
            "{refused}"
        );
        let context = model.config().max_position_embeddings;
        for max_new in [600, usize::MAX] {
            let past = check(&job(10, max_new), &model, usize::MAX).unwrap_err();
            assert_eq!(
                past,
                Unfit::OverContext {
                    prompt: 10,
                    max_new,
                    context
                }
            );
        }
        let long = check(&job(MAX_PROMPT_TOKENS + 1, 1), &model, usize::MAX).unwrap_err();
        assert!(long.is_length(), "{long}");
        assert_eq!(check(&job(0, 5), &model, usize::MAX), Err(Unfit::Empty));
        let outside = Job {
            prompt: vec![u32::MAX],
            ..job(1, 1)
        };
        let refused = check(&outside, &model, usize::MAX).unwrap_err();
        assert_eq!(refused, Unfit::OutsideVocabulary(u32::MAX));
        assert!(!refused.is_length());
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

    /// With room for one generation at a time (by its cache, or by `max_batch`), the others
    /// wait in the queue: each has ended before the next one's first token, and each gets
    /// the tokens it gets alone. The room is shared: with several lanes, an idle lane does
    /// not take a job that does not fit.
    #[test]
    fn jobs_that_do_not_fit_together_run_one_after_another() {
        let engine = tiny_engine();
        let one = cache_bytes(&engine.model, &job_for(&PROMPTS[0]));
        let by_cache = |micro_batches| Limits {
            micro_batches,
            cache_bytes: one + one / 2,
            ..ROOMY
        };
        let by_count = Limits {
            max_batch: 1,
            micro_batches: 3,
            ..ROOMY
        };
        for limits in [by_cache(1), by_cache(3), by_count] {
            let batcher = Batcher::start(engine.clone(), limits).unwrap();
            let mut receivers = PROMPTS.map(|prompt| batcher.submit(job_for(&prompt)).unwrap());
            let mut heard: [Vec<Event>; 3] = Default::default();
            for next in 1..3 {
                let first = receivers[next].events.blocking_recv().unwrap();
                while let Ok(event) = receivers[next - 1].events.try_recv() {
                    heard[next - 1].push(event);
                }
                assert!(
                    matches!(heard[next - 1].last(), Some(Event::Done { .. })),
                    "{limits:?}: job {next} started beside job {}: {:?}",
                    next - 1,
                    heard[next - 1]
                );
                heard[next].push(first);
            }
            let [_, _, last] = receivers;
            heard[2].extend(all_events(last));
            assert_alone(&engine, &heard);
        }
    }

    /// A caller that hangs up gives its room back, whether it was running or waiting for
    /// room: with room for one, the jobs after it still run. The stats count both as hung
    /// up, and every token told.
    #[test]
    fn a_caller_that_hangs_up_gives_its_room_back() {
        let engine = tiny_engine();
        let limits = Limits {
            cache_bytes: cache_bytes(&engine.model, &long_job(&engine.model)),
            ..ROOMY
        };
        let batcher = Batcher::start(engine.clone(), limits).unwrap();
        let mut long = running(&batcher, long_job(&engine.model));
        // This one's caller leaves while it waits for room behind the running one; then the
        // running one's caller leaves too.
        let waiting = batcher.submit(job_for(&PROMPTS[1])).unwrap();
        // Queued, in the queue or held by the placing thread until there is room.
        let holding = batcher.stats();
        assert_eq!((holding.running, holding.queued), (1, 1), "{holding:?}");
        drop(waiting);
        assert_still_running(&mut long);
        assert_eq!(holding.cache_bytes, limits.cache_bytes);
        drop(long);
        let heard = all_events(batcher.submit(job_for(&PROMPTS[2])).unwrap());
        assert!(matches!(heard.last(), Some(Event::Done { .. })));
        let after = settled(&batcher);
        assert_eq!(
            (after.running, after.cache_bytes, after.queued),
            (0, 0, 0),
            "{after:?}"
        );
        assert_eq!((after.hung_up, after.completed, after.failed), (2, 1, 0));
        // The long one was told at least its first token before it was left.
        assert!(after.tokens > MAX_NEW as u64, "{after:?}");
    }

    /// A caller that has heard enough before the end (a stop string) ends its generation as
    /// done: it leaves the batch, counted completed, not hung up.
    #[test]
    fn a_caller_that_heard_enough_ends_its_generation_as_done() {
        let engine = tiny_engine();
        let batcher = Batcher::start(engine.clone(), ROOMY).unwrap();
        let mut long = running(&batcher, long_job(&engine.model));
        assert_still_running(&mut long);
        long.finish();
        let after = settled(&batcher);
        assert_eq!(after.running, 0, "{after:?}");
        assert_eq!((after.completed, after.hung_up, after.failed), (1, 0, 0));
    }

    /// A lane that ends, however, gives back the room of every sequence placed in it and
    /// tells their callers, those still in its channel too; one lost with the channel is
    /// told and gives its room back as well. Each is counted once, as failed.
    #[test]
    fn an_ended_lane_gives_back_the_room_of_all_it_was_given() {
        let engine = tiny_engine();
        let room = Arc::new(Room::new(2, ROOMY, Arc::default()));
        let needs = cache_bytes(&engine.model, &job(3, 4));
        let placed = |lane: usize| {
            let Placing::Lane(share) = room.take(needs, || false) else {
                panic!("room for a job");
            };
            assert_eq!(share.lane, lane, "the least loaded lane");
            let (caller, heard) = Caller::new(room.tally.clone());
            let running = admit(&engine, (job(3, 4), caller), share).unwrap();
            (running, heard)
        };
        // The least loaded lane, the first of equals: 0, 1, 0.
        let (first, mut first_heard) = placed(0);
        let (second, mut second_heard) = placed(1);
        let (third, mut third_heard) = placed(0);
        assert_eq!(room.lock().running(), 3);
        // Lane 0 runs the first, and the third is still in its channel when it ends.
        let (to_lane, in_channel) = channel();
        to_lane.send(third).unwrap();
        drop(Lane {
            room: &room,
            lane: 0,
            placed: &in_channel,
            batch: vec![first],
            waiting: VecDeque::new(),
        });
        for heard in [&mut first_heard, &mut third_heard] {
            assert!(matches!(heard.events.try_recv(), Ok(Event::Failed(_))));
        }
        assert_eq!(room.lock().per_lane, vec![None, Some(1)]);
        assert_eq!(room.lock().cache, needs);
        // Lost with a channel: told all the same, and the room comes back.
        let (to_lane, in_channel) = channel();
        to_lane.send(second).unwrap();
        drop(in_channel);
        assert!(matches!(
            second_heard.events.try_recv(),
            Ok(Event::Failed(_))
        ));
        assert_eq!(room.lock().per_lane, vec![None, Some(0)]);
        assert_eq!(room.lock().cache, 0);
        assert_eq!(room.tally.failed.load(Ordering::Relaxed), 3);
    }

    /// A full batch takes nothing from the queue: with one running and a queue of one, a
    /// second job waits in the queue and a third is refused as busy. A caller that hangs up
    /// while queued gives its place to the next, which runs.
    #[test]
    fn a_full_batch_leaves_the_queue_its_bound() {
        let engine = tiny_engine();
        let limits = Limits {
            max_batch: 1,
            queue: 1,
            ..ROOMY
        };
        let batcher = Batcher::start(engine.clone(), limits).unwrap();
        let mut long = running(&batcher, long_job(&engine.model));
        let queued = batcher.submit(job_for(&PROMPTS[1])).unwrap();
        // Time for a placing thread that wrongly takes the queued job out of the queue.
        std::thread::sleep(Duration::from_millis(200));
        assert!(matches!(
            batcher.submit(job_for(&PROMPTS[2])),
            Err(Refused::Busy)
        ));
        drop(queued);
        let next = batcher.submit(job_for(&PROMPTS[2])).unwrap();
        assert_still_running(&mut long);
        drop(long);
        assert_ends(next);
    }

    /// However the placing thread ends, the jobs still queued fail and later ones are
    /// refused as stopped.
    #[test]
    fn when_the_placing_thread_ends_the_queued_jobs_fail() {
        let queue = Queue::new(2);
        let (caller, mut heard) = Caller::new(Arc::default());
        queue.push((job(1, 1), caller)).unwrap();
        drop(Ending(&queue));
        assert!(matches!(heard.events.try_recv(), Ok(Event::Failed(_))));
        let (caller, _heard) = Caller::new(Arc::default());
        assert!(matches!(
            queue.push((job(1, 1), caller)),
            Err(Refused::Stopped)
        ));
    }

    /// With a queue of none, a job is taken when the batch has room for it at once, and
    /// refused as busy while it has none.
    #[test]
    fn a_queue_of_none_takes_a_job_only_when_the_batch_has_room() {
        let engine = tiny_engine();
        let limits = Limits {
            max_batch: 1,
            queue: 0,
            ..ROOMY
        };
        let batcher = Batcher::start(engine.clone(), limits).unwrap();
        // Until the placing thread waits for a job, there is nobody to hand one to.
        let submitted = |job: &dyn Fn() -> Job| {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                match batcher.submit(job()) {
                    Err(Refused::Busy) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    other => return other.unwrap(),
                }
            }
        };
        let mut long = submitted(&|| long_job(&engine.model));
        assert!(matches!(long.events.blocking_recv(), Some(Event::Token(_))));
        assert!(matches!(
            batcher.submit(job_for(&PROMPTS[1])),
            Err(Refused::Busy)
        ));
        drop(long);
        assert_ends(submitted(&|| job_for(&PROMPTS[1])));
    }

    /// With room for all, generations placed in several lanes at once, each stepping on its
    /// own, get the tokens they get alone.
    #[test]
    fn lanes_in_flight_at_once_give_every_generation_its_own_tokens() {
        let engine = tiny_engine();
        let batcher = Batcher::start(engine.clone(), ROOMY).unwrap();
        let heard = PROMPTS.map(|prompt| all_events(batcher.submit(job_for(&prompt)).unwrap()));
        assert_alone(&engine, &heard);
    }

    const PROMPTS: [[u32; 3]; 3] = [[5, 6, 7], [8, 9, 10], [11, 12, 13]];

    /// Room for every test's jobs at once, in two lanes.
    const ROOMY: Limits = Limits {
        max_batch: 8,
        micro_batches: 2,
        queue: 8,
        cache_bytes: usize::MAX,
    };

    /// A generation that runs to the end of the model's context, long enough for a test to
    /// act while it does (the test checks that it has not ended).
    fn long_job(model: &Model) -> Job {
        let prompt = &PROMPTS[0];
        Job {
            max_new: model.config().max_position_embeddings - prompt.len(),
            ..job_for(prompt)
        }
    }

    /// A generation that was placed, and has its first token.
    fn running(batcher: &Batcher, job: Job) -> Generation {
        let mut events = batcher.submit(job).unwrap();
        assert!(matches!(
            events.events.blocking_recv(),
            Some(Event::Token(_))
        ));
        events
    }

    /// `events`' generation has not ended (or the test would prove nothing).
    fn assert_still_running(events: &mut Generation) {
        while let Ok(event) = events.events.try_recv() {
            assert!(matches!(event, Event::Token(_)), "it ended: {event:?}");
        }
    }

    fn assert_ends(events: Generation) {
        let heard = all_events(events);
        assert!(
            matches!(heard.last(), Some(Event::Done { .. })),
            "{heard:?}"
        );
    }

    /// The stats once no sequence is placed (a sequence gives its room back just after its
    /// caller heard its end); a minute without fails the test.
    fn settled(batcher: &Batcher) -> BatchStats {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let stats = batcher.stats();
            if stats.running == 0 {
                return stats;
            }
            assert!(std::time::Instant::now() < deadline, "{stats:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every event of a generation to its end; a generation that has not ended within a
    /// minute fails the test rather than hanging it.
    fn all_events(mut events: Generation) -> Vec<Event> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut heard = Vec::new();
            while let Some(event) = events.events.blocking_recv() {
                heard.push(event);
            }
            let _ = tx.send(heard);
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the generation ended within a minute")
    }
    const MAX_NEW: usize = 8;

    /// The tiny checkpoint with a context of 16,384 positions instead of 512, so that
    /// `long_job` runs for seconds, not the tenth of one that 512 tokens of the optimized
    /// tiny take.
    fn long_context_tiny() -> std::path::PathBuf {
        static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
        let dir = DIR.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            for entry in std::fs::read_dir(tiny_checkpoint()).unwrap() {
                let from = entry.unwrap().path();
                std::fs::copy(&from, dir.path().join(from.file_name().unwrap())).unwrap();
            }
            let path = dir.path().join("config.json");
            let mut config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            config["max_position_embeddings"] = 16_384.into();
            std::fs::write(&path, config.to_string()).unwrap();
            dir
        });
        dir.path().to_path_buf()
    }

    fn tiny_engine() -> Arc<Engine> {
        let (model, experts, tokenizer) = load_local(&long_context_tiny()).unwrap();
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
