//! The decode benchmark: the prefill of one long prompt, and decode at several batch sizes,
//! each next to a reference measured in the same run. For batch-1 decode, on all threads
//! and on one, the memory-bandwidth bound: the bytes a token must read over this machine's
//! measured read bandwidth. For batched decode and the prefill, the `gemm` crate replaying
//! the pass's own matrix products (their shapes recorded from the pass, in order, with
//! weights drawn from a pool larger than the last-level cache, so they stream from memory
//! as the model's do): the time a tuned library spends on the matrix work alone, and the
//! engine's kernel on the same replay. gemm has no bf16, so it reads weights widened to f32.
//! Every figure is the best of `RUNS` runs. The gemm reference is built only with the
//! feature `bench-reference`, so that the production build carries no gemm.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvasir_inference::config::Config;
use kvasir_inference::generate::{step, Sampling, Sequence};
use kvasir_inference::kernels::cpu::{isa, record_shapes, Shape};
use kvasir_inference::model::qwen_moe::{ForwardError, Model};
use kvasir_inference::moe::{ExpertExecutor, ExpertRequest, LocalExperts};
use rayon::prelude::*;

use kvasir_node::engine::load_local;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (the `bench` preset is sized for this: `model synth --preset bench`).
    #[arg(long)]
    model: PathBuf,
    /// Decode steps timed at batch 1.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Tokens of the prompt whose prefill is timed (at most the model's context less one).
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const PROMPT_LEN: usize = 8;
const BATCHES: [usize; 4] = [1, 8, 64, 256];

/// Read bandwidth on the current thread pool: best of three passes over 1 GiB.
fn read_bandwidth() -> f64 {
    let words: Vec<u64> = (0..(1usize << 27))
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        let sum: u64 = words
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, b| a.wrapping_add(*b)))
            .sum();
        std::hint::black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words.len() * 8) as f64 / best
}

fn prompt(seed: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((seed * 7919 + i * 104_729) % (vocab - 1) + 1) as u32)
        .collect()
}

/// Evaluates every expert once, so the timed steps find all the memory-mapped weights paged
/// in: a short decode routes to only some experts, and a page fault costs more than its read.
fn page_in(experts: &LocalExperts, config: &Config) -> Result<()> {
    for layer in config.moe_layers() {
        let requests: Vec<ExpertRequest> = (0..config.num_experts)
            .map(|expert| ExpertRequest {
                expert,
                tokens: vec![0],
                rows: vec![0.0; config.hidden_size],
            })
            .collect();
        experts.evaluate(layer, &requests)?;
    }
    Ok(())
}

/// `batch` fresh sequences of the benchmark's prompt, with room for `steps` more tokens.
fn sequences(model: &Model, batch: usize, prompt_len: usize, steps: usize) -> Vec<Sequence> {
    let vocab = model.config().vocab_size;
    (0..batch)
        .map(|s| {
            Sequence::new(
                model,
                &prompt(s, prompt_len, vocab),
                steps + 1,
                Sampling::GREEDY,
            )
        })
        .collect()
}

/// Tokens per second over `steps` decode steps of `batch` sequences (prefill not timed).
pub(super) fn decode_rate(
    model: &Model,
    experts: &dyn ExpertExecutor,
    batch: usize,
    steps: usize,
) -> Result<f64> {
    timed_decode(model, batch, steps, |refs, steps| {
        (0..steps).try_for_each(|_| step(model, experts, refs))
    })
}

/// Tokens per second of `decode(batch, steps)` over `batch` fresh sequences, after an
/// untimed first step (the prefill: `decode` is called for 1 step, then for `steps`).
pub(super) fn timed_decode(
    model: &Model,
    batch: usize,
    steps: usize,
    mut decode: impl FnMut(&mut [&mut Sequence], usize) -> Result<(), ForwardError>,
) -> Result<f64> {
    let mut sequences = sequences(model, batch, PROMPT_LEN, steps);
    let mut refs: Vec<&mut Sequence> = sequences.iter_mut().collect();
    decode(&mut refs, 1)?;
    let start = Instant::now();
    decode(&mut refs, steps)?;
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}

/// Best of `RUNS` runs, for every figure alike: the machine's noise only slows a run.
pub(super) const RUNS: usize = 3;

pub(super) fn best_of(mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    best_run_of(|| Ok((run()?, ()))).map(|(rate, ())| rate)
}

/// As `best_of`, for runs that measure more than their rate: the fastest run, whole.
pub(super) fn best_run_of<T>(mut run: impl FnMut() -> Result<(f64, T)>) -> Result<(f64, T)> {
    let mut best = run()?;
    for _ in 1..RUNS {
        let next = run()?;
        if next.0 > best.0 {
            best = next;
        }
    }
    Ok(best)
}

