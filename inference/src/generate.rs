//! Generation: sequences with their own KV cache and sampler, decoded together in batches
//! that sequences can join and leave between steps.

use std::collections::TryReserveError;

use crate::kernels::cpu::softmax;
use crate::model::qwen_moe::{Cache, ForwardError, Model, Step};
use crate::moe::ExpertExecutor;

/// How the next token is chosen: greedy when `temperature` is 0, else sampled from the
/// softmax at that temperature with a seeded generator (same seed, same tokens).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        seed: 0,
    };
}

/// SplitMix64: tiny, seedable, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// One sequence being generated.
pub struct Sequence {
    cache: Cache,
    /// Tokens to feed on the next step: the prompt first, then each new token.
    pending: Vec<u32>,
    generated: Vec<u32>,
    max_new: usize,
    end_tokens: Vec<u32>,
    sampling: Sampling,
    rng: Rng,
    last_logits: Vec<f32>,
}

impl Sequence {
    pub fn new(model: &Model, prompt: &[u32], max_new: usize, sampling: Sampling) -> Sequence {
        Sequence::with_cache(model.new_cache(), model, prompt, max_new, sampling)
    }

    /// A sequence whose cache is allocated whole up front (`Model::new_cache_for`), for a
    /// server that has checked `prompt` and `max_new` against the context and its memory;
    /// an error when the allocator cannot give that memory.
    pub fn with_reserved_cache(
        model: &Model,
        prompt: &[u32],
        max_new: usize,
        sampling: Sampling,
    ) -> Result<Sequence, TryReserveError> {
        let cache = model.new_cache_for(prompt.len().saturating_add(max_new))?;
        Ok(Sequence::with_cache(
            cache, model, prompt, max_new, sampling,
        ))
    }

    fn with_cache(
        cache: Cache,
        model: &Model,
        prompt: &[u32],
        max_new: usize,
        sampling: Sampling,
    ) -> Sequence {
        Sequence {
            cache,
            pending: prompt.to_vec(),
            generated: Vec::new(),
            max_new,
            end_tokens: model.config().end_tokens().to_vec(),
            sampling,
            rng: Rng(sampling.seed),
            last_logits: Vec::new(),
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Logits of the last step.
    pub fn last_logits(&self) -> &[f32] {
        &self.last_logits
    }

    pub fn is_done(&self) -> bool {
        self.pending.is_empty() || self.generated.len() >= self.max_new || self.ended()
    }

    /// Whether the last token generated is one of the model's end tokens.
    pub fn ended(&self) -> bool {
        self.generated
            .last()
            .is_some_and(|t| self.end_tokens.contains(t))
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.sampling.temperature <= 0.0 {
            // Greedy; the lowest id wins a tie.
            let mut best = 0;
            for (i, v) in logits.iter().enumerate() {
                if *v > logits[best] {
                    best = i;
                }
            }
            return best as u32;
        }
        let mut probs: Vec<f32> = logits
            .iter()
            .map(|l| l / self.sampling.temperature)
            .collect();
        softmax(&mut probs);
        let target = self.rng.next_f32();
        let mut cumulative = 0f32;
        for (i, p) in probs.iter().enumerate() {
            cumulative += p;
            if target < cumulative {
                return i as u32;
            }
        }
        (probs.len() - 1) as u32
    }
}

/// One decode step for every unfinished sequence in `batch`: a single forward pass over
/// all their pending tokens, then one new token each.
pub fn step(
    model: &Model,
    experts: &dyn ExpertExecutor,
    batch: &mut [&mut Sequence],
) -> Result<(), ForwardError> {
    let mut active: Vec<&mut Sequence> = batch
        .iter_mut()
        .filter(|s| !s.is_done())
        .map(|s| &mut **s)
        .collect();
    if active.is_empty() {
        return Ok(());
    }
    let pending: Vec<Vec<u32>> = active
        .iter_mut()
        .map(|s| std::mem::take(&mut s.pending))
        .collect();
    let mut steps: Vec<Step<'_>> = active
        .iter_mut()
        .zip(&pending)
        .map(|(s, tokens)| Step {
            cache: &mut s.cache,
            tokens,
        })
        .collect();
    let logits = model.forward(&mut steps, experts)?;
    drop(steps);
    for (sequence, logits) in active.into_iter().zip(logits) {
        let next = sequence.choose(&logits);
        sequence.last_logits = logits;
        sequence.generated.push(next);
        sequence.pending = vec![next];
    }
    Ok(())
}

/// Decode split into micro-batches that are in flight at once: while one waits for its
/// remote experts at a layer, another runs attention, its router and its local experts. Each
/// micro-batch runs on a thread of its own with a thread pool of its own, so a pass blocked
/// on the network holds no thread another pass could compute on, and steps on its own: no
/// micro-batch waits for another between steps, so they fall out of phase and one's wait
/// covers the others' compute (a barrier each step would start them together, computing
/// together and then all waiting together). A sequence's tokens and logits are the same bits
/// with any number of micro-batches (a row's bits depend on nothing else in its batch, nor on
/// the thread count).
pub struct Pipeline {
    pools: Vec<rayon::ThreadPool>,
}

impl Pipeline {
    /// `micro_batches` pools of `threads` threads each (at least one of each).
    pub fn new(
        micro_batches: usize,
        threads: usize,
    ) -> Result<Pipeline, rayon::ThreadPoolBuildError> {
        let pools = (0..micro_batches.max(1))
            .map(|i| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .thread_name(move |t| format!("micro-batch-{i}-{t}"))
                    .build()
            })
            .collect::<Result<_, _>>()?;
        Ok(Pipeline { pools })
    }

    pub fn micro_batches(&self) -> usize {
        self.pools.len()
    }

    /// Runs `lane` on each of `work` (at most one item per micro-batch) at once, each on a
    /// thread of its own inside its micro-batch's pool, and returns their results in order.
    /// A lane that panics panics this call, after the others returned.
    pub fn in_flight<W: Send, T: Send>(
        &self,
        work: impl IntoIterator<Item = W>,
        lane: impl Fn(W) -> T + Sync,
    ) -> Vec<T> {
        let lane = &lane;
        std::thread::scope(|scope| {
            let lanes: Vec<_> = work
                .into_iter()
                .zip(&self.pools)
                .map(|(work, pool)| scope.spawn(move || pool.install(|| lane(work))))
                .collect();
            lanes
                .into_iter()
                .map(|running| {
                    running
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect()
        })
    }

    /// Up to `steps` decode steps for every sequence in `batch`, split into up to
    /// `micro_batches` contiguous groups that each `step` on their own.
    pub fn decode(
        &self,
        model: &Model,
        experts: &dyn ExpertExecutor,
        batch: &mut [&mut Sequence],
        steps: usize,
    ) -> Result<(), ForwardError> {
        let size = batch.len().div_ceil(self.pools.len()).max(1);
        self.in_flight(batch.chunks_mut(size), |group| {
            (0..steps).try_for_each(|_| step(model, experts, group))
        })
        .into_iter()
        .collect()
    }
}

/// Generates up to `max_new` tokens after `prompt` for one sequence.
pub fn generate(
    model: &Model,
    experts: &dyn ExpertExecutor,
    prompt: &[u32],
    max_new: usize,
    sampling: Sampling,
) -> Result<Sequence, ForwardError> {
    let mut sequence = Sequence::new(model, prompt, max_new, sampling);
    while !sequence.is_done() {
        step(model, experts, &mut [&mut sequence])?;
    }
    Ok(sequence)
}