/// Prompt tokens per second of one sequence's prefill of `len` tokens.
fn prefill_rate(model: &Model, experts: &dyn ExpertExecutor, len: usize) -> Result<f64> {
    let mut sequences = sequences(model, 1, len, 1);
    let mut refs: Vec<&mut Sequence> = sequences.iter_mut().collect();
    let start = Instant::now();
    step(model, experts, &mut refs)?;
    Ok(len as f64 / start.elapsed().as_secs_f64())
}

/// The matrix products of one decode step of `batch` sequences (after their prefill), or of
/// the prefill itself when `decode` is false.
fn pass_shapes(
    model: &Model,
    experts: &dyn ExpertExecutor,
    batch: usize,
    prompt_len: usize,
    decode: bool,
) -> Result<Vec<Shape>> {
    let mut sequences = sequences(model, batch, prompt_len, 1);
    let mut refs: Vec<&mut Sequence> = sequences.iter_mut().collect();
    if decode {
        step(model, experts, &mut refs)?;
    }
    let (result, shapes) = record_shapes(|| step(model, experts, &mut refs));
    result?;
    Ok(shapes)
}

/// One timed figure: tokens per second, and the tokens of the pass whose products the
/// references replay.
struct Figure {
    name: String,
    batch: usize,
    steps: usize,
    tok_s: f64,
    /// Tokens per second the references would reach on the pass's matrix work alone.
    replay: Option<Replay>,
}

#[derive(Clone, Copy)]
struct Replay {
    gemm_tok_s: f64,
    kernel_tok_s: f64,
}

/// The `gemm` crate, and this engine's kernel, replaying a pass's matrix products
/// (feature `bench-reference`).
#[cfg(feature = "bench-reference")]
mod reference {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    use anyhow::{bail, Result};
    use kvasir_inference::kernels::cpu::{matmul_t, Shape};
    use kvasir_inference::weights::{DType, Weight};

    /// Bytes of f32 weights per distinct weight shape: past this machine's last-level cache
    /// (260 MiB was seen here), so that weights stream from memory as the model's do.
    const POOL_BYTES: usize = 512 << 20;

    /// Weights of one shape, each both as f32 (for gemm) and as stored (for the kernel).
    struct Pool {
        f32s: Vec<Vec<f32>>,
        stored: Vec<Weight>,
    }

    fn pool(n: usize, k: usize, dtype: DType, uses: usize) -> Pool {
        let count = (POOL_BYTES / (n * k * 4).max(1)).clamp(1, uses);
        let (mut f32s, mut stored) = (Vec::new(), Vec::new());
        for copy in 0..count {
            let values: Vec<f32> = (0..n * k)
                .map(|i| ((i * 53 + copy * 7919) % 97) as f32 / 128.0 - 0.375)
                .collect();
            stored.push(match dtype {
                // The values are multiples of 2^-7 below 1: exact in bf16.
                DType::BF16 | DType::F16 => {
                    let bits: Vec<u16> =
                        values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                    Weight::from_bf16(&bits, n, k)
                }
                DType::F32 | DType::Quantized(_) => Weight::from_f32(values.clone(), n, k),
            });
            f32s.push(values);
        }
        Pool { f32s, stored }
    }

    /// The time gemm and the kernel each take for `shapes` in order, best of 3 each
    /// (alternated, so a slow spell of the machine falls on both alike).
    pub(super) fn replay(shapes: &[Shape]) -> Result<(Duration, Duration)> {
        let mut uses: HashMap<(usize, usize, DType), usize> = HashMap::new();
        for s in shapes {
            if s.dtype.block_format().is_some() {
                bail!("the gemm replay takes bf16 and f32 products, not quantized ones");
            }
            *uses.entry((s.n, s.k, s.dtype)).or_default() += 1;
        }
        let pools: HashMap<_, Pool> = uses
            .iter()
            .map(|(&(n, k, dtype), &count)| ((n, k, dtype), pool(n, k, dtype, count)))
            .collect();
        let widest = shapes
            .iter()
            .map(|s| s.rows * s.n.max(s.k))
            .max()
            .unwrap_or(0);
        let x: Vec<f32> = (0..widest)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let (mut ours, mut theirs) = (vec![0f32; widest], vec![0f32; widest]);
        let threads = rayon::current_num_threads();
        // Which copy of its pool each product reads: the pools are walked in turn.
        let mut next: HashMap<(usize, usize, DType), usize> = HashMap::new();
        let picks: Vec<usize> = shapes
            .iter()
            .map(|s| {
                let key = (s.n, s.k, s.dtype);
                let at = next.entry(key).or_default();
                let pick = *at % pools[&key].f32s.len();
                *at += 1;
                pick
            })
            .collect();
        for (s, &pick) in shapes.iter().zip(&picks) {
            let pool = &pools[&(s.n, s.k, s.dtype)];
            let (x, out) = (&x[..s.rows * s.k], s.rows * s.n);
            matmul_t(x, s.rows, &pool.stored[pick], &mut ours[..out]);
            gemm_f32(s, x, &pool.f32s[pick], &mut theirs[..out], threads);
            let max_diff = ours[..out]
                .iter()
                .zip(&theirs[..out])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            if max_diff >= 1e-2 {
                bail!("the kernel and gemm disagree by {max_diff} on {s:?}");
            }
        }
        let (mut kernel, mut gemm) = (Duration::MAX, Duration::MAX);
        for _ in 0..3 {
            let start = Instant::now();
            for (s, &pick) in shapes.iter().zip(&picks) {
                let pool = &pools[&(s.n, s.k, s.dtype)];
                let out = &mut ours[..s.rows * s.n];
                matmul_t(&x[..s.rows * s.k], s.rows, &pool.stored[pick], out);
            }
            kernel = kernel.min(start.elapsed());
            let start = Instant::now();
            for (s, &pick) in shapes.iter().zip(&picks) {
                let pool = &pools[&(s.n, s.k, s.dtype)];
                let out = &mut theirs[..s.rows * s.n];
                gemm_f32(s, &x[..s.rows * s.k], &pool.f32s[pick], out, threads);
            }
            gemm = gemm.min(start.elapsed());
        }
        Ok((gemm, kernel))
    }

    /// `out (rows x n) = x (rows x k) * w^T` for `w` of `n x k`, row-major.
    #[allow(unsafe_code)]
    fn gemm_f32(s: &Shape, x: &[f32], w: &[f32], out: &mut [f32], threads: usize) {
        let Shape { rows, n, k, .. } = *s;
        assert!(x.len() == rows * k && w.len() == n * k && out.len() == rows * n);
        // SAFETY: the lengths asserted above make every pointer cover its matrix: x is
        // rows x k (row-major), w^T is read as k x n with column stride `k`, the output is
        // rows x n; nothing else aliases `out`.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(threads),
            )
        }
    }
}

/// Without the `bench-reference` feature there is no gemm to compare with.
const NO_REFERENCE: &str =
    "gemm replay not measured: built without the gemm reference (add --features bench-reference)";

/// The gemm crate multiplies floats: a quantized model's products have no gemm to replay.
const QUANTIZED: &str =
    "gemm replay not measured: gemm has no quantized products (compare with llama.cpp instead)";

/// Whether a pass's products are quantized (a GGUF model's).
fn quantized(shapes: &[Shape]) -> bool {
    shapes.iter().any(|s| s.dtype.block_format().is_some())
}

#[cfg(feature = "bench-reference")]
fn replay(shapes: &[Shape], tokens: usize) -> Result<Option<Replay>> {
    if quantized(shapes) {
        return Ok(None);
    }
    let (gemm, kernel) = reference::replay(shapes)?;
    let rate = |time: std::time::Duration| tokens as f64 / time.as_secs_f64();
    Ok(Some(Replay {
        gemm_tok_s: rate(gemm),
        kernel_tok_s: rate(kernel),
    }))
}

#[cfg(not(feature = "bench-reference"))]
fn replay(_: &[Shape], _: usize) -> Result<Option<Replay>> {
    Ok(None)
}

/// Batch-1 decode on one thread, and that thread's bandwidth bound.
fn one_thread(
    model: &Model,
    experts: &dyn ExpertExecutor,
    tokens: usize,
    bytes_per_token: usize,
) -> Result<(f64, f64)> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("a one-thread pool")?;
    pool.install(|| {
        let bound = read_bandwidth() / bytes_per_token as f64;
        let rate = best_of(|| decode_rate(model, experts, 1, tokens))?;
        Ok((rate, bound))
    })
}

pub fn run(args: Args) -> Result<()> {
    let (model, experts, _) = load_local(&args.model)?;
    let config = model.config().clone();
    if config.vocab_size < 2 {
        bail!("the model's vocabulary is too small to benchmark");
    }
    let prefill_len = args
        .prefill
        .min(config.max_position_embeddings.saturating_sub(1));
    if prefill_len == 0 || args.tokens == 0 {
        bail!("--prefill and --tokens must be at least 1");
    }
    let bandwidth = read_bandwidth();
    page_in(&experts, &config)?;
    decode_rate(&model, &experts, 1, 4)?;
    let mut figures = Vec::new();
    let mut quantized_model = false;
    for batch in BATCHES {
        let steps = match batch {
            1 => args.tokens,
            256.. => 2,
            _ => 4,
        };
        let tok_s = best_of(|| decode_rate(&model, &experts, batch, steps))?;
        let replay = match batch {
            1 => None,
            _ => {
                let shapes = pass_shapes(&model, &experts, batch, PROMPT_LEN, true)?;
                quantized_model |= quantized(&shapes);
                replay(&shapes, batch)?
            }
        };
        figures.push(Figure {
            name: format!("decode at batch {batch}"),
            batch,
            steps,
            tok_s,
            replay,
        });
    }
    let prefill = Figure {
        name: format!("prefill of {prefill_len} tokens"),
        batch: 1,
        steps: 1,
        tok_s: best_of(|| prefill_rate(&model, &experts, prefill_len))?,
        replay: replay(
            &pass_shapes(&model, &experts, 1, prefill_len, false)?,
            prefill_len,
        )?,
    };
    let batch1 = figures[0].tok_s;
    let moe_layers = config.moe_layers().count();
    let context = PROMPT_LEN + args.tokens / 2;
    let bytes_per_token = model.dense_bytes_per_token()
        + moe_layers * config.num_experts_per_tok * experts.expert_bytes()
        + model.cache_bytes(context);
    let bound = bandwidth / bytes_per_token as f64;
    let bandwidth_ratio = batch1 / bound;
    let (batch1_1thread, bound_1thread) =
        one_thread(&model, &experts, args.tokens, bytes_per_token)?;
    let kernels = format!("{:?}", isa());

    if args.json {
        let replayed = |f: &Figure| match f.replay {
            Some(r) => serde_json::json!({
                "gemm_replay_tok_s": r.gemm_tok_s,
                "kernel_replay_tok_s": r.kernel_tok_s,
                "x_gemm_replay": f.tok_s / r.gemm_tok_s,
            }),
            None => serde_json::json!({}),
        };
        let mut by_batch = Vec::new();
        for f in &figures {
            let mut entry = serde_json::json!({"batch": f.batch, "steps": f.steps, "tok_s": f.tok_s, "x_batch1": f.tok_s / batch1});
            merge(&mut entry, replayed(f));
            by_batch.push(entry);
        }
        let mut prefill_entry = serde_json::json!({"tokens": prefill_len, "tok_s": prefill.tok_s});
        merge(&mut prefill_entry, replayed(&prefill));
        let mut value = serde_json::json!({
            "model": args.model,
            "threads": rayon::current_num_threads(),
            "kernels": kernels,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "bytes_per_token": bytes_per_token,
            "bound_tok_s": bound,
            "batch1_tok_s": batch1,
            "bandwidth_ratio": bandwidth_ratio,
            "batch1_1thread_tok_s": batch1_1thread,
            "bound_1thread_tok_s": bound_1thread,
            "bandwidth_ratio_1thread": batch1_1thread / bound_1thread,
            "prefill_tok_s": prefill.tok_s,
            "prefill": prefill_entry,
            "statistic": format!("best of {RUNS} runs for every figure"),
            "tok_s_by_batch": by_batch,
        });
        if prefill.replay.is_none() {
            let note = if quantized_model {
                QUANTIZED
            } else {
                NO_REFERENCE
            };
            value["gemm_replay_note"] = note.into();
        }
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench decode: {} ({} threads, {kernels} kernels)",
        args.model.display(),
        rayon::current_num_threads()
    );
    println!("{:<32} {:>14}  reference", "figure", "value");
    println!(
        "{:<32} {:>9.2} GB/s  1 GiB read on all cores, best of 3",
        "read bandwidth",
        bandwidth / 1e9
    );
    println!(
        "{:<32} {:>9.1} MB    active weights + KV cache",
        "bytes read per token",
        bytes_per_token as f64 / 1e6
    );
    println!(
        "{:<32} {:>8.2} tok/s  bandwidth / bytes per token",
        "memory-bandwidth bound", bound
    );
    for f in figures.iter().chain([&prefill]) {
        let reference = match f.replay {
            Some(r) => format!(
                "gemm replaying its products {:.1} tok/s (x{:.2}); the kernel replaying them {:.1}",
                r.gemm_tok_s,
                f.tok_s / r.gemm_tok_s,
                r.kernel_tok_s
            ),
            None if std::ptr::eq(f, &figures[0]) => {
                format!("bound {bound:.1} tok/s: bandwidth_ratio {bandwidth_ratio:.3}")
            }
            None if quantized_model => QUANTIZED.to_string(),
            None => NO_REFERENCE.to_string(),
        };
        println!("{:<32} {:>8.2} tok/s  {reference}", f.name, f.tok_s);
    }
    println!(
        "{:<32} {:>8.2} tok/s  one thread's bound {:.1} tok/s: ratio {:.3}",
        "decode at batch 1, 1 thread",
        batch1_1thread,
        bound_1thread,
        batch1_1thread / bound_1thread
    );
    println!("(best of {RUNS} runs for every figure; target bandwidth_ratio >= 0.6)");
    Ok(())
}

/// `into`'s fields with `from`'s added.
fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(into), serde_json::Value::Object(from)) = (into.as_object_mut(), from) {
        into.extend(from);
    }
}
